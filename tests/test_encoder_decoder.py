"""Encoder/decoder models end to end (BART over text, Whisper over audio): greedy tokens
identical to transformers in float32 and logprobs close, under chunked decoder prefill,
preemption, decoder prefix hits and shared encoder inputs; the prompt rules; the real
tiny.en transcribing the committed clips; and bad inputs rejected with the engine still
serving."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
import transformers

from tests.hf_reference import Reference
from tests.test_ct2_loader import read_wav
from tests.wer import word_error_rate
from vllm import LLM, SamplingParams

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

DATA_DIR = Path(__file__).parent / "data"
SPEECH_CLIPS: dict[str, str] = json.loads((DATA_DIR / "speech_clips.json").read_text())

MAX_TOKENS = 12
SAMPLE_RATE = 16_000
# Whisper .en: <|startoftranscript|>, <|notimestamps|>, <|endoftext|>.
SOT, NO_TIMESTAMPS, WHISPER_EOS = 50257, 50362, 50256
# The tiny BART (tests/model_factory.py): <DEC> = </s> = 2, <BOS> = <s> = 1.
BART_DEC, BART_BOS = 2, 1

TEXTS = [
    "Hello world, this is",
    "The quick brown fox jumps over the lazy dog. Once upon a time there was a little robot "
    "who lived in a quiet village by the sea, and every morning it walked to the market.",
    "A",
    "What is the capital of France?",
]
LONG_DECODER_TEXT = ("Once upon a time there was a little robot who lived in a quiet village "
                     "by the sea")


class Case(NamedTuple):
    """One prompt for `LLM.generate` and the encoder input transformers gets for it."""

    prompt: Any
    encoder: dict[str, torch.Tensor]  # input_ids / inputs_embeds / input_features, batch 1


# ---- references -------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _hf_model(path: str) -> Any:
    config = transformers.AutoConfig.from_pretrained(path)
    model_class = (transformers.WhisperForConditionalGeneration
                   if config.model_type == "whisper"
                   else transformers.BartForConditionalGeneration)
    return model_class.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_encdec_greedy(model: Any, encoder: dict[str, torch.Tensor], decoder_ids: list[int],
                     max_tokens: int, eos_token_id: int | None = None,
                     encoder_outputs: Any = None) -> Reference:
    """Greedy decoding with the KV cache after `decoder_ids`, the encoder run once (or
    `encoder_outputs` reused); stops before `eos_token_id` (when given) or after
    `max_tokens` tokens."""
    if encoder_outputs is None:
        encoder_outputs = model.get_encoder()(**encoder)
    input_ids, past = torch.tensor([decoder_ids]), None
    tokens, logprobs = [], []
    for _ in range(max_tokens):
        out = model(encoder_outputs=encoder_outputs, decoder_input_ids=input_ids,
                    past_key_values=past, use_cache=True)
        step_logprobs = torch.log_softmax(out.logits[0, -1].float(), -1)
        token = int(step_logprobs.argmax())
        if token == eos_token_id:
            break
        tokens.append(token)
        logprobs.append(step_logprobs)
        past, input_ids = out.past_key_values, torch.tensor([[token]])
    return Reference(tokens, torch.stack(logprobs) if logprobs else torch.empty(0))


def _check_against_transformers(path: str, outputs: list, cases: list[Case],
                                max_tokens: int | list[int] = MAX_TOKENS) -> list[Reference]:
    """Tokens identical; every returned logprob within 1e-4 of transformers' (when asked).
    `max_tokens`: one count for all cases, or one per case."""
    model = _hf_model(path)
    counts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(cases)
    encoder_outputs: dict[int, Any] = {}  # cases sharing one encoder dict share its run
    refs = []
    for out, case, count in zip(outputs, cases, counts, strict=True):
        if id(case.encoder) not in encoder_outputs:
            with torch.inference_mode():
                encoder_outputs[id(case.encoder)] = model.get_encoder()(**case.encoder)
        ref = hf_encdec_greedy(model, case.encoder, out.prompt_token_ids, count,
                               encoder_outputs=encoder_outputs[id(case.encoder)])
        completion = out.outputs[0]
        assert completion.token_ids == ref.token_ids, out.prompt_token_ids
        if completion.logprobs is not None:
            assert len(completion.logprobs) == count
            for step, top in enumerate(completion.logprobs):
                ids = list(top)
                ours = torch.tensor([top[t].logprob for t in ids])
                torch.testing.assert_close(ours, ref.logprobs[step, ids], atol=1e-4, rtol=0)
        refs.append(ref)
    return refs


# ---- prompts ----------------------------------------------------------------------------


def _greedy(max_tokens: int = MAX_TOKENS, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=logprobs)


@functools.lru_cache(maxsize=2)
def _tokenizer(path: str) -> Any:
    return transformers.AutoTokenizer.from_pretrained(path)


def _text_encoder(path: str, text: str) -> dict[str, torch.Tensor]:
    """BART's encoder input for a text prompt: tokenized with special tokens (<s> first)."""
    return {"input_ids": torch.tensor([_tokenizer(path).encode(text)])}


