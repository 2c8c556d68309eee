"""`vllm serve --task transcription` (the default Whisper tiny.en) end to end with the official
`openai` client, against offline `LLM.generate` on the same audio.

One server for the module, with an API key and small audio limits so that the limit checks
are cheap to reach; an offline `LLM` with the same engine settings gives the expected text.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import os
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile

from tests.longform_audio import SENTENCES, recording
from tests.model_factory import make_tiny_whisper
from tests.server_utils import RemoteServer, scrape_metrics
from tests.wer import normalize_words
from vllm import LLM, SamplingParams
from vllm.entrypoints import cli
from vllm.entrypoints.longform import (
    EngineRequest,
    WindowDecoder,
    collect,
    decode_rounds,
    make_setup,
    plan_windows,
)
from vllm.inputs.audio_file import decode_audio_file
from vllm.inputs.whisper import decoder_prompt, join_texts, language_name, language_token_ids
from vllm.transformers_utils.default_model import default_whisper_model_path
from vllm.v1.executor.uniproc import UniProcExecutor

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

DATA = Path(__file__).parent / "data"
CLIPS: dict[str, str] = json.loads((DATA / "speech_clips.json").read_text())
NAME = "whisper-tiny.en"  # the default model's served name
API_KEY = "transcribe-key"
RATE = 16_000
MAX_FILE_BYTES = 4 * 2**20
MAX_SECONDS = 120
ENGINE_ARGS = ["--dtype", "float32", "--kv-cache-memory-bytes", "512MiB", "--seed", "0",
               "--enforce-eager"]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(None, ["--task", "transcription", "--api-key", API_KEY,
                              "--max-audio-file-size", str(MAX_FILE_BYTES),
                              "--max-audio-seconds", str(MAX_SECONDS), *ENGINE_ARGS])
    yield srv
    assert srv.stop() == 0, srv.final_log


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(default_whisper_model_path(), dtype="float32",
               kv_cache_memory_bytes=512 * 2**20, seed=0, enforce_eager=True)


def read_clip(name: str | Path) -> np.ndarray:
    samples, rate = soundfile.read(DATA / name, dtype="float32")
    assert rate == RATE
    return samples


def wav_bytes(samples: np.ndarray, rate: int = RATE) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def offline_long_form(offline: LLM, audios: list[np.ndarray]) -> tuple[list[str], int, int]:
    """What the long-form pipeline gives on `vllm.LLM` for each audio (greedy, as the server
    by default), in one batch per round; and the prompt and completion tokens of all its
    engine requests (attempts, and no-speech probes where an attempt's avg_logprob fails, as
    for the server's json and text answers)."""
    tokenizer = offline.get_tokenizer()
    config = offline.llm_engine.vllm_config.model_config
    prompt_ids = decoder_prompt(tokenizer, config.hf_config, language=None, task="transcribe",
                                previous_text_ids=[], timestamps=True,
                                max_model_len=config.max_model_len)
    setup = make_setup(tokenizer, prompt_ids, SamplingParams(temperature=0, max_tokens=224),
                       report_no_speech=False)
    decoders = [[WindowDecoder(samples, w, setup) for w in plan_windows(samples)]
                for samples in audios]
    used = [0, 0]

    def generate(requests: list[EngineRequest]):
        outputs = offline.generate([p for p, _ in requests], [sp for _, sp in requests],
                                   use_tqdm=False)
        used[0] += sum(len(o.prompt_token_ids or []) for o in outputs)
        used[1] += sum(len(o.outputs[0].token_ids) for o in outputs)
        return outputs

    decode_rounds([d for file in decoders for d in file], generate)
    texts = [join_texts([tokenizer.decode(s.token_ids) for s in collect(file)])
             for file in decoders]
    return texts, used[0], used[1]


def offline_texts(offline: LLM, audios: list[np.ndarray]) -> list[str]:
    return offline_long_form(offline, audios)[0]


@pytest.fixture(scope="module")
def long_audio(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """~34 s: the three clips three times over, 1 s of silence after each, and the
    sentences it says, in order."""
    silence = np.zeros(RATE, np.float32)
    names = list(CLIPS) * 3
    samples = np.concatenate([part for name in names for part in (read_clip(name), silence)])
    path = tmp_path_factory.mktemp("audio") / "long.wav"
    path.write_bytes(wav_bytes(samples))
    return path, " ".join(CLIPS[name] for name in names)


@pytest.fixture(scope="module")
def long_expected(offline: LLM, long_audio: tuple[Path, str]) -> str:
    """The offline long-form text of `long_audio` (computed once: two tests need it)."""
    return offline_texts(offline, [read_clip(long_audio[0])])[0]


def transcribe(client: openai.OpenAI, data: bytes | Path, **kwargs):
    file = data.read_bytes() if isinstance(data, Path) else data
    return client.audio.transcriptions.create(model=NAME, file=("audio.wav", file), **kwargs)


# ---- the endpoint against offline ----------------------------------------------------


def test_models_health_and_api_key(server: RemoteServer, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(f"{server.url}/health").status_code == 200
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        transcribe(wrong, DATA / "call_me.wav")


def test_clips_match_offline(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline_texts(offline, [read_clip(name) for name in CLIPS])
    for (name, sentence), text in zip(CLIPS.items(), expected):
        assert normalize_words(text) == normalize_words(sentence)
        with open(DATA / name, "rb") as f:  # the plain openai-client call
            assert client.audio.transcriptions.create(model=NAME, file=f).text == text


def test_formats_agree(client: openai.OpenAI, offline: LLM) -> None:
    name = "sun_sky.wav"
    expected = offline_texts(offline, [read_clip(name)])[0]
    assert transcribe(client, DATA / name, response_format="text").strip() == \
        expected.strip()
    verbose = transcribe(client, DATA / name, response_format="verbose_json")
    assert verbose.text == expected and verbose.language == "english"
    assert verbose.duration == pytest.approx(len(read_clip(name)) / RATE)
    assert [s.text for s in verbose.segments] == [expected]
    assert 0.0 == verbose.segments[0].start < verbose.segments[0].end <= verbose.duration
    stream = transcribe(client, DATA / name, stream=True)
    chunks = [c.choices[0]["delta"]["content"] for c in stream if c.choices]
    # One delta per segment (sent once its window is final), then the done event's "".
    assert len(chunks) == len(verbose.segments) + 1 and "".join(chunks) == expected


def test_long_audio_is_split_and_joined(client: openai.OpenAI, long_audio: tuple[Path, str],
                                        long_expected: str) -> None:
    path, sentences = long_audio
    samples = read_clip(path)
    assert len(plan_windows(samples)) == 1  # its 1 s silences left out: 22 s of speech
    expected = long_expected
    assert normalize_words(expected) == normalize_words(sentences)
    assert transcribe(client, path).text == expected
    stream = transcribe(client, path, stream=True, extra_body={"stream_include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0]["delta"]["content"] for c in chunks if c.choices) == expected
    assert chunks[-1].text == expected and chunks[-1].usage.completion_tokens > 0
    verbose = transcribe(client, path, response_format="verbose_json")
    assert normalize_words(verbose.text) == normalize_words(sentences)
    assert verbose.duration == pytest.approx(len(samples) / RATE)
    starts = [s.start for s in verbose.segments]
    # Segments come from timestamp tokens, in the file's clock (the window's pieces mapped).
    assert starts == sorted(starts) and 0.0 <= starts[0] < 1.0
    assert 25.0 < verbose.segments[-1].end <= verbose.duration + 1e-6


def test_stream_equals_long_form_across_long_pauses(server: RemoteServer, offline: LLM
                                                    ) -> None:
    """A recording with a 12 s and a 5 s pause (three speech windows; the issue's lost
    speech came after such a pause): the stream sends each window's text in order and ends
    with exactly the non-streamed text, which is the offline long-form text; its usage counts
    every engine request (attempts, and the no-speech probes a json answer needs), as
    offline."""
    speech = recording([SENTENCES[i] for i in (3, 11, 16, 24, 7)], [0.6, 12.0, 0.5, 5.0, 0.5])
    assert len(plan_windows(speech.samples)) == 3
    data = wav_bytes(speech.samples)
    [expected], prompt_tokens, completion_tokens = offline_long_form(
        offline, [decode_audio_file(data, MAX_SECONDS)])
    heard = normalize_words(expected)
    assert all(normalize_words(s)[-1] in heard for s in speech.sentences)  # nothing lost

    def post(**fields) -> httpx.Response:
        response = httpx.post(f"{server.url}/v1/audio/transcriptions", timeout=120,
                              headers={"Authorization": f"Bearer {API_KEY}"},
                              data={"model": NAME, **fields}, files={"file": ("a.wav", data)})
        assert response.status_code == 200, response.text
        return response

    assert post().json()["text"] == expected
    events = [json.loads(line[6:]) for line in post(stream="true", stream_include_usage="true")
              .text.splitlines() if line.startswith("data: {")]
    *deltas, done = events
    assert len(deltas) >= 3 and all(e["delta"] for e in deltas)  # a delta per segment
    assert "".join(e["delta"] for e in deltas) == done["text"] == expected
    assert [e["choices"][0]["finish_reason"] for e in deltas] == [None] * (len(deltas) - 1) + \
        ["stop"]
    assert (done["usage"]["prompt_tokens"], done["usage"]["completion_tokens"]) == \
        (prompt_tokens, completion_tokens)


def test_word_timestamps_and_subtitles(client: openai.OpenAI) -> None:
    """verbose_json with word timings (the alignment pass), and srt / vtt cues that are the
    same segments."""
    name = "train_station.wav"
    verbose = transcribe(client, DATA / name, response_format="verbose_json",
                         timestamp_granularities=["word", "segment"])
    assert normalize_words(verbose.text) == normalize_words(CLIPS[name])
    words = verbose.words
    assert words is not None
    assert normalize_words(" ".join(w.word for w in words)) == normalize_words(verbose.text)
    starts = [w.start for w in words]
    assert starts == sorted(starts) and all(w.start <= w.end for w in words)
    segments = verbose.segments
    assert segments is not None
    assert all(any(s.start <= w.start and w.end <= s.end for s in segments) for w in words)
    assert words[-1].end - words[0].start > 1.0  # spread over the speech, not stacked
    srt = transcribe(client, DATA / name, response_format="srt")
    vtt = transcribe(client, DATA / name, response_format="vtt")
    cues = [line for line in srt.splitlines() if "-->" in line]
    assert len(cues) == len(segments) and vtt.startswith("WEBVTT")
    assert cues[0].replace(",", ".") in vtt


def test_formats_prompt_and_cli(client: openai.OpenAI, offline: LLM, tmp_path: Path,
                                capsys: pytest.CaptureFixture) -> None:
    samples, sentence = read_clip("train_station.wav"), CLIPS["train_station.wav"]
    stereo_32k = np.stack([samples, 0.5 * samples], axis=1).repeat(2, axis=0)
    for fmt, data, rate in [("OGG", samples, RATE), ("MP3", samples, RATE),
                            ("WAV", stereo_32k, 2 * RATE)]:
        buffer = io.BytesIO()
        soundfile.write(buffer, data, rate, format=fmt)
        text = transcribe(client, buffer.getvalue()).text
        assert normalize_words(text) == normalize_words(sentence), fmt
    # The prompt is previous text: it changes the decoder's context, not the words heard.
    prompted = transcribe(client, DATA / "train_station.wav", prompt="Travel plans.").text
    assert normalize_words(prompted) == normalize_words(sentence)
    path = tmp_path / "clip.wav"
    path.write_bytes((DATA / "sun_sky.wav").read_bytes())
    assert cli.main(["transcribe", str(path), "--dtype", "float32"]) == 0
    expected = offline_texts(offline, [read_clip("sun_sky.wav")])[0]
    assert capsys.readouterr().out.strip() == expected.strip()


def test_identical_uploads_run_the_encoder_once(offline: LLM) -> None:
    """Two uploads of the same file, decoded apart as the server does, give the same
    features: the second request reuses the first's cross-attention blocks."""
    data = (DATA / "call_me.wav").read_bytes()
    prompts = []
    for _ in range(2):
        waveform = decode_audio_file(data, MAX_SECONDS)
        prompts += [{"encoder_prompt": {"prompt": "", "multi_modal_data": {
                         "audio": (w.audio(waveform), RATE)}},
                     "decoder_prompt": {"prompt_token_ids": [50257, 50362]}}
                    for w in plan_windows(waveform)]
    executor = offline.llm_engine.engine_core.model_executor
    assert isinstance(executor, UniProcExecutor)  # offline, one rank
    runner = executor.model_runner.encoder_runner
    assert runner is not None  # an encoder/decoder model
    offline.llm_engine.reset_prefix_cache()
    before = runner.num_inputs_encoded
    outputs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=224),
                               use_tqdm=False)
    assert runner.num_inputs_encoded - before == 1
    assert outputs[0].outputs[0].text == outputs[1].outputs[0].text


def test_16_concurrent_uploads_equal_serial(client: openai.OpenAI, server: RemoteServer
                                            ) -> None:
    """Four different audios (the three clips and a quieter copy of one), each uploaded four
    times at once: the identical uploads also share cross-attention blocks."""
    clips = [read_clip(name) for name in CLIPS]
    files = [wav_bytes(a) for a in [*clips, 0.5 * clips[0]]]
    serial = [transcribe(client, f).text for f in files]

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY,
                                      max_retries=0, timeout=300) as aclient:
            calls = [aclient.audio.transcriptions.create(model=NAME, file=("a.wav", f))
                     for f in files * 4]
            return [r.text for r in await asyncio.gather(*calls)]

    assert asyncio.run(run()) == serial * 4


def test_metrics(server: RemoteServer, client: openai.OpenAI) -> None:
    """The audio metrics grow by exactly this test's requests (the server is shared with
    the module's other tests, which may run before or after it)."""
    clips = [read_clip(name) for name in CLIPS]
    before = scrape_metrics(server)
    for samples in clips:
        transcribe(client, wav_bytes(samples))
    transcribe(client, wav_bytes(clips[0]), response_format="verbose_json")
    after = scrape_metrics(server)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    success = f'vllm:audio_requests_total{{endpoint="transcriptions",model_name="{NAME}",' \
              'status="success"}'
    assert grew(success) == len(clips) + 1
    assert grew(f'vllm:audio_seconds_processed_total{{model_name="{NAME}"}}') == \
        pytest.approx((sum(len(samples) for samples in clips) + len(clips[0])) / RATE,
                      rel=1e-4)
    # Each clip is one speech window whose first attempt passes: one engine request for a
    # json answer (no no-speech probe needed), two for verbose_json (the decode and its
    # one-step probe, since the answer shows no_speech_prob).
    assert grew(f'vllm:time_to_first_token_seconds_count{{engine="0",model_name="{NAME}"}}') \
        == len(clips) + 2
    assert grew(f'vllm:audio_request_latency_seconds_count{{model_name="{NAME}"}}') == \
        len(clips) + 1


# ---- bad input ----------------------------------------------------------------------


def _bad_uploads(tmp_path: Path) -> dict[str, tuple[dict, dict, str]]:
    """name -> (form fields, files, a phrase the 400's message must contain)."""
    clip = (DATA / "call_me.wav").read_bytes()
    too_long = wav_bytes(np.zeros((MAX_SECONDS + 30) * 8000, np.float32), 8000)
    assert len(too_long) < MAX_FILE_BYTES
    empty = wav_bytes(np.zeros(0, np.float32))
    return {
        "not audio": ({}, {"file": ("a.wav", b"hello, I am text\n" * 100)}, "decoded as audio"),
        "empty file": ({}, {"file": ("a.wav", b"")}, "empty"),
        "zero-length audio": ({}, {"file": ("a.wav", empty)}, "no samples"),
        # random bytes: the size, not the content, is what is reported
        "over the size limit": ({}, {"file": ("a.wav", os.urandom(MAX_FILE_BYTES + 1))},
                                "--max-audio-file-size"),
        "too long": ({}, {"file": ("a.wav", too_long)}, "--max-audio-seconds"),
        "missing file": ({}, {}, "file"),
        "unknown response_format": ({"response_format": "xml"}, {"file": ("a.wav", clip)},
                                    "response_format"),
        "other language on .en": ({"language": "fr"}, {"file": ("a.wav", clip)},
                                  "English-only"),
        "stream with verbose_json": ({"stream": "true", "response_format": "verbose_json"},
                                     {"file": ("a.wav", clip)}, "stream"),
        "character timestamps": ({"timestamp_granularities[]": "char",
                                  "response_format": "verbose_json"},
                                 {"file": ("a.wav", clip)}, "not supported"),
        "word timestamps as json": ({"timestamp_granularities[]": "word"},
                                    {"file": ("a.wav", clip)}, "verbose_json"),
        "usage without stream": ({"stream_include_usage": "true"}, {"file": ("a.wav", clip)},
                                 "stream_include_usage can only be given with stream=true"),
        "continuous usage without stream": (
            {"stream_continuous_usage_stats": "true"}, {"file": ("a.wav", clip)},
            "stream_continuous_usage_stats can only be given with stream=true"),
        "no completion tokens": ({"max_completion_tokens": "0"}, {"file": ("a.wav", clip)},
                                 "max_completion_tokens must be at least 1"),
        "unknown language": ({"language": "hh"}, {"file": ("a.wav", clip)},
                             "Unknown language"),
    }


def test_bad_inputs_are_400_while_serving_another(server: RemoteServer,
                                                  long_audio: tuple[Path, str],
                                                  long_expected: str, tmp_path: Path) -> None:
    path, _ = long_audio
    headers = {"Authorization": f"Bearer {API_KEY}"}

    async def run() -> tuple[str, dict[str, httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     headers=headers) as http:
            async def long_stream() -> str:
                text = ""
                async with http.stream("POST", "/v1/audio/transcriptions",
                                       data={"model": NAME, "stream": "true"},
                                       files={"file": ("long.wav", path.read_bytes())}
                                       ) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            text += json.loads(line[6:])["choices"][0]["delta"]["content"]
                return text

            streaming = asyncio.ensure_future(long_stream())
            answers = {}
            for name, (fields, files, _) in _bad_uploads(tmp_path).items():
                answers[name] = await http.post("/v1/audio/transcriptions",
                                                data={"model": NAME, **fields}, files=files)
            answers["translation on .en"] = await http.post(
                "/v1/audio/translations", data={"model": NAME},
                files={"file": ("a.wav", (DATA / "call_me.wav").read_bytes())})
            assert not streaming.done()  # the bad requests were answered meanwhile
            return await streaming, answers

    streamed, answers = asyncio.run(run())
    phrases = {name: phrase for name, (_, _, phrase) in _bad_uploads(tmp_path).items()}
    phrases["translation on .en"] = "cannot translate"
    for name, response in answers.items():
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert error["code"] == 400 and phrases[name] in error["message"], (name, error)
    assert streamed == long_expected
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_every_transcription_field_is_honoured_or_refused(server: RemoteServer) -> None:
    """The field audit of the audio endpoints: each form field the request model defines is
    sent and seen to act (the formats, prompt, language and timestamp checks are above);
    fields it does not define, such as `chunking_strategy`, are refused by name."""
    from vllm.entrypoints.openai.protocol import TranscriptionRequest

    audio = (DATA / "call_me.wav").read_bytes()

    def post(**fields) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/audio/transcriptions", timeout=120,
                          headers={"Authorization": f"Bearer {API_KEY}"},
                          data={"model": NAME, **fields}, files={"file": ("a.wav", audio)})

    def text(**fields) -> str:
        response = post(**fields)
        assert response.status_code == 200, (fields, response.text)
        return response.json()["text"]

    greedy = text()
    assert post(model="nope").status_code == 404
    hot = {"temperature": "1.5", "seed": "3"}
    assert text(**hot) == text(**hot) != greedy != text(temperature="1.5", seed="4")
    for narrow in ({"top_p": "1e-6"}, {"top_k": "1"}, {"min_p": "1.0"}):
        assert text(**hot, **narrow) == greedy, narrow
    # Penalties: the repetition penalty counts the prompt's words too; the others, only the
    # output's, which a short greedy sentence does not repeat: they show in a sampled one.
    assert text(prompt=greedy, repetition_penalty="3.0") != text(prompt=greedy)
    for penalty in ("frequency_penalty", "presence_penalty"):
        assert text(**hot, **{penalty: "2.0"}) != text(**hot), penalty
    assert len(text(max_completion_tokens="3").split()) < len(greedy.split())
    events = [json.loads(line[6:]) for line in post(stream="true", stream_include_usage="true")
              .text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"]["content"] for e in events if e["choices"]) \
        == greedy and events[-1]["usage"]["completion_tokens"] > 0
    # Beam search: one beam is greedy; 5 (the default) transcribe the clip too; streaming,
    # sampling fields, and beam fields without beams are refused by name.
    assert text(use_beam_search="true", best_of="1") == greedy
    assert text(use_beam_search="true", length_penalty="0.5").strip()
    for fields, name in (({"stream": "true"}, "use_beam_search"),
                         ({"top_p": "0.5"}, "top_p")):
        response = post(use_beam_search="true", **fields)
        assert response.status_code == 400 and name in response.json()["error"]["message"]
    for field in ("best_of", "length_penalty"):
        response = post(**{field: "2"})
        assert response.status_code == 400 and field in response.json()["error"]["message"]
    checked = {"file", "model", "temperature", "seed", "top_p", "top_k", "min_p",
               "repetition_penalty", "frequency_penalty", "presence_penalty",
               "max_completion_tokens", "stream", "stream_include_usage",
               "stream_continuous_usage_stats", "language", "prompt", "response_format",
               "timestamp_granularities", "use_beam_search", "best_of", "length_penalty"}
    assert checked == set(TranscriptionRequest.model_fields)
    for field in ("chunking_strategy", "include[]", "known_speaker_names[]",
                  "to_language", "vllm_xargs"):
        response = post(**{field: "true"})
        assert response.status_code == 400 and field in response.json()["error"]["message"]


# ---- vLLM's transcription API: usage, streams for both readers, 404s, fields -----------


def test_usage_and_streams_read_by_openai_and_vllm_clients(client: openai.OpenAI,
                                                           offline: LLM) -> None:
    """Non-streamed answers carry vLLM's duration usage; every stream event is both an
    OpenAI transcription event and a vLLM chunk (vLLM's own test cases read `choices[0]`
    of every chunk, and expect a last chunk without choices when the usage is asked for)."""
    path, samples = DATA / "call_me.wav", read_clip("call_me.wav")
    seconds = math.ceil(len(samples) / RATE)
    plain = transcribe(client, path)
    assert (plain.usage.type, plain.usage.seconds) == ("duration", seconds)
    verbose = transcribe(client, path, response_format="verbose_json")
    assert (verbose.usage.type, verbose.usage.seconds) == ("duration", seconds)
    [reference] = offline.generate({"prompt": "", "multi_modal_data": {"audio": (samples, RATE)}},
                                   SamplingParams(temperature=0, max_tokens=224),
                                   use_tqdm=False)
    assert plain.text == reference.outputs[0].text

    *deltas, done = transcribe(client, path, stream=True)
    assert {e.type for e in deltas} == {"transcript.text.delta"} and len(deltas) >= 1
    assert done.type == "transcript.text.done" and done.usage is None
    assert "".join(e.delta for e in deltas) == done.text == plain.text
    assert "".join(e.choices[0]["delta"]["content"] for e in [*deltas, done]) == plain.text
    assert [e.choices[0]["finish_reason"] for e in [*deltas, done]] == \
        [None] * (len(deltas) - 1) + ["stop", "stop"]
    assert {e.object for e in [*deltas, done]} == {"transcription.chunk"}

    *deltas, done = transcribe(client, path, stream=True, extra_body={
        "stream_include_usage": True, "stream_continuous_usage_stats": True})
    assert all(e.choices for e in deltas) and done.choices == []
    assert "".join(e.delta for e in deltas) == done.text == plain.text
    running = [e.usage["completion_tokens"] for e in deltas]
    assert running == sorted(running) and running[-1] == done.usage.completion_tokens
    # Every engine request of the long-form pipeline: here the timestamped decode alone (its
    # prompt <|startoftranscript|><|0.00|>): its avg_logprob passes, so a stream (json) needs
    # no no-speech probe.
    _, prompt_tokens, completion_tokens = offline_long_form(offline, [samples])
    assert prompt_tokens == 2
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == \
        (prompt_tokens, completion_tokens)
    assert (done.usage.type, done.usage.input_tokens, done.usage.output_tokens,
            done.usage.total_tokens) == ("tokens", prompt_tokens, completion_tokens,
                                         prompt_tokens + completion_tokens)


def test_vllm_api_cases(client: openai.OpenAI, server: RemoteServer, offline: LLM) -> None:
    """vLLM's Whisper server tests on this server: text endpoints are 404s (whatever the
    body), a token cap of 1 gives one token and a huge one is capped at the model's limit,
    extreme sampling values change the text (on audio whose words repeat, as vLLM's clip's
    do: with the filters this narrow only the repetition penalty can act)."""
    for call in (lambda: client.chat.completions.create(
                     model=NAME, messages=[{"role": "system", "content": "Hi."}]),
                 lambda: client.completions.create(model=NAME, prompt="Hello")):
        with pytest.raises(openai.NotFoundError, match="speech-to-text model"):
            call()
    assert httpx.post(f"{server.url}/v1/completions", content=b"not json",
                      headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 404
    messages = httpx.post(f"{server.url}/v1/messages", json={}, headers={"x-api-key": API_KEY})
    assert messages.status_code == 404 and messages.json()["error"]["type"] == "not_found_error"
    clip = DATA / "train_station.wav"
    greedy = transcribe(client, clip, temperature=0.0).text
    one = transcribe(client, clip, extra_body={"max_completion_tokens": 1}).text
    tokenizer = offline.get_tokenizer()
    assert len(tokenizer(one, add_special_tokens=False).input_ids) == 1
    assert transcribe(client, clip, extra_body={"max_completion_tokens": 10**6}).text == greedy
    silence = np.zeros(RATE // 2, np.float32)
    repeated = wav_bytes(np.concatenate([read_clip("sun_sky.wav"), silence] * 3))
    sampled = transcribe(client, repeated, temperature=0.8, extra_body={
        "seed": 42, "repetition_penalty": 1.9, "top_k": 12, "top_p": 0.4, "min_p": 0.5,
        "frequency_penalty": 1.8, "presence_penalty": 2.0, "max_completion_tokens": 40})
    greedy = transcribe(client, repeated, temperature=0.0, extra_body={"seed": 42}).text
    assert sampled.text != greedy


# ---- a multilingual model: language detection and translations -------------------------


@pytest.fixture(scope="module")
def multilingual(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random multilingual Whisper (seed 0 detects Somali in every clip), served."""
    path = make_tiny_whisper(str(tmp_path_factory.mktemp("multilingual")), multilingual=True)
    srv = RemoteServer(path, ["--served-model-name", "tiny-multi", "--dtype", "float32",
                              "--kv-cache-memory-bytes", "64MiB", "--enforce-eager"])
    yield path, srv
    assert srv.stop() == 0, srv.final_log


def test_language_detection_and_translation(multilingual: tuple[str, RemoteServer]) -> None:
    """With `language` omitted the model's language tokens at the first decoder step pick
    it (transformers' `detect_language` on the same model agrees); the windows are then
    decoded as with that language given. Translations put `<|translate|>` after it."""
    import transformers

    path, srv = multilingual
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    model = transformers.WhisperForConditionalGeneration.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    languages = language_token_ids(tokenizer, model.config.vocab_size)
    assert len(languages) == 99 and languages[50259] == "en"
    generation = transformers.GenerationConfig(
        decoder_start_token_id=50258, lang_to_id={f"<|{c}|>": i for i, c in languages.items()})
    features = transformers.WhisperFeatureExtractor(feature_size=80)(
        read_clip("sun_sky.wav"), sampling_rate=RATE, return_tensors="pt").input_features
    code = languages[int(model.detect_language(features, generation_config=generation)[0])]
    assert code != "en"  # so English, the default, cannot pass for a detection

    audio = (DATA / "sun_sky.wav").read_bytes()

    def ask(endpoint: str, **fields) -> httpx.Response:
        response = httpx.post(f"{srv.url}/v1/audio/{endpoint}", timeout=120, data={
            "model": "tiny-multi", "max_completion_tokens": "12", **fields},
            files={"file": ("a.wav", audio)})
        assert response.status_code == 200, response.text
        return response

    verbose = client.audio.transcriptions.create(
        model="tiny-multi", file=("a.wav", audio), response_format="verbose_json",
        extra_body={"max_completion_tokens": 12})
    assert verbose.language == language_name(code)
    detected = ask("transcriptions").json()["text"]
    assert detected == ask("transcriptions", language=code).json()["text"]
    assert detected != ask("transcriptions", language="en").json()["text"]
    translated = ask("translations").json()["text"]
    assert translated == ask("translations", language=code).json()["text"]
    assert translated != detected
    # Streams go through the same long-form pipeline: the streamed translation is the
    # non-streamed one, and its language the detected one.
    def stream(**fields) -> list[dict]:
        return [json.loads(line[6:]) for line in ask("translations", stream="true", **fields)
                .text.splitlines() if line.startswith("data: {")]

    events = stream()
    assert events[-1]["text"] == "".join(e["delta"] for e in events[:-1])
    assert events[-1]["object"] == "translation.chunk"
    assert events[-1]["text"] == translated == stream(language=code)[-1]["text"]
