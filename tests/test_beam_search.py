"""Beam search as an engine feature: the candidate ranking and a group's steps exactly, the
KV blocks of forked beams (shared prefix, copied last block, ref counts, freed blocks back
in the pool) exactly, and end to end against `transformers`' `generate(num_beams=k,
do_sample=False)` in float32 for a decoder-only model (two end-of-sequence ids, prefix
hits, chunked prefill, preemption, prompt embeds, beam_width=1 = greedy), BART and
Whisper."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
import transformers

from tests.core_factories import make_request, make_runner_output, make_scheduler
from tests.hf_reference import hf_greedy
from tests.model_factory import make_tiny_model
from vllm import LLM, SamplingParams
from vllm.beam_search import BeamSearchOutput
from vllm.sampling_params import BeamSearchParams
from vllm.v1.core.sched.beam_search import Beam, BeamGroup, rank_candidates
from vllm.v1.engine import FinishReason
from vllm.v1.outputs import LogprobsLists
from vllm.v1.request import Request, RequestStatus

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

# ---- ranking and a group's steps ---------------------------------------------------------


def test_rank_candidates_orders_by_cumulative_logprob():
    pending = [([7, 8], [-0.5, -2.0]), ([9, 7], [-0.1, -0.2])]
    ranked = rank_candidates([-1.0, -1.5], pending, 3)
    assert [(c.cum_logprob, c.beam, c.token_id, c.rank) for c in ranked] == [
        (-1.5, 0, 7, 0), (-1.6, 1, 9, 0), (-1.7, 1, 7, 1)]


def _row(ids: list[int], logprobs: list[float]) -> LogprobsLists:
    """A runner's logprobs row: the sampled (greedy) token, then the candidates."""
    return LogprobsLists([[ids[0], *ids]], [[logprobs[0], *logprobs]], [1])


def _stub_request(request_id: str, output: list[int]) -> Request:
    request = Request(request_id, [1, 2], None, SamplingParams(max_tokens=8), 2, 0.0, 64)
    request.output_token_ids = list(output)
    return request


def test_group_finishes_like_transformers():
    """Width 2, EOS 2, length penalty 1: an EOS among the first two candidates finishes
    (scored over its length, EOS counted); one beyond them is dropped; the search ends
    once two are finished and the best running beam cannot beat the worse."""
    group = BeamGroup("g", BeamSearchParams(beam_width=2, max_tokens=8), {2}, 8)
    assert group.num_keep == 4
    root = _stub_request("g#0", [])
    group.beams = [_beam(root)]
    assert group.record(root, _row([5, 2, 6, 7], [-0.1, -0.3, -2.0, -3.0]))
    children = group.advance()
    # EOS is second of the first two: finished at -0.3 / 1; running: 5 and 6.
    assert [(c.candidate.token_id, c.parent.request is root) for c in children] == [
        (5, True), (6, True)]
    assert [(h.token_ids, h.score, h.finish_reason) for h in group.finished] == [
        ([2], -0.3, FinishReason.STOP)]
    assert not group.done
    # Next step: beams [5] (cum -0.1) and [6] (cum -2.0).
    a, b = _stub_request("g#0", [5]), _stub_request("g#1", [6])
    group.beams = [_beam(a, -0.1), _beam(b, -2.0)]
    assert not group.record(a, _row([8, 2, 9, 4], [-0.2, -0.4, -5.0, -6.0]))
    assert group.record(b, _row([2, 3, 4, 9], [-0.1, -0.2, -0.3, -0.4]))
    children = group.advance()
    # Candidates: [5,8] -0.3, [5,2] -0.5 (EOS, within the first 2: finished -0.25),
    # [6,2] -2.1 (EOS, third: dropped), [6,3] -2.2. Finished: [5,2] -0.25, [2] -0.3;
    # the best running beam -0.3 / 2 = -0.15 can still beat -0.3: not done.
    assert [(c.candidate.token_id, c.candidate.cum_logprob) for c in children] == [
        (8, pytest.approx(-0.3)), (3, pytest.approx(-2.2))]
    assert [h.token_ids for h in group.finished] == [[5, 2], [2]]
    assert group.finished[0].score == pytest.approx(-0.25)
    assert not group.done