def _noise(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(int(seconds * SAMPLE_RATE))).astype(np.float32)


@functools.lru_cache(maxsize=1)
def _feature_extractor() -> Any:
    return transformers.WhisperFeatureExtractor(feature_size=80)


def _features(waveform: np.ndarray) -> dict[str, torch.Tensor]:
    features = _feature_extractor()(waveform, sampling_rate=SAMPLE_RATE, return_tensors="pt")
    return {"input_features": features.input_features}


def _audio(waveform: np.ndarray, text: str = "") -> dict:
    return {"prompt": text, "multi_modal_data": {"audio": (waveform, SAMPLE_RATE)}}


def _encoder_case(kind: str, path: str, index: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """Encoder input number `index` of `kind` (a prompt, and transformers' input for it):
    distinct indices give distinct inputs, none equal to those of the batch tests, so that
    the module's engines hold no cross blocks of it yet."""
    if kind == "bart":
        text = f"Input {index}: {TEXTS[index % len(TEXTS)]}"
        return text, _text_encoder(path, text)
    waveform = _noise(1.0 + 0.5 * index, seed=100 + index)
    return _audio(waveform), _features(waveform)


def _decoder_ids(kind: str, path: str, text: str) -> list[int]:
    """A decoder prompt of token ids: the default prompt, then `text`."""
    start = [BART_DEC, BART_BOS] if kind == "bart" else [SOT, NO_TIMESTAMPS]
    return start + _tokenizer(path).encode(text, add_special_tokens=False)


def _explicit(encoder_prompt: Any, decoder_ids: list[int]) -> dict:
    return {"encoder_prompt": encoder_prompt, "decoder_prompt": {"prompt_token_ids": decoder_ids}}


# ---- engines ----------------------------------------------------------------------------


def _llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 16 * 1024**2)
    kwargs.setdefault("max_model_len", 256)
    return LLM(path, dtype="float32", **kwargs)


@pytest.fixture(scope="module")
def bart_llm(tiny_bart_dir) -> LLM:
    return _llm(tiny_bart_dir, block_size=4, enable_prompt_embeds=True)


