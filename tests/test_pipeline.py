"""Offline stage pipelines on tiny float32 models: the same final tokens as running the
stages by hand, requests moving on without a batch barrier (by the event log), connectors,
YAML descriptions."""

from __future__ import annotations

import pytest
import torch

from vllm import LLM, Pipeline, SamplingParams, Stage
from vllm.pipeline import EventKind, HiddenStatesToEmbeds, PipelineEvent, TextToPrompt
from vllm.pipeline.stage import load_pipeline_spec

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

PROMPTS = ["Hello world, this is", "The quick brown fox jumps over the lazy dog.", "A"]
# Eager: the subject is the stages' orchestration (graphs: tests/test_graph_capture.py).
ENGINE = {"dtype": "float32", "kv_cache_memory_bytes": 16 * 1024**2, "max_model_len": 256,
          "enforce_eager": True}


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def stage_a_by_hand(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, enable_return_hidden_states=True, **ENGINE)


@pytest.fixture(scope="module")
def stage_b_by_hand(tiny_qwen2_dir) -> LLM:
    return LLM(tiny_qwen2_dir, enable_prompt_embeds=True, **ENGINE)


@pytest.fixture(scope="module")
def pipeline(tiny_llama_dir, tiny_qwen2_dir) -> Pipeline:
    return Pipeline([Stage(tiny_llama_dir, **ENGINE), Stage(tiny_qwen2_dir, **ENGINE)])


def test_hidden_states_pipeline_equals_stages_by_hand(pipeline, stage_a_by_hand,
                                                      stage_b_by_hand):
    params_a = [_greedy(m) for m in (3, 8, 5)]
    outputs = pipeline.generate(PROMPTS, [params_a, _greedy(6)])
    a = stage_a_by_hand.generate(
        PROMPTS, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True,
                                 return_hidden_states=True) for m in (3, 8, 5)],
        use_tqdm=False)
    b = stage_b_by_hand.generate([{"prompt_embeds": o.hidden_states} for o in a], _greedy(6),
                                 use_tqdm=False)
    assert _tokens(outputs) == _tokens(b)
    for out, first in zip(outputs, a):
        [stage_a] = out.stage_outputs
        assert stage_a.outputs[0].token_ids == first.outputs[0].token_ids
        torch.testing.assert_close(stage_a.hidden_states, first.hidden_states, atol=1e-5,
                                   rtol=0)
        assert out.num_prompt_tokens == stage_a.hidden_states.shape[0]
        assert out.prompt is None and out.hidden_states is None


def test_a_request_done_early_runs_stage_b_while_stage_a_works(pipeline):
    pipeline.events.clear()
    params_a = [_greedy(1), _greedy(16), _greedy(16)]
    pipeline.generate(PROMPTS, [params_a, _greedy(2)])
    events = pipeline.events
    ids = sorted({e.request_id for e in events}, key=int)
    early, late = ids[0], ids[1]
    first = events.index(PipelineEvent(0, EventKind.FINISH, early))
    enters_b = events.index(PipelineEvent(1, EventKind.ADD, early))
    leaves_b = events.index(PipelineEvent(1, EventKind.FINISH, early))
    rest = events.index(PipelineEvent(0, EventKind.FINISH, late))
    assert first < enters_b < leaves_b < rest  # no batch barrier between the stages
    assert [e.kind for e in events[:3]] == [EventKind.ADD] * 3  # all entered stage A at once


def test_projection_connector(tiny_llama_dir, tiny_qwen2_dir, stage_a_by_hand,
                              stage_b_by_hand):
    torch.manual_seed(0)
    projection = torch.nn.Linear(64, 64)
    pipe = Pipeline([Stage(tiny_llama_dir, **ENGINE), Stage(tiny_qwen2_dir, **ENGINE)],
                    connectors=[HiddenStatesToEmbeds(projection)])
    outputs = pipe.generate(PROMPTS[:2], [_greedy(4), _greedy(5)])
    a = stage_a_by_hand.generate(PROMPTS[:2], SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, return_hidden_states=True),
        use_tqdm=False)
    with torch.inference_mode():
        embeds = [projection(o.hidden_states) for o in a]
    b = stage_b_by_hand.generate([{"prompt_embeds": e} for e in embeds], _greedy(5),
                                 use_tqdm=False)
    assert _tokens(outputs) == _tokens(b)


def test_text_connector_and_callables(tiny_llama_dir, tiny_qwen2_dir, stage_b_by_hand):
    pipe = Pipeline([Stage(tiny_llama_dir, **ENGINE), Stage(tiny_qwen2_dir, **ENGINE),
                     Stage(tiny_llama_dir, **ENGINE)],
                    connectors=["text_to_prompt",
                                lambda out: {"prompt_token_ids": out.outputs[0].token_ids}])
    outputs = pipe.generate(PROMPTS[:2], [_greedy(4), _greedy(3), _greedy(2)])
    for out in outputs:
        first, second = out.stage_outputs
        by_hand = stage_b_by_hand.generate(first.outputs[0].text, _greedy(3),
                                           use_tqdm=False)[0]
        assert second.outputs[0].token_ids == by_hand.outputs[0].token_ids
        assert second.prompt == first.outputs[0].text
        assert out.prompt_token_ids == second.outputs[0].token_ids
    assert isinstance(pipe.connectors[0], TextToPrompt)


def test_yaml_description(tmp_path, tiny_llama_dir, tiny_qwen2_dir, pipeline):
    path = tmp_path / "stages.yaml"
    path.write_text(f"""
name: tiny
stages:
  - model: {tiny_llama_dir}
    dtype: float32
    max_model_len: 256
    kv_cache_memory_bytes: 16777216
    sampling_params: {{temperature: 0, max_tokens: 3, ignore_eos: true}}
  - model: {tiny_qwen2_dir}
    dtype: float32
    max_model_len: 256
    kv_cache_memory_bytes: 16777216
connectors: [hidden_states_to_embeds]
""")
    spec = load_pipeline_spec(str(path))
    assert spec.name == "tiny" and spec.stages[0].sampling_params.max_tokens == 3
    from_yaml = Pipeline.from_yaml(str(path))
    # None: each stage's own sampling params (the YAML's for stage A).
    got = from_yaml.generate(PROMPTS[:2], [None, _greedy(4)])
    expected = pipeline.generate(PROMPTS[:2], [_greedy(3), _greedy(4)])
    assert _tokens(got) == _tokens(expected)


@pytest.mark.parametrize("text, message", [
    ("stages: []", "at least one stage"),
    ("stages: [{model: x}]\nextra: 1", "unknown key"),
    ("stages: [{model: x, not_a_knob: 1}]", "not_a_knob"),
    ("stages: [{model: x}, {model: y}]\nconnectors: [nope]", "Unknown connector"),
    ("stages: [{model: x}, {model: y}]\nconnectors: []", "need 1 connectors"),
    ("stages: [{model: x, sampling_params: {temperature: -1}}]", "temperature"),
])
def test_bad_yaml_is_refused(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_pipeline_spec(str(path))


def test_only_the_last_stage_samples_n(pipeline):
    with pytest.raises(ValueError, match="n > 1"):
        pipeline.generate(PROMPTS[:1], [SamplingParams(n=2), _greedy(2)])
    out = pipeline.generate(PROMPTS[:1], [_greedy(2), SamplingParams(n=2, seed=1,
                                                                     max_tokens=3)])[0]
    assert len(out.outputs) == 2