def test_group_stops_at_the_token_limit_with_its_best_candidates():
    group = BeamGroup("g", BeamSearchParams(beam_width=2, max_tokens=1), {2}, 1)
    root = _stub_request("g#0", [])
    group.beams = [_beam(root)]
    group.record(root, _row([5, 6, 2, 7], [-0.1, -0.3, -0.4, -3.0]))
    assert group.advance() == [] and group.done
    assert [(h.token_ids, h.finish_reason) for h in group.finished] == [
        ([5], FinishReason.LENGTH), ([6], FinishReason.LENGTH)]
    assert group.finished[0].logprobs == LogprobsLists(
        [[5, 5, 6, 2, 7]], [[-0.1, -0.1, -0.3, -0.4, -3.0]], [1])


def _beam(request: Request, cum: float = 0.0) -> Beam:
    return Beam(request, cum)


def test_beam_params_are_checked():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.5)
    beam = BeamSearchParams(beam_width=2, max_tokens=4)
    with pytest.raises(ValueError, match="n=3 cannot exceed"):
        beam.sampling_params(n=3)
    with pytest.raises(ValueError, match="top_p cannot be combined"):
        SamplingParams(temperature=0, max_tokens=4, top_p=0.5, beam_search=beam)
    with pytest.raises(ValueError, match="max_tokens and ignore_eos"):
        SamplingParams(temperature=0, max_tokens=5, beam_search=beam)


# ---- blocks of forked beams ---------------------------------------------------------------


def _candidates(row: dict[int, float]) -> tuple[list[int], list[float], int]:
    ids, values = list(row), list(row.values())
    return [ids[0], *ids], [values[0], *values], 1


def _ref_counts(scheduler, ids: list[int]) -> list[int]:
    return [scheduler.kv_cache_manager.block_pool.blocks[i].ref_cnt for i in ids]


def _start_beams(scheduler, request_id: str, prompt: list[int], params: BeamSearchParams,
                 candidates: dict[int, float]):
    """Adds a beam search and runs its prompt step, the root's candidates `candidates` (the
    first is the sampled token): the prompt step's scheduler output and its result."""
    scheduler.add_request(make_request(request_id, prompt, max_tokens=params.max_tokens,
                                       ignore_eos=params.ignore_eos, temperature=0,
                                       beam_search=params))
    out = scheduler.schedule()
    root = f"{request_id}#0"
    result = scheduler.update_from_output(out, make_runner_output(
        out, {root: [next(iter(candidates))]}, {root: _candidates(candidates)}))
    return out, result


def test_forked_beams_share_full_blocks_and_copy_the_last():
    """Block size 4, prompt of 7 tokens in blocks [1, 2]. Width 2: after the prompt, both
    candidates come from the root: it goes on in place, its fork shares block 1 and gets
    block 3, a copy of block 2 (3 of 4 slots filled). Beams that die give their blocks
    back."""
    scheduler = make_scheduler(block_size=4, num_blocks=16)
    pool = scheduler.kv_cache_manager.block_pool
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    out, result = _start_beams(scheduler, "r", list(range(10, 17)), params,
                               {40: -0.1, 41: -0.2, 42: -3.0, 43: -4.0})
    assert [r.req_id for r in out.scheduled_new_reqs] == ["r#0"]
    assert out.scheduled_new_reqs[0].sampling_params.logprobs == 4  # 2 * width candidates
    assert scheduler.kv_cache_manager.get_block_ids("r#0") == [1, 2]
    assert result.outputs == []
    assert scheduler.kv_cache_manager.get_block_ids("r#1") == [1, 3]
    assert _ref_counts(scheduler, [1, 2, 3]) == [2, 1, 1]
    assert scheduler.requests["r#0"].output_token_ids == [40]
    assert scheduler.requests["r#1"].output_token_ids == [41]
    # Both go to the runner in full, after block 2 is copied into block 3.
    out = scheduler.schedule()
    assert out.blocks_to_copy == [(2, 3)]
    assert [(r.req_id, r.block_ids, r.num_computed_tokens, r.output_token_ids)
            for r in out.scheduled_new_reqs] == [
        ("r#0", [1, 2], 7, [40]), ("r#1", [1, 3], 7, [41])]
    # Step 2: every candidate continues r#1 ([41]): r#0 dies, r#1 forks again (position 8
    # starts a new block, so nothing is copied: blocks 1 and 3 are shared).
    free_before = pool.get_num_free_blocks()
    scheduler.update_from_output(out, make_runner_output(
        out, {"r#0": [50], "r#1": [60]},
        {"r#0": _candidates({50: -5.0, 51: -6.0, 52: -7.0, 53: -8.0}),
         "r#1": _candidates({60: -0.1, 61: -0.2, 62: -0.3, 63: -0.4})}))
    assert "r#0" not in scheduler.requests
    assert scheduler.kv_cache_manager.get_block_ids("r#2") == [1, 3]
    assert _ref_counts(scheduler, [1, 2, 3]) == [2, 0, 2]
    assert pool.get_num_free_blocks() == free_before + 1  # block 2 is back
    out = scheduler.schedule()
    assert out.blocks_to_copy == [] and "r#0" in out.finished_req_ids
    # r#1 and r#2 each get a block of their own for position 8 (from the free queue's
    # head: block 2 went to its tail).
    assert [(r.req_id, r.block_ids) for r in out.scheduled_new_reqs] == [
        ("r#1", [1, 3, 4]), ("r#2", [1, 3, 5])]
    # The group ends at max_tokens=4 after two more steps; every block goes back.
    for step in range(2):
        rows = {r: _candidates({70 + step: -0.1, 80: -0.5, 81: -0.6, 82: -0.7})
                for r in out.num_scheduled_tokens}
        result = scheduler.update_from_output(out, make_runner_output(
            out, {r: [70 + step] for r in out.num_scheduled_tokens}, rows))
        out = scheduler.schedule()
    [final] = result.outputs
    assert final.request_id == "r" and final.finish_reason == FinishReason.LENGTH
    assert final.beams is not None
    assert [b.token_ids for b in final.beams] == [[41, 60, 70, 71], [41, 61, 70, 71]]
    assert not scheduler.requests and not scheduler.has_unfinished_requests()
    assert pool.get_num_free_blocks() == 15