@pytest.fixture(scope="module")
def bart_llm_no_caching(tiny_bart_dir) -> LLM:
    return _llm(tiny_bart_dir, block_size=4, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def whisper_llm(tiny_whisper_dir) -> LLM:
    return _llm(tiny_whisper_dir, block_size=16)


@pytest.fixture(scope="module")
def whisper_llm_no_caching(tiny_whisper_dir) -> LLM:
    return _llm(tiny_whisper_dir, block_size=16, enable_prefix_caching=False)


@pytest.fixture
def model(request) -> tuple[str, str, LLM]:
    """(kind, path, cached LLM) for the parametrized kind."""
    kind = request.param
    return kind, request.getfixturevalue(f"tiny_{kind}_dir"), \
        request.getfixturevalue(f"{kind}_llm")


def _num_encoded(llm: LLM) -> int:
    return llm.llm_engine.engine_core.model_executor.model_runner.encoder_runner \
        .num_inputs_encoded


def _scheduler(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.scheduler


# ---- parity -----------------------------------------------------------------------------


def _bart_batch(path: str) -> list[Case]:
    """Singleton texts of 2 to 40 tokens, and explicit prompts whose decoder prompts are
    text, ids without <DEC> and ids with <DEC>, 3 to 20 tokens long."""
    cases = [Case(text, _text_encoder(path, text)) for text in TEXTS]
    cases.append(Case({"encoder_prompt": TEXTS[3], "decoder_prompt": "Once upon a time"},
                      _text_encoder(path, TEXTS[3])))
    ids = _tokenizer(path).encode(TEXTS[0])
    cases.append(Case({"encoder_prompt": {"prompt_token_ids": ids},
                       "decoder_prompt": {"prompt_token_ids": [BART_BOS, 300, 400]}},
                      {"input_ids": torch.tensor([ids])}))
    cases.append(Case(_explicit(TEXTS[1], _decoder_ids("bart", path, LONG_DECODER_TEXT)),
                      _text_encoder(path, TEXTS[1])))
    return cases


def _whisper_batch(path: str) -> list[Case]:
    """Noise of 0.3 to 12 s (stereo once), default, text and id decoder prompts."""
    short, medium, long = _noise(0.3, 0), _noise(3.5, 1), _noise(12.0, 2)
    stereo = np.stack([_noise(2.0, 3), _noise(2.0, 4)])
    return [
        Case(_audio(short), _features(short)),
        Case(_audio(long), _features(long)),
        Case(_audio(stereo), _features(stereo.mean(axis=0))),
        Case(_audio(medium, "<|startoftranscript|><|notimestamps|> The quick"),
             _features(medium)),
        Case(_explicit(_audio(medium), [NO_TIMESTAMPS, 400, 1000]), _features(medium)),
        Case(_explicit(_audio(short), _decoder_ids("whisper", path, LONG_DECODER_TEXT)),
             _features(short)),
    ]


_BATCHES = {"bart": _bart_batch, "whisper": _whisper_batch}


@pytest.mark.parametrize("model", ["bart", "whisper"], indirect=True)
def test_batch_matches_transformers(model):
    kind, path, llm = model
    cases = _BATCHES[kind](path)
    # Requests finish at different steps: the batch's rows (cross block table included)
    # are compacted while the others decode on.
    counts = [MAX_TOKENS - 3 * (i % 3) for i in range(len(cases))]
    params = [_greedy(max_tokens=count, logprobs=3) for count in counts]
    outputs = llm.generate([c.prompt for c in cases], params, use_tqdm=False)
    _check_against_transformers(path, outputs, cases, counts)
    decoder_lens = {len(o.prompt_token_ids) for o in outputs}
    assert len(decoder_lens) >= 3 and max(decoder_lens) > 10
    # Greedy tokens vary across the batch (otherwise parity would prove little).
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == len(outputs)


@pytest.mark.parametrize("kind", ["bart", "whisper"])
def test_chunked_decoder_prefill_matches(kind, request):
    path = request.getfixturevalue(f"tiny_{kind}_dir")
    llm = _llm(path, max_num_batched_tokens=8, max_num_seqs=3)
    cases = _BATCHES[kind](path)
    if kind == "whisper":
        cases = [cases[0], cases[3], cases[5]]  # decoder prompts of 2, 5 and 22 tokens
    outputs = llm.generate([c.prompt for c in cases], _greedy(), use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in outputs) > 8  # really chunked
    _check_against_transformers(path, outputs, cases)


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_bart_preemption_keeps_outputs_identical(tiny_bart_dir, enable_prefix_caching):
    # Block size 16: each request holds 18 cross blocks (~283 encoder tokens) and grows to
    # 3 or 4 decoder blocks. 79 usable blocks admit four requests at 19 blocks each, which
    # then cannot all grow, so the newest running request gets preempted.
    llm = _llm(tiny_bart_dir, block_size=16, max_model_len=64, num_gpu_blocks_override=80,
               enable_prefix_caching=enable_prefix_caching)
    texts = [f"Input {i}: " + " ".join(TEXTS[i:] + TEXTS[:i]) * 4 for i in range(len(TEXTS))]
    cases = [Case(text, _text_encoder(tiny_bart_dir, text)) for text in texts]
    cases += [Case({"encoder_prompt": text, "decoder_prompt": " Once upon a time there was"},
                   _text_encoder(tiny_bart_dir, text)) for text in texts[:2]]
    outputs = llm.generate([c.prompt for c in cases], _greedy(max_tokens=40), use_tqdm=False)
    scheduler = _scheduler(llm)
    assert scheduler.num_preemptions > 0
    _check_against_transformers(tiny_bart_dir, outputs, cases, max_tokens=40)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 79
    if not enable_prefix_caching:
        # A preempted request's cross blocks are freed, so its resume runs the encoder again.
        assert _num_encoded(llm) == len(cases) + scheduler.num_preemptions


def test_whisper_preemption_keeps_outputs_identical(tiny_whisper_dir):
    # A request holds 94 cross blocks (1500 rows / 16) and 1, then 2 decoder blocks: two
    # start together in 190 usable blocks, but cannot both grow.
    llm = _llm(tiny_whisper_dir, block_size=16, num_gpu_blocks_override=191,
               enable_prefix_caching=False)
    cases = _whisper_batch(tiny_whisper_dir)[:3]
    outputs = llm.generate([c.prompt for c in cases], _greedy(max_tokens=20), use_tqdm=False)
    scheduler = _scheduler(llm)
    assert scheduler.num_preemptions > 0
    _check_against_transformers(tiny_whisper_dir, outputs, cases, max_tokens=20)
    assert _num_encoded(llm) == len(cases) + scheduler.num_preemptions
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 190


@pytest.mark.parametrize("model", ["bart", "whisper"], indirect=True)
def test_decoder_prefix_hits(model):
    kind, path, llm = model
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    encoder_prompt, encoder = _encoder_case(kind, path, 0)
    decoder_ids = _decoder_ids(kind, path, LONG_DECODER_TEXT + " and then")
    cases = [Case(_explicit(encoder_prompt, decoder_ids), encoder)]
    first = llm.generate([c.prompt for c in cases], _greedy(), use_tqdm=False)
    encoded = _num_encoded(llm)
    again = llm.generate([c.prompt for c in cases], _greedy(), use_tqdm=False)
    _check_against_transformers(path, first, cases)
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    n = len(decoder_ids)
    assert n > block_size
    assert first[0].num_cached_tokens == 0
    assert again[0].num_cached_tokens == (n - 1) // block_size * block_size
    assert _num_encoded(llm) == encoded  # the cross blocks were cached too: no encoder run


@pytest.mark.parametrize("model", ["bart", "whisper"], indirect=True)
def test_shared_encoder_input_runs_the_encoder_once(model):
    kind, path, llm = model
    encoder_prompt, encoder = _encoder_case(kind, path, 1)
    cases = [Case(_explicit(encoder_prompt, _decoder_ids(kind, path, text)), encoder)
             for text in ("", " Hello", " The quick brown fox jumps over")]
    before = _num_encoded(llm)
    outputs = llm.generate([c.prompt for c in cases], _greedy(logprobs=2), use_tqdm=False)
    assert _num_encoded(llm) - before == 1
    _check_against_transformers(path, outputs, cases)
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == len(cases)


@pytest.mark.parametrize("kind", ["bart", "whisper"])
def test_shared_encoder_input_without_prefix_caching(kind, request):
    path = request.getfixturevalue(f"tiny_{kind}_dir")
    llm = request.getfixturevalue(f"{kind}_llm_no_caching")
    encoder_prompt, encoder = _encoder_case(kind, path, 1)
    cases = [Case(_explicit(encoder_prompt, _decoder_ids(kind, path, text)), encoder)
             for text in ("", " Hello", " The quick brown fox jumps over")]
    before = _num_encoded(llm)
    outputs = llm.generate([c.prompt for c in cases], _greedy(), use_tqdm=False)
    assert _num_encoded(llm) - before == len(cases)
    _check_against_transformers(path, outputs, cases)


def test_bart_equal_length_encoder_inputs_in_one_step(bart_llm, tiny_bart_dir):
    """Encoder inputs of one length run as one batched attention call; each request must
    still read its own rows."""
    ids = [[BART_BOS, 300 + i, 500 - i, 600 + 2 * i, 50 + i] for i in range(3)]
    cases = [Case({"prompt_token_ids": x}, {"input_ids": torch.tensor([x])}) for x in ids]
    before = _num_encoded(bart_llm)
    outputs = bart_llm.generate([c.prompt for c in cases], _greedy(logprobs=2),
                                use_tqdm=False)
    assert _num_encoded(bart_llm) - before == len(cases)
    _check_against_transformers(tiny_bart_dir, outputs, cases)
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == len(cases)


def test_parallel_samples_share_the_encoder_input(bart_llm, tiny_bart_dir):
    encoder_prompt, encoder = _encoder_case("bart", tiny_bart_dir, 4)
    before = _num_encoded(bart_llm)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=3)
    out = bart_llm.generate(encoder_prompt, params, use_tqdm=False)[0]
    assert _num_encoded(bart_llm) - before == 1
    ref = hf_encdec_greedy(_hf_model(tiny_bart_dir), encoder, [BART_DEC, BART_BOS],
                           MAX_TOKENS)
    assert [c.token_ids for c in out.outputs] == [ref.token_ids] * 3
    assert out.encoder_prompt == encoder_prompt


@pytest.mark.parametrize("model", ["bart", "whisper"], indirect=True)
def test_same_decoder_prompt_over_other_encoder_input_shares_nothing(model):
    kind, path, llm = model
    decoder_ids = _decoder_ids(kind, path, LONG_DECODER_TEXT + " but later")
    cases = [Case(_explicit(prompt, decoder_ids), encoder)
             for prompt, encoder in (_encoder_case(kind, path, 2),
                                     _encoder_case(kind, path, 3))]
    first = llm.generate(cases[0].prompt, _greedy(), use_tqdm=False)
    before = _num_encoded(llm)
    second = llm.generate(cases[1].prompt, _greedy(), use_tqdm=False)
    assert second[0].num_cached_tokens == 0
    assert _num_encoded(llm) - before == 1
    _check_against_transformers(path, first + second, cases)
    assert first[0].outputs[0].token_ids != second[0].outputs[0].token_ids


def test_bart_encoder_prompt_embeds_equal_token_prompt(bart_llm, tiny_bart_dir):
    embed_tokens = _hf_model(tiny_bart_dir).get_encoder().embed_tokens
    ids = [_tokenizer(tiny_bart_dir).encode(text) for text in TEXTS[:2]]
    # transformers' embed_tokens scales by sqrt(d_model): these are the encoder's inputs.
    embeds = [embed_tokens(torch.tensor(x)).detach() for x in ids]
    decoder = _decoder_ids("bart", tiny_bart_dir, " Hello")
    token_prompts = [{"prompt_token_ids": x} for x in ids]
    token_prompts.append(_explicit({"prompt_token_ids": ids[1]}, decoder))
    embeds_prompts = [{"prompt_embeds": e} for e in embeds]
    embeds_prompts.append(_explicit({"prompt_embeds": embeds[1]}, decoder))
    cases = [Case(prompt, {"inputs_embeds": e[None]})
             for prompt, e in zip(embeds_prompts, [*embeds, embeds[1]], strict=True)]

    by_ids = bart_llm.generate(token_prompts, _greedy(), use_tqdm=False)
    by_embeds = bart_llm.generate(embeds_prompts, _greedy(logprobs=2), use_tqdm=False)

    assert [o.outputs[0].token_ids for o in by_embeds] == [o.outputs[0].token_ids
                                                          for o in by_ids]
    _check_against_transformers(tiny_bart_dir, by_embeds, cases)
    for out in by_embeds:
        assert out.encoder_prompt is None and out.encoder_prompt_token_ids is None
    assert by_embeds[0].prompt_token_ids == [BART_DEC, BART_BOS]


# ---- prompt rules -----------------------------------------------------------------------


def test_bart_prompt_rules(bart_llm, tiny_bart_dir):
    tok = _tokenizer(tiny_bart_dir)
    text = TEXTS[3]
    singleton, from_ids, with_dec, from_text, token_singleton, no_decoder = bart_llm.generate([
        text,
        {"encoder_prompt": text, "decoder_prompt": {"prompt_token_ids": [BART_BOS, 300]}},
        {"encoder_prompt": {"prompt": text},
         "decoder_prompt": {"prompt_token_ids": [BART_DEC, BART_BOS, 300]}},
        {"encoder_prompt": text, "decoder_prompt": " Hello world"},
        {"prompt_token_ids": [BART_BOS, 300, 400]},
        {"encoder_prompt": text},
    ], _greedy(max_tokens=2), use_tqdm=False)
    assert singleton.prompt_token_ids == [BART_DEC, BART_BOS]
    assert singleton.prompt is None
    assert singleton.encoder_prompt == text
    assert singleton.encoder_prompt_token_ids == tok.encode(text)
    assert tok.encode(text)[0] == BART_BOS  # text encoder prompts get special tokens
    assert from_ids.prompt_token_ids == [BART_DEC, BART_BOS, 300]
    assert with_dec.prompt_token_ids == [BART_DEC, BART_BOS, 300]  # no second <DEC>
    assert from_ids.outputs[0].token_ids == with_dec.outputs[0].token_ids
    assert from_text.prompt == " Hello world"
    assert from_text.prompt_token_ids == [BART_DEC, *tok.encode(" Hello world",
                                                                add_special_tokens=False)]
    assert from_text.encoder_prompt == text
    assert token_singleton.encoder_prompt is None
    assert token_singleton.encoder_prompt_token_ids == [BART_BOS, 300, 400]
    assert token_singleton.prompt_token_ids == [BART_DEC, BART_BOS]
    assert singleton.num_prompt_tokens == 2
    assert no_decoder.prompt_token_ids == [BART_DEC, BART_BOS]
    assert no_decoder.outputs[0].token_ids == singleton.outputs[0].token_ids


def test_whisper_prompt_rules(whisper_llm, tiny_whisper_dir):
    import soxr

    tok = _tokenizer(tiny_whisper_dir)
    audio = _noise(1.0, 5)
    low_rate = _noise(2.0, 6)[::2].copy()  # 1 s at 8 kHz
    upsampled = soxr.resample(low_rate, 8000, SAMPLE_RATE).astype(np.float32)
    default, explicit_default, text, ids, singleton_ids, at_8k, at_16k = whisper_llm.generate([
        _audio(audio),
        {"encoder_prompt": _audio(audio)},
        _audio(audio, "<|startoftranscript|><|notimestamps|> Hi"),
        _explicit(_audio(audio), [NO_TIMESTAMPS, 1000]),
        {"prompt_token_ids": [SOT, NO_TIMESTAMPS, 1000],
         "multi_modal_data": {"audio": (audio, SAMPLE_RATE)}},
        {"prompt": "", "multi_modal_data": {"audio": (low_rate, 8000)}},
        _audio(upsampled),
    ], _greedy(max_tokens=4), use_tqdm=False)
    assert default.prompt_token_ids == [SOT, NO_TIMESTAMPS]
    assert explicit_default.prompt_token_ids == [SOT, NO_TIMESTAMPS]
    assert text.prompt_token_ids == [SOT, NO_TIMESTAMPS, *tok.encode(
        " Hi", add_special_tokens=False)]
    assert ids.prompt_token_ids == [SOT, NO_TIMESTAMPS, 1000]
    assert singleton_ids.prompt_token_ids == [SOT, NO_TIMESTAMPS, 1000]
    assert singleton_ids.outputs[0].token_ids == ids.outputs[0].token_ids
    for out in (default, explicit_default, text, ids, singleton_ids):
        assert out.encoder_prompt is None and out.encoder_prompt_token_ids is None
    assert default.outputs[0].token_ids == explicit_default.outputs[0].token_ids
    # Other sample rates are resampled to 16 kHz (with soxr) before the features.
    assert at_8k.outputs[0].token_ids == at_16k.outputs[0].token_ids


# ---- the real tiny.en -------------------------------------------------------------------


@pytest.fixture(scope="module")
def whisper_dir() -> str:
    from vllm.transformers_utils.default_model import default_whisper_model_path

    return default_whisper_model_path()


@pytest.fixture(scope="module")
def clips() -> dict[str, np.ndarray]:
    return {name: read_wav(DATA_DIR / name) for name in sorted(SPEECH_CLIPS)}


def _transcribe(llm: LLM, clips: dict[str, np.ndarray]) -> list:
    params = SamplingParams(temperature=0, max_tokens=40)
    return llm.generate([_audio(w) for w in clips.values()], params, use_tqdm=False)


def test_default_whisper_float32_equals_transformers(whisper_dir, clips):
    from vllm.model_executor.model_loader.ct2_loader import (
        load_ct2_config,
        load_ct2_state_dict,
    )

    llm = LLM(whisper_dir, dtype="float32", kv_cache_memory_bytes=64 * 1024**2)
    outputs = _transcribe(llm, clips)

    config = load_ct2_config(whisper_dir)
    model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**config))
    model.load_state_dict(load_ct2_state_dict(whisper_dir, torch.float32))
    model.eval()
    tokenizer = llm.get_tokenizer()
    for (name, waveform), out in zip(clips.items(), outputs, strict=True):
        assert out.prompt_token_ids == [SOT, NO_TIMESTAMPS]
        ref = hf_encdec_greedy(model, _features(waveform), [SOT, NO_TIMESTAMPS], 40,
                               eos_token_id=WHISPER_EOS)
        completion = out.outputs[0]
        assert completion.finish_reason == "stop"
        assert completion.token_ids == [*ref.token_ids, WHISPER_EOS], name
        assert completion.text == tokenizer.decode(ref.token_ids, skip_special_tokens=True)
        assert word_error_rate(SPEECH_CLIPS[name], completion.text) <= 0.1, completion.text


