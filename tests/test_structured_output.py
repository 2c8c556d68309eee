"""Structured outputs without a model: the params' checks, canonical keys, the llguidance
backend on a tiny tokenizer (compile errors, masks, EOS only at the end), the runner's
batched bitmask, and the scheduler's WAITING_FOR_GRAMMAR state."""

from __future__ import annotations

import json
import threading

import llguidance
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from tests.core_factories import make_request, make_runner_output, make_scheduler
from vllm._custom_ops import cpu_ops
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus
from vllm.v1.structured_output.backend import GrammarError, StructuredOutputBackend, grammar_key
from vllm.v1.structured_output.bitmask import apply_bitmask_torch, apply_grammar_bitmask
from vllm.v1.structured_output.guidance import GuidanceBackend
from vllm.v1.structured_output.manager import GrammarCompiler, StructuredOutputManager

S = StructuredOutputsParams


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(lambda: tokenizer, len(tokenizer) + 5)  # logits wider than vocab


def allowed_ids(compiler, grammar) -> list[int]:
    mask = torch.zeros(1, (compiler.vocab_size + 31) // 32, dtype=torch.int32)
    grammar.fill_bitmask(mask, 0)
    return [t for t in range(compiler.vocab_size) if (int(mask[0, t // 32]) >> (t % 32)) & 1]


@pytest.mark.parametrize("kwargs, message", [
    ({"regex": "a", "json_object": True},
     "one constraint of json, regex, choice, grammar, json_object"),
    ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": "[1]"}, "must be a JSON schema object"),
    ({"choice": []}, "choice must be a non-empty list of strings"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"structural_tag": "{}"}, "structural_tag.triggers must be a non-empty list"),
    ({"regex": "a", "whitespace_pattern": ""}, "whitespace_pattern must be a non-empty"),
])
def test_params_need_exactly_one_valid_constraint(kwargs, message):
    with pytest.raises(ValueError, match=message):
        S(**kwargs)
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]


def test_canonical_keys():
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {}}}
    # A dict and its JSON text are one constraint; property order is kept (it is the
    # output's order), and disable_any_whitespace is part of the key.
    assert grammar_key(S(json=schema)) == grammar_key(S(json=json.dumps(schema, indent=2)))
    # Schemas are strict (tests/test_strict_schemas.py): closed whether or not
    # disable_additional_properties says so.
    assert json.loads(grammar_key(S(json=schema)).spec) == {**schema,
                                                            "additionalProperties": False}
    assert list(json.loads(grammar_key(S(json=schema)).spec)["properties"]) == ["b", "a"]
    assert grammar_key(S(json=schema)) != grammar_key(S(json=schema, disable_any_whitespace=True))
    assert grammar_key(S(json=schema)) == grammar_key(S(json=schema,
                                                        disable_additional_properties=True))
    assert grammar_key(S(json_object=True)) != grammar_key(S(json={"type": "object"}))


@pytest.mark.parametrize("params, message", [
    (S(json={"type": "integer", "minimum": 5, "maximum": 2}), "Invalid JSON schema: .*minimum"),
    (S(json={"type": "nonsense"}), "Invalid JSON schema"),
    (S(regex="[a-"), "Invalid regex"),
    (S(grammar="start: undefined_rule"), "Invalid grammar"),
    (S(grammar='start: start "a"'), "The grammar cannot match any output"),
])
def test_bad_constraints_name_the_problem(compiler, params, message):
    with pytest.raises(GrammarError, match=message):
        compiler.compile(params)


def test_compile_cache_and_masks_follow_the_grammar(compiler, tokenizer):
    eos = tokenizer.eos_token_id
    before = compiler.num_compiled
    grammar = compiler.new_matcher(S(choice=["yes", "no"]))
    compiler.new_matcher(S(choice=["yes", "no"]))  # cached: compiled once
    assert compiler.num_compiled == before + 1
    first = allowed_ids(compiler, grammar)
    texts = {tokenizer.decode([t]) for t in first}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert eos not in first and max(first) < len(tokenizer)  # padding ids never allowed
    ids = tokenizer.encode("yes", add_special_tokens=False)
    assert grammar.accept_tokens(ids)
    assert grammar.is_terminated()
    assert allowed_ids(compiler, grammar) == [eos]  # EOS only where the grammar ends
    assert not grammar.accept_tokens(tokenizer.encode("no", add_special_tokens=False))
    grammar.rollback(len(ids))
    assert allowed_ids(compiler, grammar) == first
    assert grammar.accept_tokens(tokenizer.encode("no", add_special_tokens=False))
    assert grammar.accept_tokens([eos])
    grammar.reset()
    assert allowed_ids(compiler, grammar) == first


def test_json_schema_mask_walk(compiler, tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    grammar = compiler.new_matcher(S(json=schema, disable_any_whitespace=True))
    ids = tokenizer.encode('{"n":7}', add_special_tokens=False)
    for token in ids:
        assert token in allowed_ids(compiler, grammar)
        assert grammar.accept_tokens([token])
    assert grammar.is_terminated()
    bad = compiler.new_matcher(S(json=schema, disable_any_whitespace=True))
    assert not bad.accept_tokens([tokenizer.eos_token_id])  # not where the grammar may end
    assert not bad.accept_tokens(tokenizer.encode('{"n":12}', add_special_tokens=False))
    assert bad.accept_tokens(tokenizer.encode('{"n":1', add_special_tokens=False))


def test_rollback_over_eos_after_the_grammar_stopped(compiler, tokenizer):
    """A draft EOS right after a grammar that can only end (the matcher has stopped and does
    not record the EOS): accepted, and rolling back over it and the tokens before leaves the
    matcher where it began (the scheduler's draft check and the drafts' masks do this)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    grammar = compiler.new_matcher(S(json=schema, disable_any_whitespace=True))
    first = allowed_ids(compiler, grammar)
    ids = tokenizer.encode('{"n":7}', add_special_tokens=False) + [tokenizer.eos_token_id]
    assert all(grammar.accept_tokens([token]) for token in ids)
    assert grammar.is_terminated()
    grammar.rollback(len(ids))
    assert not grammar.is_terminated()
    assert allowed_ids(compiler, grammar) == first
    assert all(grammar.accept_tokens([token]) for token in ids)  # the same walk again


def test_apply_grammar_bitmask_touches_only_constrained_rows():
    logits = torch.arange(3 * 40, dtype=torch.float32).view(3, 40)
    original = logits.clone()
    # Row "b" allows tokens 0 and 33; "c" allows 1..31 (word 0 without bit 0), none of 32+.
    bitmask = torch.tensor([[0b1, 0b10], [-2, 0]], dtype=torch.int32)
    apply_grammar_bitmask(logits, ["a", "b", "c"], ["b", "c"], bitmask)
    assert torch.equal(logits[0], original[0])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0, 33]
    assert logits[1, 33] == original[1, 33]
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == list(range(1, 32))
    every = original[1:].clone()  # every sampling row constrained: masked in place
    apply_grammar_bitmask(every, ["b", "c"], ["b", "c"], bitmask)
    assert torch.equal(every, logits[1:])


def unpacked_reference(logits, rows, bitmask):
    """The former form: every word unpacked to one bool per token, then a masked fill."""
    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=logits.shape[1],
                            bitorder="little")
    out = logits.clone()
    out[rows] = out[rows].masked_fill(torch.from_numpy(allowed) == 0, float("-inf"))
    return out


def random_bitmask(generator, num_rows, vocab):
    """Random words, with whole words of ones (skipped by the kernel) and zeros among them."""
    words = torch.randint(-2**31, 2**31 - 1, (num_rows, (vocab + 31) // 32), dtype=torch.int32,
                          generator=generator)
    words[:, 1::7] = -1
    words[:, 2::5] = 0
    return words


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1000, 1024, 49152 + 5])  # last word 8, 32, 5 tokens
@pytest.mark.parametrize("form", ["native", "torch"])
def test_packed_bitmask_equals_unpacked_form(dtype, vocab, form):
    """Rows in another order than the logits, a row left unconstrained, any last word."""
    if form == "native" and cpu_ops() is None:
        pytest.skip("native kernels unavailable")
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=generator).to(dtype)
    bitmask = random_bitmask(generator, 4, vocab)
    bitmask[3, -1] = -1  # the last word all ones: its bits past the vocabulary are ignored
    sampling, constrained = ["a", "b", "c", "d", "e"], ["d", "a", "e", "b"]
    expected = unpacked_reference(logits, [3, 0, 4, 1], bitmask)
    every = logits[[3, 0, 4, 1]]  # the same rows as the whole batch, in bitmask order
    if form == "native":
        apply_grammar_bitmask(logits, sampling, constrained, bitmask)
        apply_grammar_bitmask(every, constrained, constrained, bitmask)
    else:
        apply_bitmask_torch(logits, torch.tensor([3, 0, 4, 1]), bitmask)
        apply_bitmask_torch(every, None, bitmask)
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits[2]).all()  # "c" has no grammar
    assert torch.equal(every, expected[[3, 0, 4, 1]])


def test_packed_bitmask_checks_its_inputs():
    ops = cpu_ops()
    if ops is None:
        pytest.skip("native kernels unavailable")
    logits = torch.zeros(2, 40)
    with pytest.raises(RuntimeError, match="bitmask has 1 words per row; logits of width 40"):
        ops.apply_token_bitmask(logits, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="row 2 is outside the logits' 2 rows"):
        ops.apply_token_bitmask(logits, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([2]))


def test_parallel_fill_equals_row_by_row(tokenizer):
    """llguidance's batched fill gives the bits the row-by-row fill gives, for grammars at
    different points (fresh, mid-way, complete); with drafts the step fills row by row."""
    compiler = GrammarCompiler(lambda: tokenizer, len(tokenizer) + 5)  # its own cache
    schema = {"type": "object", "properties": {"n": {"type": "integer"},
                                               "s": {"type": "string"}}}
    constraints = [S(json=schema, disable_any_whitespace=True), S(json=schema),
                   S(choice=["yes", "no"]), S(regex="[a-c]+x"), S(choice=["yes", "no"])]
    prefixes = ['{"n":1', "", "yes", "ab", "n"]

    def grammars():
        out = [compiler.new_matcher(c) for c in constraints]
        for grammar, text in zip(out, prefixes):
            assert grammar.accept_tokens(tokenizer.encode(text, add_special_tokens=False))
        return out

    backend = compiler.backend
    assert isinstance(backend, GuidanceBackend)
    backend.executor = llguidance.LLExecutor(num_threads=2)  # whatever the machine's threads
    width = (compiler.vocab_size + 31) // 32
    no_drafts = [[] for _ in constraints]
    parallel = torch.full((len(constraints), width), 7, dtype=torch.int32)
    backend.fill_bitmasks(grammars(), no_drafts, parallel)
    row_by_row = torch.full((len(constraints), width), 7, dtype=torch.int32)
    StructuredOutputBackend.fill_bitmasks(backend, grammars(), no_drafts, row_by_row)
    assert torch.equal(parallel, row_by_row)
    assert len({tuple(row.tolist()) for row in parallel}) == len(constraints)  # all differ
    drafts = [[], [], [], tokenizer.encode("c", add_special_tokens=False), []]
    with_drafts = torch.full((len(constraints) + len(drafts[3]), width), 7, dtype=torch.int32)
    backend.fill_bitmasks(grammars(), drafts, with_drafts)
    assert torch.equal(with_drafts[:4], parallel[:4]) and torch.equal(with_drafts[-1], parallel[4])


class GatedCompiler(GrammarCompiler):
    """Compiles only once the test opens the gate."""

    def __init__(self, base: GrammarCompiler) -> None:
        super().__init__(lambda: None, base.vocab_size)
        self._backend = base.backend
        self.gate = threading.Event()

    def new_matcher(self, params):
        assert self.gate.wait(10)
        return super().new_matcher(params)


def test_scheduler_waits_for_grammars_without_blocking_others(compiler, tokenizer):
    gated = GatedCompiler(compiler)
    manager = StructuredOutputManager(gated)
    scheduler = make_scheduler(structured_output_manager=manager)
    scheduler.add_request(make_request("json", [5, 6, 7], structured_outputs=S(choice=["yes"])))
    scheduler.add_request(make_request("bad", [5, 6], structured_outputs=S(regex="[a-")))
    scheduler.add_request(make_request("free", [8, 9]))
    assert scheduler.requests["json"].status == RequestStatus.WAITING_FOR_GRAMMAR
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["free"] and out.grammar_bitmask is None
    scheduler.update_from_output(out, make_runner_output(out, {"free": [11]}))
    gated.gate.set()
    for future in (scheduler.requests[r].grammar_future for r in ("json", "bad")):
        assert future is not None
        future.exception(timeout=10)
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["free", "json"]
    assert out.structured_output_request_ids == ["json"]
    assert out.grammar_bitmask is not None and out.grammar_bitmask.shape == (
        1, (compiler.vocab_size + 31) // 32)
    yes = tokenizer.encode("yes", add_special_tokens=False)
    engine_outputs = scheduler.update_from_output(
        out, make_runner_output(out, {"free": [12], "json": yes[:1]}))
    failed = [o for o in engine_outputs.outputs if o.request_id == "bad"]
    assert failed[0].finish_reason == FinishReason.ERROR
    assert "Invalid regex" in str(failed[0].stop_reason)
    assert "bad" not in scheduler.requests
    grammar = scheduler.requests["json"].grammar
    assert grammar is not None and grammar.is_terminated() == (len(yes) == 1)
    manager.shutdown()