def test_aborting_a_beam_search_frees_every_beam():
    scheduler = make_scheduler(block_size=4, num_blocks=16)
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    _start_beams(scheduler, "r", list(range(10, 16)), params,
                 {40: -0.1, 41: -0.2, 42: -0.3, 43: -4.0, 44: -5.0, 45: -6.0})
    assert sorted(scheduler.requests) == ["r#0", "r#1", "r#2"]
    scheduler.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.requests and not scheduler.beam_search.groups
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 15


# ---- end to end against transformers ------------------------------------------------------

PROMPTS = ["Hello world, this is", "The quick brown fox jumps over the lazy dog.", "A"]
WIDTH, MAX_TOKENS = 3, 10


@torch.inference_mode()
def _hf_beams(model, width: int, max_tokens: int, eos: list[int], length_penalty: float = 1.0,
              **inputs) -> tuple[list[list[int]], list[float]]:
    """transformers' beam search (its own generate, bypassing Whisper's): each returned
    sequence's generated tokens (padding after EOS cut) and score."""
    config = transformers.GenerationConfig(
        num_beams=width, do_sample=False, num_return_sequences=width,
        max_new_tokens=max_tokens, early_stopping=False, length_penalty=length_penalty,
        eos_token_id=eos, pad_token_id=eos[0], output_scores=True,
        return_dict_in_generate=True, decoder_start_token_id=None)
    out = transformers.GenerationMixin.generate(  # type: ignore[attr-defined]
        model, generation_config=config, **inputs)
    prompt_len = (inputs["decoder_input_ids"] if "decoder_input_ids" in inputs
                  else inputs["input_ids"]).shape[1]
    sequences = []
    for seq in out.sequences.tolist():
        tokens = seq[prompt_len:]
        ends = [i for i, t in enumerate(tokens) if t in eos]
        sequences.append(tokens[:ends[0] + 1] if ends else tokens)
    return sequences, out.sequences_scores.tolist()


def _assert_beams_equal(ours: BeamSearchOutput, prompt_len: int, hf: tuple, width: int,
                        length_penalty: float = 1.0) -> None:
    tokens, scores = hf
    assert [s.tokens[prompt_len:] for s in ours.sequences] == tokens
    for seq, score in zip(ours.sequences, scores):
        generated = len(seq.tokens) - prompt_len
        assert seq.cum_logprob / generated ** length_penalty == pytest.approx(score, abs=1e-4)
    assert len(ours.sequences) == width


@pytest.fixture(scope="module")
def llama_two_eos_dir(tmp_path_factory) -> tuple[str, list[int]]:
    """A tiny Llama whose generation_config.json names a second end-of-sequence id: a token
    its beams often pick, so that hypotheses finish early and the stopping rule matters."""
    path = make_tiny_model(str(tmp_path_factory.mktemp("beam_llama")), "llama")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    greedy = hf_greedy(model.eval(), tokenizer(PROMPTS[0]).input_ids, 4).token_ids[-1]
    eos = [tokenizer.eos_token_id, greedy]
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos}, f)
    return path, eos