def test_default_whisper_bfloat16_transcribes(whisper_dir, clips):
    llm = LLM(whisper_dir, dtype="bfloat16", kv_cache_memory_bytes=32 * 1024**2)
    for (name, _), out in zip(clips.items(), _transcribe(llm, clips), strict=True):
        assert out.outputs[0].finish_reason == "stop"
        assert word_error_rate(SPEECH_CLIPS[name], out.outputs[0].text) <= 0.1, \
            out.outputs[0].text


# ---- bad inputs -------------------------------------------------------------------------


def _assert_rejected_then_serving(llm: LLM, bad: Any, message: str, good: Any) -> None:
    """`bad` (alone and next to a good prompt) is a ValueError matching `message`; the
    engine then still answers `good` exactly as before, with nothing left over."""
    expected = llm.generate(good, _greedy(max_tokens=4), use_tqdm=False)
    for prompts in ([bad], [good, bad]):
        with pytest.raises(ValueError, match=message):
            llm.generate(prompts, _greedy(max_tokens=4), use_tqdm=False)
        again = llm.generate(good, _greedy(max_tokens=4), use_tqdm=False)
        assert len(again) == 1
        assert again[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert not _scheduler(llm).requests


def _whisper_good() -> dict:
    return _audio(_noise(1.0, 7))


@pytest.mark.parametrize("bad, message", [
    ({"encoder_prompt": {"prompt_token_ids": [5] * 1025}},
     r"encoder prompt \(length 1025\) is longer than the maximum encoder length of 1024"),
    ({"prompt_token_ids": [5] * 1025}, "encoder length of 1024"),
    ({"encoder_prompt": {"prompt_token_ids": []}}, "encoder prompt is empty"),
    ({"prompt_token_ids": []}, "encoder prompt is empty"),
    (_audio(np.zeros(SAMPLE_RATE, dtype=np.float32)), "does not take audio"),
    ({"encoder_prompt": "fine", "decoder_prompt": {"prompt_embeds": torch.zeros(3, 64)}},
     "decoder prompt .* cannot be prompt_embeds"),
    ({"decoder_prompt": "only a decoder"}, "needs 'encoder_prompt'"),
    ({"encoder_prompt": {"prompt_token_ids": [1, 5000]}}, "5000 in the encoder prompt is out"),
    ({"encoder_prompt": "fine", "decoder_prompt": {"prompt_token_ids": [5000]}},
     "5000 in the prompt is out of the vocabulary"),
    ({"encoder_prompt": "fine", "decoder_prompt": {"prompt_token_ids": [5] * 300}},
     r"prompt \(length 301\) is longer than the maximum model length of 256"),
    ({"encoder_prompt": "fine", "decoder_prompt": "fine", "prompt": "extra"},
     "takes only encoder_prompt and decoder_prompt"),
])
def test_bad_bart_inputs(bart_llm, bad, message):
    _assert_rejected_then_serving(bart_llm, bad, message, TEXTS[0])


def test_bart_prompt_embeds_need_enable_prompt_embeds(bart_llm_no_caching):
    bad = {"prompt_embeds": torch.zeros(3, 64)}
    _assert_rejected_then_serving(bart_llm_no_caching, bad, "enable_prompt_embeds", TEXTS[0])
    explicit = {"encoder_prompt": bad, "decoder_prompt": " Hello"}
    _assert_rejected_then_serving(bart_llm_no_caching, explicit, "enable_prompt_embeds",
                                  TEXTS[0])


@pytest.mark.parametrize("bad, message", [
    (_audio(np.zeros((2, 2, SAMPLE_RATE), dtype=np.float32)), r"shape \(2, 2, 16000\)"),
    (_audio(np.zeros((16, SAMPLE_RATE), dtype=np.float32)), r"shape \(16, 16000\)"),
    (_audio(np.zeros(31 * SAMPLE_RATE, dtype=np.float32)), r"31\.0 s long.*at most 30 s"),
    (_audio(np.zeros(0, dtype=np.float32)), "empty"),
    ("a text prompt", "encoder input is audio"),
    ({"encoder_prompt": "text", "decoder_prompt": {"prompt_token_ids": [SOT]}},
     "encoder input is audio"),
    ({"encoder_prompt": {"prompt_token_ids": [1, 2, 3]}}, "encoder input is audio"),
    ({"encoder_prompt": _whisper_good(), "decoder_prompt": {"prompt_embeds": torch.zeros(2, 64)}},
     "decoder prompt .* cannot be prompt_embeds"),
    ({"encoder_prompt": _audio(np.zeros(SAMPLE_RATE, dtype=np.float32), "words")},
     "audio alone"),
    (_audio(np.full(SAMPLE_RATE, np.nan, dtype=np.float32)), "non-finite"),
    ({"prompt": "", "multi_modal_data": {"audio": (np.zeros(100, np.float32), 0)}},
     "sample rate must be a positive number"),
    ({"prompt": "", "multi_modal_data": {"audio": ([0.0] * 100, SAMPLE_RATE)}},
     "numpy array or torch tensor"),
    ({"prompt": "", "multi_modal_data": {"image": np.zeros(3)}}, "multi_modal_data must be"),
])
def test_bad_whisper_inputs(whisper_llm, bad, message):
    _assert_rejected_then_serving(whisper_llm, bad, message, _whisper_good())


@pytest.fixture(scope="module")
def llama_llm(tiny_llama_dir) -> LLM:
    return _llm(tiny_llama_dir, enforce_eager=True)  # refusals: no graphs to compile


@pytest.mark.parametrize("bad, key", [
    ({"encoder_prompt": "Hello", "decoder_prompt": "world"}, "encoder_prompt"),
    ({"prompt": "Hello", "decoder_prompt": "world"}, "decoder_prompt"),
    (_audio(np.zeros(SAMPLE_RATE, dtype=np.float32)), "multi_modal_data"),
])
def test_decoder_only_model_rejects_encoder_inputs(llama_llm, bad, key):
    _assert_rejected_then_serving(llama_llm, bad, f"'{key}' given, but LlamaForCausalLM is a "
                                  "decoder-only model", "Hello world")
