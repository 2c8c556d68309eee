"""The offline `LLM` API end to end: params validation, sampling behaviour, n>1, stops,
penalties, errors, and the command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllm import LLM, SamplingParams

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, dtype="float32", max_model_len=256,
               kv_cache_memory_bytes=16 * 1024**2, seed=0,
               enforce_eager=True)  # graphs: tests/test_graph_capture.py


PROMPT = "Once upon a time there was a little robot"


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("min_p", 2.0),
    ("max_tokens", 0), ("presence_penalty", 3.0), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("logprobs", -1), ("min_tokens", -1), ("stop", [""]),
    ("stop_token_ids", [-5]), ("seed", 1.5),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_greater_than_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)


def test_request_output_fields(llm):
    out = llm.generate({"prompt": PROMPT}, SamplingParams(temperature=0, max_tokens=5),
                       use_tqdm=False)[0]
    assert out.prompt == PROMPT
    assert out.prompt_token_ids == llm.get_tokenizer().encode(PROMPT)
    assert out.finished and out.num_cached_tokens == 0
    completion = out.outputs[0]
    assert completion.finish_reason == "length" and completion.stop_reason is None
    assert len(completion.token_ids) == 5 and completion.logprobs is None
    assert completion.text == llm.get_tokenizer().decode(completion.token_ids)


def test_reset_prefix_cache_drops_the_cached_blocks(llm):
    """vLLM's `LLM.reset_prefix_cache()`: a repeated prompt hits the cache, and after the
    reset it is computed again."""
    prompt = {"prompt_token_ids": list(range(10, 60))}  # three whole blocks of 16
    params = SamplingParams(temperature=0, max_tokens=2)

    def cached() -> int:
        return llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens

    cached()
    assert cached() == 48
    assert llm.reset_prefix_cache() is True
    assert cached() == 0


def test_seeded_sampling_reproduces_and_differs_by_seed(llm):
    def sample(seed):
        params = SamplingParams(temperature=1.0, top_k=50, seed=seed, max_tokens=16)
        return llm.generate([PROMPT, "Hello"], params, use_tqdm=False)[0].outputs[0].token_ids

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_seeded_request_independent_of_batch(llm):
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=12)
    alone = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12)
    batch = llm.generate(["a b c", PROMPT, "x y"], [others, params, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


def test_n_samples(llm):
    out = llm.generate(PROMPT, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=10),
                       use_tqdm=False)
    assert len(out) == 1
    completions = out[0].outputs
    assert [c.index for c in completions] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in completions}) > 1
    greedy = llm.generate(PROMPT, SamplingParams(n=3, temperature=0, max_tokens=10),
                          use_tqdm=False)[0].outputs
    assert greedy[0].token_ids == greedy[1].token_ids == greedy[2].token_ids


def test_stop_strings_and_stop_token_ids(llm):
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20),
                        use_tqdm=False)[0].outputs[0]
    stop = base.text[5:8]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, stop=stop),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[:base.text.index(stop)]
    kept = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, stop=stop,
                                               include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == base.text[:base.text.index(stop) + len(stop)]
    token = base.token_ids[6]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20,
                                              stop_token_ids=[token]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[:base.token_ids.index(token) + 1]
    assert out.stop_reason == token and out.finish_reason == "stop"


def test_min_tokens_blocks_stop_tokens(llm):
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30),
                        use_tqdm=False)[0].outputs[0]
    first = base.token_ids[0]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, min_tokens=4,
                                              stop_token_ids=[first]), use_tqdm=False)[0]
    # The first token is blocked until min_tokens; the fourth onwards may stop.
    assert first not in out.outputs[0].token_ids[:4]
    assert len(out.outputs[0].token_ids) >= 4


def test_logprobs_shape_and_consistency(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=4),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 6
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy: rank 1
        assert len(entry) == 4  # the sampled token is among the top 4
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks == [1, 2, 3, 4]
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total)


def test_penalties_change_the_distribution(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24)
    base = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(base)) < len(base)  # the base output repeats tokens
    for kwargs in ({"repetition_penalty": 10.0}, {"frequency_penalty": 2.0},
                   {"presence_penalty": 2.0}):
        penalized = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, **kwargs),
                                 use_tqdm=False)[0].outputs[0].token_ids
        assert penalized != base
        assert len(set(penalized)) > len(set(base)), kwargs


def test_allowed_token_ids_restrict_every_sampled_token(llm):
    free = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1),
                        use_tqdm=False)[0].outputs[0].token_ids
    allowed = [t for t in range(100, 108) if t != free[0]]
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=1, max_tokens=6,
                                allowed_token_ids=allowed)
        tokens = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
        assert len(tokens) == 6 and set(tokens) <= set(allowed), temperature
    with pytest.raises(ValueError, match=r"allowed_token_ids \[10000000\] are out of"):
        llm.generate(PROMPT, SamplingParams(allowed_token_ids=[1, 10**7]), use_tqdm=False)


def test_too_long_prompt_names_both_lengths(llm):
    with pytest.raises(ValueError, match=r"length 300.*maximum model length of 256"):
        llm.generate({"prompt_token_ids": [5] * 300}, use_tqdm=False)
    with pytest.raises(ValueError, match="out of the vocabulary"):
        llm.generate({"prompt_token_ids": [10**7]}, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    assert llm.generate("still fine", SamplingParams(max_tokens=2), use_tqdm=False)


def test_max_tokens_capped_by_max_model_len(llm):
    out = llm.generate({"prompt_token_ids": [5] * 250},
                       SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_unsupported_architecture_lists_supported(tmp_path, tiny_llama_dir):
    import json
    import shutil

    path = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen2ForCausalLM"):
        LLM(str(path), dtype="float32", kv_cache_memory_bytes=8 * 1024**2, max_model_len=128)


def test_unknown_engine_argument():
    with pytest.raises(TypeError, match="not_a_knob"):
        LLM("x", not_a_knob=1)


def test_cli_generate(tiny_llama_dir):
    result = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli", "generate", "Hello", "--model",
         tiny_llama_dir, "--max-tokens", "5", "--dtype", "float32", "--max-model-len", "128",
         "--enforce-eager"],  # the command's plumbing is under test; graphs are elsewhere
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=128,
              kv_cache_memory_bytes=8 * 1024**2, enforce_eager=True)
    expected = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5),
                            use_tqdm=False)[0].outputs[0].text
    assert result.stdout == expected + "\n"


@pytest.mark.parametrize("kwargs, message", [
    ({"top_k": 10**6}, "top_k"),
    ({"stop_token_ids": [10**6], "min_tokens": 1}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs"),
    ({"min_tokens": 10**6, "max_tokens": 10**7}, "min_tokens"),
    ({"n": 129}, "n must be"),
    ({"seed": 2**63}, "seed"),
])
def test_params_checked_against_the_model(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPT, SamplingParams(**kwargs), use_tqdm=False)
    assert llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)


def test_top_k_below_minus_one_is_rejected():
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)
    assert SamplingParams(top_k=-1).top_k == 0


def test_stop_strings_wait_for_min_tokens_and_win_on_the_last_token(llm):
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12),
                        use_tqdm=False)[0].outputs[0]
    # A stop string inside the first tokens' text is ignored until min_tokens.
    early = base.text[:2]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop=[early],
                                              min_tokens=6), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) > 6
    # A stop string completed by the last allowed token still reports "stop".
    last_text = llm.get_tokenizer().decode(base.token_ids[-1:])
    assert last_text.strip()
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop=[last_text]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == last_text


def test_ignore_eos_ignores_generation_config_eos_ids(tmp_path, tiny_llama_dir):
    import json
    import shutil

    path = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, path)
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=8 * 1024**2, max_model_len=128,
              enforce_eager=True)
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)[0].outputs[0]
    extra_eos = base.token_ids[3]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, extra_eos]}))
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=8 * 1024**2, max_model_len=128,
              enforce_eager=True)
    stopped = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == base.token_ids[:base.token_ids.index(extra_eos) + 1]
    assert stopped.finish_reason == "stop"
    ignored = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == base.token_ids and ignored.finish_reason == "length"