@pytest.fixture(scope="module")
def llama_beams(llama_two_eos_dir):
    """One engine, small: prefix caching, prompt chunks of 8 tokens, and a KV cache that
    cannot hold every beam at once (so beams are preempted and recomputed)."""
    path, _ = llama_two_eos_dir
    return LLM(path, dtype="float32", max_model_len=48, block_size=4, enforce_eager=True,
               num_gpu_blocks_override=16, max_num_batched_tokens=8,
               enable_prompt_embeds=True, max_num_seqs=8)


def test_decoder_only_beams_equal_transformers(llama_two_eos_dir, llama_beams, monkeypatch):
    path, eos = llama_two_eos_dir
    tokenizer = llama_beams.get_tokenizer()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS)
    scheduler = llama_beams.llm_engine.engine_core.scheduler
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    kv = scheduler.kv_cache_manager
    assert llama_beams.llm_engine.reset_prefix_cache()  # no hits left by other tests
    hits: list[int] = []
    lookup = kv.record_prefix_lookup
    monkeypatch.setattr(kv, "record_prefix_lookup",
                        lambda num, hit: (hits.append(hit), lookup(num, hit))[1])
    # Text and token-id prompts at once (the last repeats the first: prefix hits).
    outputs = llama_beams.beam_search([*PROMPTS, {"prompt_token_ids": ids[0]}], params)
    assert scheduler.num_preemptions > 0 and sum(hits) > 0
    finished_early = 0
    for prompt_ids, ours in zip([*ids, ids[0]], outputs, strict=True):
        hf = _hf_beams(model, WIDTH, MAX_TOKENS, eos, input_ids=torch.tensor([prompt_ids]))
        _assert_beams_equal(ours, len(prompt_ids), hf, WIDTH)
        finished_early += sum(s.finish_reason == "stop" for s in ours.sequences)
        best = ours.sequences[0]
        assert best.tokens[:len(prompt_ids)] == prompt_ids
        assert len(best.logprobs) == len(best.tokens) - len(prompt_ids)
        assert best.cum_logprob == pytest.approx(
            sum(lp[t].logprob for lp, t in zip(best.logprobs, best.tokens[len(prompt_ids):])))
    assert finished_early > 0  # the stopping rule was exercised
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 15
    # A length penalty changes the ranking as it does in transformers.
    penalized = BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS, length_penalty=-0.5)
    [ours] = llama_beams.beam_search([PROMPTS[1]], penalized)
    hf = _hf_beams(model, WIDTH, MAX_TOKENS, eos, length_penalty=-0.5,
                   input_ids=torch.tensor([ids[1]]))
    _assert_beams_equal(ours, len(ids[1]), hf, WIDTH, length_penalty=-0.5)


def test_width_one_is_greedy_and_embeds_equal_ids(llama_two_eos_dir, llama_beams):
    tokenizer = llama_beams.get_tokenizer()
    ids = tokenizer(PROMPTS[1]).input_ids
    [greedy] = llama_beams.generate([PROMPTS[1]], SamplingParams(temperature=0,
                                                                 max_tokens=MAX_TOKENS))
    [beam] = llama_beams.beam_search([PROMPTS[1]], BeamSearchParams(beam_width=1,
                                                                    max_tokens=MAX_TOKENS))
    assert beam.sequences[0].tokens[len(ids):] == greedy.outputs[0].token_ids
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_two_eos_dir[0],
                                                              dtype=torch.float32)
    embeds = model.get_input_embeddings()(torch.tensor(ids)).detach()
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS)
    by_embeds, by_ids = llama_beams.beam_search(
        [{"prompt_embeds": embeds}, {"prompt_token_ids": ids}], params)
    assert [s.tokens for s in by_embeds.sequences] == \
        [s.tokens[len(ids):] for s in by_ids.sequences]
    for a, b in zip(by_embeds.sequences, by_ids.sequences):
        assert a.cum_logprob == pytest.approx(b.cum_logprob, abs=1e-4)
        assert a.text == b.text


# ---- encoder/decoder ----------------------------------------------------------------------


def _bart_case(path: str, llm: LLM) -> tuple[object, list, list[dict], list[int], int]:
    """BART: text prompts; the decoder starts <DEC> <BOS>; EOS 2."""
    model = transformers.BartForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    tokenizer = llm.get_tokenizer()
    inputs = [{"input_ids": torch.tensor([tokenizer(text).input_ids])} for text in PROMPTS[:2]]
    return model, PROMPTS[:2], inputs, [2, 1], 2


