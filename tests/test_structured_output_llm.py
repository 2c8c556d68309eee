"""Structured outputs through `LLM.generate`: 42 JSON schemas on the default model, greedy
and sampled, under preemption (every output parses and validates); regexes, choices, Lark
and GBNF grammars with every prompt form, n > 1, stop strings and chunked prefill; bad
constraints fail alone; unconstrained requests in a mixed batch are unchanged."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from tests.hf_reference import load_hf_model
from tests.structured_output_schemas import SCHEMAS
from vllm import LLM, SamplingParams
from vllm.sampling_params import StructuredOutputsParams as S

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

PROMPT = "Answer with a JSON value that matches the request.\nJSON:"
CHOICES = ["positive", "negative", "neutral"]
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
LARK = """
start: "The answer is " NUM " " UNIT "."
NUM: /[1-9][0-9]?/
UNIT: "apples" | "pears"
"""
GBNF = 'root ::= "[" item ("," item)? ("," item)? "]"\nitem ::= [a-c]'


@pytest.fixture(scope="module")
def llm(default_model_path) -> LLM:
    # Widened to float: the mixed-batch test checks that constrained requests leave the
    # unconstrained ones as they were alone, which needs every step's rows computed the
    # same way at any batch size (the file's blocks take int8 activations in steps of up
    # to 16 rows and the dense weight above).
    return LLM(default_model_path, quantization="none", max_model_len=512, enforce_eager=True)


def _validator(schema):
    return jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def test_json_schemas_greedy_and_sampled(llm):
    # Compact JSON (no whitespace between tokens) keeps a small model's outputs short;
    # the default, flexible whitespace is the json_object case of the next test.
    greedy = [SamplingParams(temperature=0, max_tokens=80, structured_outputs=S(
        json=s, disable_any_whitespace=True)) for s in SCHEMAS]
    sampled = [SamplingParams(temperature=0.8, seed=i, max_tokens=80,
                              structured_outputs=S(json=s, disable_any_whitespace=True))
               for i, s in enumerate(SCHEMAS)]
    outputs = llm.generate([PROMPT] * (2 * len(SCHEMAS)), greedy + sampled, use_tqdm=False)
    for i, output in enumerate(outputs):
        schema, completion = SCHEMAS[i % len(SCHEMAS)], output.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        value = json.loads(completion.text)
        errors = list(_validator(schema).iter_errors(value))
        assert not errors, (schema, completion.text, errors[0].message)
        assert "\n" not in completion.text and ": " not in completion.text.split('"')[0]


def test_regex_choice_grammars_prompt_forms_and_mixed_batch(llm):
    tok = llm.get_tokenizer()
    free = [SamplingParams(temperature=0, max_tokens=12),
            SamplingParams(temperature=0.9, seed=3, max_tokens=12)]
    alone = llm.generate(["The capital of France is", "Once upon a time"], free,
                         use_tqdm=False)
    chat = tok.apply_chat_template([{"role": "user", "content": "Is this review good?"}],
                                   tokenize=False, add_generation_prompt=True)
    constrained = [
        (chat, SamplingParams(temperature=0, max_tokens=10, structured_outputs=S(
            choice=CHOICES))),
        ({"prompt_token_ids": tok.encode("Call me at")}, SamplingParams(
            temperature=0.7, seed=1, max_tokens=20, structured_outputs=S(regex=PHONE))),
        ({"prompt": "How many apples?"}, SamplingParams(
            temperature=0, max_tokens=20, structured_outputs=S(grammar=LARK))),
        ("Some letters:", SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=20,
                                         structured_outputs=S(grammar=GBNF))),
        ("A JSON object:", SamplingParams(temperature=0, max_tokens=24, structured_outputs=S(
            json_object=True))),
        # A stop string inside the structure ends it early: finish_reason "stop".
        ("Call me at", SamplingParams(temperature=0, max_tokens=20, stop=[")"],
                                      structured_outputs=S(regex=PHONE))),
        # Too few tokens for the structure: "length", and what was made is a prefix.
        ("Call me at", SamplingParams(temperature=0, max_tokens=3,
                                      structured_outputs=S(regex=PHONE))),
    ]
    prompts = ["The capital of France is", *[p for p, _ in constrained], "Once upon a time"]
    params = [free[0], *[p for _, p in constrained], free[1]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    # The unconstrained requests, mixed with constrained ones, are as they were alone.
    assert outputs[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert outputs[-1].outputs[0].token_ids == alone[1].outputs[0].token_ids
    choice, phone, lark, gbnf, obj, stopped, short = outputs[1:-1]
    assert choice.outputs[0].text in CHOICES
    assert re.fullmatch(PHONE, phone.outputs[0].text)
    assert re.fullmatch(r"The answer is [1-9][0-9]? (apples|pears)\.", lark.outputs[0].text)
    assert len(gbnf.outputs) == 3
    for sample in gbnf.outputs:
        assert re.fullmatch(r"\[[a-c](,[a-c]){0,2}\]", sample.text), sample.text
        assert sample.finish_reason == "stop"
    if obj.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.outputs[0].text), dict)
    assert obj.outputs[0].text.startswith("{")
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == ")"
    assert re.fullmatch(r"\(\d{3}", stopped.outputs[0].text)
    assert short.outputs[0].finish_reason == "length"
    assert len(short.outputs[0].token_ids) == 3
    assert re.fullmatch(r"\(\d{0,3}\)? ?\d{0,3}", short.outputs[0].text), short.outputs[0].text


BAD_CONSTRAINTS = [
    (S(json={"type": "object", "properties": {"a": {"type": "frobnicate"}}}),
     "Invalid JSON schema"),
    (S(regex="(unclosed"), "Invalid regex"),
    (S(grammar='start: start "x"'), "cannot match any output"),
    (S(grammar="start: missing"), "Invalid grammar"),
]


def test_bad_constraints_fail_alone(llm):
    for constraint, message in BAD_CONSTRAINTS:
        with pytest.raises(ValueError, match=message):
            llm.generate(["a", "b"], [SamplingParams(max_tokens=2), SamplingParams(
                max_tokens=2, structured_outputs=constraint)], use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="takes one constraint"):
        S(regex="a", json_object=True)
    with pytest.raises(ValueError, match="options but no constraint"):
        llm.generate("a", SamplingParams(structured_outputs=S(disable_any_whitespace=True)))
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        llm.generate("a", SamplingParams(min_tokens=2, structured_outputs=S(regex="a+")))
    # LLM.chat: the rendered conversation, constrained like any prompt.
    messages = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    params = SamplingParams(temperature=0, max_tokens=4,
                            structured_outputs=S(choice=["yes", "no"]))
    out = llm.chat(messages, params, use_tqdm=False)
    assert out[0].outputs[0].text in ("yes", "no")
    tok = llm.get_tokenizer()
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True),
                     add_special_tokens=False)
    assert out[0].prompt_token_ids == ids


def test_prompt_embeds_chunked_prefill_and_preemption_on_a_tiny_model(tiny_llama_dir):
    """Random weights: whatever the model prefers, the grammar holds. Prompt embeds (alone
    and mixed with ids), prompts
    chunked over several steps (8-token budget) and requests preempted for want of KV blocks
    sample only inside their grammars, and greedily give what an unhindered run gives."""
    def run(**kwargs):
        llm = LLM(tiny_llama_dir, dtype="float32", enable_prompt_embeds=True,
                  max_model_len=64, enforce_eager=True, **kwargs)
        tok = llm.get_tokenizer()
        ids = tok.encode("a rather long prompt that needs several chunks to prefill")
        embeds = load_hf_model(tiny_llama_dir).get_input_embeddings()(
            torch.tensor(ids)).detach()
        # The same prompt as ids with its middle as embeds rows (a mixed prompt).
        mixed = {"prompt_segments": [ids[:5], embeds[5:12], ids[12:]],
                 "add_special_tokens": False}
        params = [SamplingParams(temperature=0, max_tokens=16, structured_outputs=c)
                  for c in (S(regex=PHONE), S(regex=PHONE), S(choice=CHOICES),
                            S(json=SCHEMAS[8], disable_any_whitespace=True), S(regex=PHONE))]
        outputs = llm.generate([{"prompt_embeds": embeds}, *[{"prompt_token_ids": ids}] * 3,
                                mixed], params, use_tqdm=False)
        return outputs, llm.llm_engine.engine_core.scheduler.num_preemptions

    hindered, num_preemptions = run(max_num_batched_tokens=8, block_size=4,
                                    num_gpu_blocks_override=18)
    free, _ = run()
    assert num_preemptions > 0
    embeds_out, ids_out, choice_out, json_out, mixed_out = [o.outputs[0] for o in hindered]
    assert re.fullmatch(PHONE, ids_out.text), ids_out.text
    assert embeds_out.token_ids == ids_out.token_ids == mixed_out.token_ids
    assert choice_out.text in CHOICES
    assert json_out.finish_reason == "length" or _validator(SCHEMAS[8]).is_valid(
        json.loads(json_out.text))
    assert [o.outputs[0].token_ids for o in hindered] == [o.outputs[0].token_ids for o in free]