def _whisper_case(path: str, llm: LLM) -> tuple[object, list, list[dict], list[int], int]:
    """Whisper: 1 s and 3 s of noise; the decoder starts <|startoftranscript|>
    <|notimestamps|>; EOS <|endoftext|>."""
    model = transformers.WhisperForConditionalGeneration.from_pretrained(path,
                                                                         dtype=torch.float32)
    rng = np.random.default_rng(0)
    waves = [(0.1 * rng.standard_normal(16_000 * s)).astype(np.float32) for s in (1, 3)]
    extractor = transformers.WhisperFeatureExtractor(feature_size=80)
    inputs = [{"input_features": extractor(w, sampling_rate=16_000,
                                           return_tensors="pt").input_features} for w in waves]
    prompts = [{"prompt": "", "multi_modal_data": {"audio": (w, 16_000)}} for w in waves]
    return model, prompts, inputs, [50257, 50362], 50256


@pytest.mark.parametrize(("kind", "block_size", "case"), [
    ("bart", 4, _bart_case), ("whisper", 16, _whisper_case)], ids=["bart", "whisper"])
def test_encoder_decoder_beams_equal_transformers(kind, block_size, case, request):
    path = request.getfixturevalue(f"tiny_{kind}_dir")
    llm = LLM(path, dtype="float32", max_model_len=64, block_size=block_size,
              enforce_eager=True, kv_cache_memory_bytes=8 * 1024**2)
    model, prompts, hf_inputs, decoder, eos = case(path, llm)
    outputs = llm.beam_search(prompts, BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS))
    for inputs, ours in zip(hf_inputs, outputs, strict=True):
        assert ours.sequences[0].tokens[:2] == decoder
        assert not math.isnan(ours.sequences[0].cum_logprob)
        hf = _hf_beams(model.eval(), WIDTH, MAX_TOKENS, [eos],
                       decoder_input_ids=torch.tensor([decoder]), **inputs)
        _assert_beams_equal(ours, 2, hf, WIDTH)


def test_beams_waiting_for_their_group_make_room_and_a_failing_beam_fails_its_request():
    """Four usable blocks of 4. Two beams of a 7-token prompt hold 3; at position 8 each needs
    one more: the first gets the last free block and reports, the second is preempted. It
    cannot come back while the first (parked, waiting for it) holds the blocks: the parked
    beam is preempted instead (its candidates kept), the second runs, the group finishes."""
    scheduler = make_scheduler(block_size=4, num_blocks=5)
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    first = {40: -0.1, 41: -0.2, 42: -3.0, 43: -4.0}
    _start_beams(scheduler, "r", list(range(10, 17)), params, first)
    out = scheduler.schedule()
    rows = {"r#0": _candidates({50: -0.1, 51: -5.0, 52: -6.0, 53: -7.0}),
            "r#1": _candidates({60: -0.1, 61: -5.0, 62: -6.0, 63: -7.0})}
    scheduler.update_from_output(out, make_runner_output(out, {"r#0": [50], "r#1": [60]}, rows))
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["r#0"] and out.preempted_req_ids == ["r#1"]
    scheduler.update_from_output(out, make_runner_output(
        out, {"r#0": [70]}, {"r#0": _candidates({70: -0.1, 71: -0.5, 72: -6.0, 73: -7.0})}))
    out = scheduler.schedule()
    assert out.preempted_req_ids == ["r#0"]
    assert [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [("r#1", 8)]
    result = scheduler.update_from_output(out, make_runner_output(
        out, {"r#1": [80]}, {"r#1": _candidates({80: -0.1, 81: -9.0, 82: -9.5, 83: -9.9})}))
    [final] = result.outputs
    assert [b.token_ids for b in final.beams or []] == [[40, 50, 70], [41, 60, 80]]
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 4
    # A beam that fails alone fails its whole request; every beam is freed.
    _start_beams(scheduler, "s", list(range(20, 27)), params, first)
    out = scheduler.schedule()
    scheduler.recover_from_failed_step(out)  # two beams: both become suspects
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["s#0"]
    [failed] = scheduler.recover_from_failed_step(out).outputs
    assert (failed.request_id, failed.finish_reason) == ("s", FinishReason.ERROR)
    assert not scheduler.requests and not scheduler.beam_search.groups
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 4
