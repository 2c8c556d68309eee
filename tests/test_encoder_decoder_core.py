"""Exact CPU tests of encoder/decoder support in the core: cross-attention blocks in the
KV cache manager (allocation, all or nothing, freeing, sharing, eviction), block hashes
chained from the encoder input, the scheduler's encoder budget and encoder runs, the cross
slot mapping and the encoder runner's writes, the runner's cross tables, the attention
backend's ENCODER_DECODER and ENCODER paths against dense references, and a simulated run
checking every cross and self slot a request reads.

Block size 4 throughout; block 0 is the null block, so a fresh pool hands out 1, 2, 3, ...
An encoder input of n rows holds cdiv(n, 4) cross blocks, taken before the request's first
self-attention blocks.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.core_factories import (
    cached,
    make_encoder_input,
    make_params,
    make_request,
    make_runner_output,
    make_scheduler,
    make_scheduler_request,
)
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backends import torch_sdpa
from vllm.v1.attention.backends.abstract import (
    AttentionType,
    CommonAttentionMetadata,
    EncoderAttentionMetadata,
)
from vllm.v1.attention.backends.torch_sdpa import TorchSDPABackend
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import cross_block_hashes, hash_block
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EncoderInput, EngineCoreOutputs
from vllm.v1.request import Request, RequestStatus
from vllm.v1.sample.sampler import SamplerOutput
from vllm.v1.worker.encoder_runner import EncoderRunner, compute_cross_slot_mapping
from vllm.v1.worker.input_batch import CachedRequestState, InputBatch
from vllm.v1.worker.model_runner import ModelRunner

BLOCK_SIZE = 4


# ---- helpers -------------------------------------------------------------------------------


def enc(name: str, num_tokens: int) -> EncoderInput:
    return make_encoder_input(name, num_tokens)


def req(request_id: str, tokens: list[int], encoder: EncoderInput | None = None,
        **kwargs) -> Request:
    return make_scheduler_request(request_id, tokens, block_size=BLOCK_SIZE,
                                  encoder_input=encoder, **kwargs)


def make_manager(num_blocks: int = 16, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching)


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def ref_cnts(manager: KVCacheManager, ids: list[int]) -> list[int]:
    return [manager.block_pool.blocks[i].ref_cnt for i in ids]


def schedule_first(manager: KVCacheManager, request: Request
                   ) -> tuple[list[int], list[int], bool] | None:
    """What the scheduler does for a waiting request: look up self and cross hits,
    allocate, mark the prompt computed. Returns (self block ids, cross block ids, whether
    the cross blocks were a hit), or None when the allocation failed."""
    hits, num_hit = manager.get_computed_blocks(request)
    cross_hits = manager.get_cached_cross_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit, hits, num_hit,
                                 cross_hits)
    if new is None:
        return None
    request.num_computed_tokens = request.num_tokens
    return (manager.get_block_ids(request.request_id),
            manager.get_cross_block_ids(request.request_id), cross_hits is not None)


def cross_ids(manager: KVCacheManager, request: Request) -> list[int] | None:
    blocks = manager.get_cached_cross_blocks(request)
    return None if blocks is None else [b.block_id for b in blocks]


def step(scheduler: Scheduler, sampled: dict[str, list[int]] | None = None
         ) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, make_runner_output(out, sampled))


def new_reqs(out: SchedulerOutput) -> dict[str, tuple[list[int], list[int]]]:
    """req_id -> (self block ids, cross block ids) of the step's new requests."""
    return {r.req_id: (r.block_ids, r.cross_block_ids) for r in out.scheduled_new_reqs}


def sched_free_ids(scheduler: Scheduler) -> list[int]:
    return free_ids(scheduler.kv_cache_manager)


# ---- cross-block allocation (KVCacheManager) ----------------------------------------------


@pytest.mark.parametrize(("encoder_len", "num_cross"), [(1, 1), (4, 1), (5, 2), (8, 2),
                                                        (10, 3)])
def test_cross_blocks_are_taken_before_the_first_decoder_blocks(encoder_len: int,
                                                                num_cross: int) -> None:
    manager = make_manager()
    e = enc("A", encoder_len)
    a = req("a", [10, 11], e)
    assert a.num_encoder_tokens == encoder_len
    assert schedule_first(manager, a) == ([num_cross + 1], list(range(1, num_cross + 1)),
                                          False)
    # |cross| + |self| blocks held; 15 usable blocks in the pool.
    assert manager.block_pool.get_num_free_blocks() == 15 - num_cross - 1
    assert free_ids(manager) == list(range(num_cross + 2, 16))
    assert ref_cnts(manager, list(range(num_cross + 2))) == [0] + [1] * (num_cross + 1)
    assert manager.usage == pytest.approx((num_cross + 1) / 15)
    # The cross blocks are registered under the encoder input's hashes right away.
    assert [manager.block_pool.blocks[i].block_hash for i in range(1, num_cross + 1)] == \
        cross_block_hashes(e.content_hash, num_cross)
    assert cross_ids(manager, a) == list(range(1, num_cross + 1))


def test_decode_grows_self_blocks_only() -> None:
    manager = make_manager()
    a = req("a", [10, 11], enc("A", 10))
    assert schedule_first(manager, a) == ([4], [1, 2, 3], False)
    grown = []
    for token in [12, 13, 14, 15]:  # positions 2, 3, 4, 5
        a.append_output_token_ids([token])
        new = manager.allocate_slots(a, 1)
        assert new is not None
        grown.append([b.block_id for b in new])
        a.num_computed_tokens += 1
    assert grown == [[], [], [5], []]
    assert manager.get_block_ids("a") == [4, 5]
    assert manager.get_cross_block_ids("a") == [1, 2, 3]
    assert manager.block_pool.get_num_free_blocks() == 15 - 5


def test_decoder_only_request_gets_no_cross_blocks() -> None:
    manager = make_manager()
    a = req("a", [10, 11, 12, 13, 14])
    assert manager.get_cached_cross_blocks(a) is None
    assert schedule_first(manager, a) == ([1, 2], [], False)
    assert "a" not in manager.req_to_cross_blocks
    assert manager.get_cross_block_ids("a") == []


# ---- all or nothing -----------------------------------------------------------------------


def test_cross_and_first_decoder_blocks_fit_exactly() -> None:
    manager = make_manager(num_blocks=5)  # 4 usable = 3 cross + 1 self
    a = req("a", [10, 11], enc("A", 10))
    assert schedule_first(manager, a) == ([4], [1, 2, 3], False)
    assert free_ids(manager) == []


@pytest.mark.parametrize(("num_blocks", "prompt_len"), [
    (4, 2),  # 3 usable: the 3 cross blocks fit, the decoder block does not
    (5, 5),  # 4 usable: 3 cross + 2 self needed
])
def test_allocation_failure_takes_neither_cross_nor_self_blocks(num_blocks: int,
                                                                prompt_len: int) -> None:
    manager = make_manager(num_blocks=num_blocks)
    a = req("a", list(range(10, 10 + prompt_len)), enc("A", 10))
    assert manager.allocate_slots(a, prompt_len, [], 0, None) is None
    assert free_ids(manager) == list(range(1, num_blocks))
    assert "a" not in manager.req_to_blocks
    assert "a" not in manager.req_to_cross_blocks
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert manager.get_cached_cross_blocks(a) is None
    assert ref_cnts(manager, list(range(num_blocks))) == [0] * num_blocks


def test_allocation_failure_next_to_a_running_request() -> None:
    manager = make_manager(num_blocks=8)  # 7 usable
    a = req("a", [10, 11], enc("A", 10))
    assert schedule_first(manager, a) == ([4], [1, 2, 3], False)
    b = req("b", [20, 21], enc("B", 10))  # needs 4, 3 free
    assert manager.allocate_slots(b, 2, [], 0, None) is None
    assert free_ids(manager) == [5, 6, 7]
    assert "b" not in manager.req_to_blocks and "b" not in manager.req_to_cross_blocks
    c = req("c", [30, 31], enc("C", 8))  # needs 2 + 1: exactly what is left
    assert schedule_first(manager, c) == ([7], [5, 6], False)
    assert free_ids(manager) == []


def test_cross_hits_in_the_free_queue_are_not_counted_as_allocatable() -> None:
    manager = make_manager(num_blocks=5)  # blocks 1..4
    a = req("a", [10, 11], enc("A", 10))
    assert schedule_first(manager, a) == ([4], [1, 2, 3], False)
    manager.free(a)
    assert free_ids(manager) == [4, 1, 2, 3]
    # b hits a's 3 free cross blocks and needs 2 self blocks: once the hits are taken only
    # block 4 is left, so nothing may change.
    b = req("b", [20, 21, 22, 23, 24], enc("A", 10))
    assert cross_ids(manager, b) == [1, 2, 3]
    assert manager.allocate_slots(b, 5, [], 0, manager.get_cached_cross_blocks(b)) is None
    assert free_ids(manager) == [4, 1, 2, 3]
    assert ref_cnts(manager, [1, 2, 3, 4]) == [0, 0, 0, 0]
    assert "b" not in manager.req_to_blocks and "b" not in manager.req_to_cross_blocks
    assert cross_ids(manager, b) == [1, 2, 3]
    # One self block is fine: exactly block 4.
    c = req("c", [30, 31], enc("A", 10))
    assert schedule_first(manager, c) == ([4], [1, 2, 3], True)
    assert free_ids(manager) == []


# ---- freeing --------------------------------------------------------------------------------


def test_free_returns_self_blocks_tail_first_then_cross_blocks() -> None:
    manager = make_manager()
    a = req("a", list(range(10, 19)), enc("A", 10))  # 9 decoder tokens: 3 self blocks
    assert schedule_first(manager, a) == ([4, 5, 6], [1, 2, 3], False)
    manager.free(a)
    assert free_ids(manager) == [7, 8, 9, 10, 11, 12, 13, 14, 15, 6, 5, 4, 1, 2, 3]
    assert "a" not in manager.req_to_blocks and "a" not in manager.req_to_cross_blocks
    assert manager.get_block_ids("a") == [] and manager.get_cross_block_ids("a") == []
    assert ref_cnts(manager, [1, 2, 3, 4, 5, 6]) == [0] * 6
    # Freed, still cached: the same encoder input finds them until they are evicted.
    assert cross_ids(manager, req("x", [1], enc("A", 10))) == [1, 2, 3]


# ---- sharing and eviction (KVCacheManager) --------------------------------------------------


def test_same_encoder_input_shares_cross_blocks_and_other_inputs_do_not() -> None:
    manager = make_manager()
    a = req("a", [10, 11], enc("A", 10))
    b = req("b", [20, 21], enc("A", 10))
    c = req("c", [30, 31], enc("C", 10))
    assert schedule_first(manager, a) == ([4], [1, 2, 3], False)
    assert schedule_first(manager, b) == ([5], [1, 2, 3], True)
    assert schedule_first(manager, c) == ([9], [6, 7, 8], False)
    assert ref_cnts(manager, list(range(1, 10))) == [2, 2, 2, 1, 1, 1, 1, 1, 1]
    # 1 + 1 self blocks, 3 shared cross blocks and c's 4 blocks.
    assert manager.block_pool.get_num_free_blocks() == 15 - 9
    manager.free(a)
    assert ref_cnts(manager, [1, 2, 3, 4]) == [1, 1, 1, 0]
    assert free_ids(manager) == [10, 11, 12, 13, 14, 15, 4]
    manager.free(b)
    manager.free(c)
    assert free_ids(manager) == [10, 11, 12, 13, 14, 15, 4, 5, 1, 2, 3, 9, 6, 7, 8]
    # A third identical request finds them again, pulling them out of the free queue.
    d = req("d", [40, 41], enc("A", 10))
    assert schedule_first(manager, d) == ([10], [1, 2, 3], True)
    assert free_ids(manager) == [11, 12, 13, 14, 15, 4, 5, 9, 6, 7, 8]
    assert ref_cnts(manager, [1, 2, 3]) == [1, 1, 1]


def test_a_partly_evicted_encoder_output_is_a_miss() -> None:
    manager = make_manager(num_blocks=9)  # blocks 1..8
    a = req("a", [10, 11], enc("A", 10))
    assert schedule_first(manager, a) == ([4], [1, 2, 3], False)
    manager.free(a)
    assert free_ids(manager) == [5, 6, 7, 8, 4, 1, 2, 3]
    hashes_a = cross_block_hashes(enc("A", 10).content_hash, 3)
    # b takes 6 blocks: the never-used 5..8, a's self block 4 and a's first cross block.
    b = req("b", list(range(20, 29)), enc("B", 10))
    assert schedule_first(manager, b) == ([8, 4, 1], [5, 6, 7], False)
    pool = manager.block_pool
    assert pool.get_cached_block(hashes_a[0]) is None
    assert [pool.get_cached_block(h).block_id for h in hashes_a[1:]] == [2, 3]
    again = req("again", [10, 11], enc("A", 10))
    assert manager.get_cached_cross_blocks(again) is None
    # A miss allocates new cross blocks (evicting the rest of a's) and registers them.
    manager.free(b)
    assert free_ids(manager) == [2, 3, 1, 4, 8, 5, 6, 7]
    assert schedule_first(manager, again) == ([4], [2, 3, 1], False)
    assert [pool.get_cached_block(h).block_id for h in hashes_a] == [2, 3, 1]


def test_without_prefix_caching_nothing_is_shared_or_registered() -> None:
    manager = make_manager(enable_caching=False)
    a = req("a", [10, 11], enc("A", 10))
    b = req("b", [20, 21], enc("A", 10))
    assert manager.get_cached_cross_blocks(a) is None
    assert schedule_first(manager, a) == ([4], [1, 2, 3], False)
    assert manager.get_cached_cross_blocks(b) is None
    assert schedule_first(manager, b) == ([8], [5, 6, 7], False)
    assert manager.block_pool.cached_block_hash_to_block == {}
    manager.free(a)
    assert manager.get_cached_cross_blocks(req("c", [1], enc("A", 10))) is None


# ---- block hashes -----------------------------------------------------------------------


def test_decoder_block_hashes_chain_from_the_encoder_hash() -> None:
    tokens = list(range(10, 19))  # 2 full blocks
    ea, eb = enc("A", 10), enc("B", 10)
    a = req("a", tokens, ea)
    b = req("b", tokens, eb)
    plain = req("p", tokens)
    assert a.block_hashes == [hash_block(ea.content_hash, tokens[:4]),
                              hash_block(hash_block(ea.content_hash, tokens[:4]),
                                         tokens[4:8])]
    assert b.block_hashes[0] == hash_block(eb.content_hash, tokens[:4])
    assert a.block_hashes[0] != b.block_hashes[0]
    assert a.block_hashes[1] != b.block_hashes[1]
    # Decoder-only requests are unchanged: the chain starts from no parent.
    assert plain.block_hashes == [hash_block(None, tokens[:4]),
                                  hash_block(hash_block(None, tokens[:4]), tokens[4:8])]
    assert not set(plain.block_hashes) & (set(a.block_hashes) | set(b.block_hashes))
    # Generated tokens continue the same chain.
    a.append_output_token_ids([19, 20, 21])
    assert len(a.block_hashes) == 3
    assert a.block_hashes[2] == hash_block(a.block_hashes[1], [18, 19, 20, 21])


def test_cross_block_hashes_are_per_input_and_index_and_apart_from_self_hashes() -> None:
    ea, eb = enc("A", 12), enc("B", 12)
    ha = cross_block_hashes(ea.content_hash, 3)
    assert len(set(ha)) == 3
    assert cross_block_hashes(ea.content_hash, 2) == ha[:2]
    assert cross_block_hashes(ea.content_hash, 0) == []
    assert not set(ha) & set(cross_block_hashes(eb.content_hash, 3))
    a = req("a", list(range(10, 22)), ea)  # 3 full decoder blocks over the same input
    assert len(a.block_hashes) == 3
    assert not set(ha) & set(a.block_hashes)
    assert ea.content_hash not in ha


def test_same_decoder_prompt_hits_only_over_the_same_encoder_input() -> None:
    manager = make_manager()
    tokens = list(range(10, 19))
    a = req("a", tokens, enc("A", 10))
    assert schedule_first(manager, a) == ([4, 5, 6], [1, 2, 3], False)
    same = req("same", tokens, enc("A", 10))
    hits, num_hit = manager.get_computed_blocks(same)
    assert ([b.block_id for b in hits], num_hit) == ([4, 5], 8)
    other = req("other", tokens, enc("B", 10))
    assert manager.get_computed_blocks(other) == ([], 0)
    assert manager.get_computed_blocks(req("plain", tokens)) == ([], 0)


# ---- the scheduler: encoder runs and NewRequestData -----------------------------------------


def test_first_schedule_runs_the_encoder_and_sends_cross_blocks() -> None:
    s = make_scheduler(num_blocks=16)
    ea = enc("A", 10)
    s.add_request(make_request("a", [10, 11], encoder_input=ea))
    s.add_request(make_request("p", [20, 21, 22, 23]))  # decoder-only, same step
    out, _ = step(s, {"a": [12], "p": [24]})
    assert out.num_scheduled_tokens == {"a": 2, "p": 4}
    assert out.total_num_scheduled_tokens == 6  # encoder rows are not decoder tokens
    assert out.scheduled_encoder_inputs == ["a"]
    assert new_reqs(out) == {"a": ([4], [1, 2, 3]), "p": ([5], [])}
    new_a, new_p = out.scheduled_new_reqs
    assert new_a.encoder_input is ea
    assert new_a.prompt_token_ids == [10, 11]
    assert new_p.encoder_input is None
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 15 - 5
    # Later steps send deltas only and never run the encoder again.
    deltas = []
    for t in range(3):
        out, _ = step(s, {"a": [13 + t], "p": [25 + t]})
        assert out.scheduled_new_reqs == [] and out.scheduled_encoder_inputs == []
        deltas.append(cached(out))
    assert deltas == [[("a", [], 2), ("p", [6], 4)],
                      [("a", [], 3), ("p", [], 5)],
                      [("a", [7], 4), ("p", [], 6)]]
    assert s.kv_cache_manager.get_block_ids("a") == [4, 7]
    assert s.kv_cache_manager.get_cross_block_ids("a") == [1, 2, 3]


def test_same_encoder_input_in_one_step_runs_the_encoder_once() -> None:
    s = make_scheduler(num_blocks=16)
    s.add_request(make_request("a", [10, 11], encoder_input=enc("A", 10), max_tokens=1))
    s.add_request(make_request("b", [20, 21], encoder_input=enc("A", 10), max_tokens=1))
    s.add_request(make_request("c", [30, 31], encoder_input=enc("C", 10), max_tokens=1))
    out, result = step(s, {"a": [12], "b": [22], "c": [32]})
    assert out.scheduled_encoder_inputs == ["a", "c"]
    assert new_reqs(out) == {"a": ([4], [1, 2, 3]), "b": ([5], [1, 2, 3]),
                             "c": ([9], [6, 7, 8])}
    assert [o.finish_reason is not None for o in result.outputs] == [True, True, True]
    # All three finished (a, b, c freed in that order); the cross blocks stay cached.
    assert sched_free_ids(s) == [10, 11, 12, 13, 14, 15, 4, 5, 1, 2, 3, 9, 6, 7, 8]
    s.add_request(make_request("d", [40, 41], encoder_input=enc("A", 10)))
    out, _ = step(s, {"d": [42]})
    assert out.finished_req_ids == ["a", "b", "c"]
    assert out.scheduled_encoder_inputs == []
    assert new_reqs(out) == {"d": ([10], [1, 2, 3])}
    assert sched_free_ids(s) == [11, 12, 13, 14, 15, 4, 5, 9, 6, 7, 8]


def test_evicted_encoder_output_runs_the_encoder_again() -> None:
    s = make_scheduler(num_blocks=9)  # blocks 1..8
    s.add_request(make_request("a", [10, 11], encoder_input=enc("A", 10), max_tokens=1))
    out, _ = step(s, {"a": [12]})
    assert out.scheduled_encoder_inputs == ["a"]
    assert new_reqs(out) == {"a": ([4], [1, 2, 3])}
    assert sched_free_ids(s) == [5, 6, 7, 8, 4, 1, 2, 3]
    # b's 6 blocks evict a's first cross block: a's encoder output is no longer whole.
    s.add_request(make_request("b", list(range(20, 29)), encoder_input=enc("B", 10),
                               max_tokens=1))
    out, _ = step(s, {"b": [29]})
    assert out.scheduled_encoder_inputs == ["b"]
    assert new_reqs(out) == {"b": ([8, 4, 1], [5, 6, 7])}
    assert sched_free_ids(s) == [2, 3, 1, 4, 8, 5, 6, 7]
    s.add_request(make_request("c", [10, 11], encoder_input=enc("A", 10)))
    out, _ = step(s, {"c": [12]})
    assert out.scheduled_encoder_inputs == ["c"]
    assert new_reqs(out) == {"c": ([4], [2, 3, 1])}


def test_abort_frees_cross_blocks_of_running_and_waiting_requests() -> None:
    s = make_scheduler(num_blocks=16, max_num_seqs=1)
    s.add_request(make_request("a", list(range(10, 19)), encoder_input=enc("A", 10)))
    s.add_request(make_request("w", [20, 21], encoder_input=enc("W", 10)))
    out, _ = step(s, {"a": [19]})
    assert new_reqs(out) == {"a": ([4, 5, 6], [1, 2, 3])}
    assert [r.request_id for r in s.waiting] == ["w"]
    s.finish_requests(["a", "w"], RequestStatus.FINISHED_ABORTED)
    kv = s.kv_cache_manager
    assert sched_free_ids(s) == [7, 8, 9, 10, 11, 12, 13, 14, 15, 6, 5, 4, 1, 2, 3]
    assert kv.req_to_blocks == {} and kv.req_to_cross_blocks == {}
    assert s.schedule().finished_req_ids == ["a", "w"]


def test_finish_on_eos_frees_cross_blocks() -> None:
    s = make_scheduler(num_blocks=16)
    s.add_request(make_request("a", [10, 11], encoder_input=enc("A", 10)))
    step(s, {"a": [12]})
    _, result = step(s, {"a": [2]})  # EOS
    assert result.outputs[0].finish_reason is not None
    assert sched_free_ids(s) == [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 4, 1, 2, 3]
    assert s.kv_cache_manager.req_to_cross_blocks == {}


# ---- the scheduler: preemption ---------------------------------------------------------


def preemption_setup(enable_prefix_caching: bool) -> Scheduler:
    """6 usable blocks; a and b take 1 cross + 2 self blocks each; a's 9th token (step 3)
    preempts b."""
    s = make_scheduler(num_blocks=7, enable_prefix_caching=enable_prefix_caching)
    s.add_request(make_request("a", list(range(10, 17)), encoder_input=enc("A", 4),
                               max_tokens=4))
    s.add_request(make_request("b", list(range(20, 27)), encoder_input=enc("B", 4)))
    out, _ = step(s, {"a": [100], "b": [200]})
    assert out.scheduled_encoder_inputs == ["a", "b"]
    assert new_reqs(out) == {"a": ([2, 3], [1]), "b": ([5, 6], [4])}
    out, _ = step(s, {"a": [101], "b": [201]})
    assert cached(out) == [("a", [], 7), ("b", [], 7)]
    out, _ = step(s, {"a": [102]})
    assert out.preempted_req_ids == ["b"]
    # b gave back its self blocks tail first, then its cross block; a took block 6.
    assert cached(out) == [("a", [6], 8)]
    assert sched_free_ids(s) == [5, 4]
    assert s.kv_cache_manager.get_cross_block_ids("b") == []
    assert s.requests["b"].status == RequestStatus.PREEMPTED
    # b (9 tokens) cannot come back before a finishes in this step.
    out, result = step(s, {"a": [103]})
    assert out.num_scheduled_tokens == {"a": 1}
    assert result.outputs[0].finish_reason is not None
    return s


def test_preempted_request_resumes_with_a_cross_hit() -> None:
    s = preemption_setup(enable_prefix_caching=True)
    # a freed self [6, 3, 2] tail first, then its cross block 1.
    assert sched_free_ids(s) == [5, 4, 6, 3, 2, 1]
    out, _ = step(s, {"b": [202]})
    # b hits its own first self block (5) and its cross block (4): no encoder run.
    assert out.scheduled_encoder_inputs == []
    [new] = out.scheduled_new_reqs
    assert (new.req_id, new.block_ids, new.cross_block_ids) == ("b", [5, 6, 3], [4])
    assert new.num_computed_tokens == 4
    assert new.encoder_input is s.requests["b"].encoder_input
    assert out.num_scheduled_tokens == {"b": 5}


def test_preempted_request_reruns_its_encoder_without_prefix_caching() -> None:
    s = preemption_setup(enable_prefix_caching=False)
    assert sched_free_ids(s) == [5, 4, 6, 3, 2, 1]
    out, _ = step(s, {"b": [202]})
    assert out.scheduled_encoder_inputs == ["b"]
    [new] = out.scheduled_new_reqs
    assert (new.req_id, new.block_ids, new.cross_block_ids) == ("b", [4, 6, 3], [5])
    assert new.num_computed_tokens == 0
    assert out.num_scheduled_tokens == {"b": 9}


def test_without_prefix_caching_every_request_runs_its_encoder() -> None:
    s = make_scheduler(num_blocks=16, enable_prefix_caching=False)
    s.add_request(make_request("a", [10, 11], encoder_input=enc("A", 10)))
    s.add_request(make_request("b", [20, 21], encoder_input=enc("A", 10)))
    out, _ = step(s)
    assert out.scheduled_encoder_inputs == ["a", "b"]
    assert new_reqs(out) == {"a": ([4], [1, 2, 3]), "b": ([8], [5, 6, 7])}


# ---- the scheduler: encoder budget ---------------------------------------------------------


def test_encoder_budget_admits_one_input_per_step_fifo() -> None:
    s = make_scheduler(num_blocks=32, max_num_encoder_input_tokens=16)
    for name in "abc":
        s.add_request(make_request(name, [10, 11], encoder_input=enc(name, 10)))
    out, _ = step(s, {"a": [12]})
    # 6 encoder tokens are left after a's 10: b's input is never split, so b and c wait
    # although 62 decoder tokens of budget remain.
    assert out.num_scheduled_tokens == {"a": 2}
    assert out.scheduled_encoder_inputs == ["a"]
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    assert s.kv_cache_manager.req_to_cross_blocks.keys() == {"a"}
    out, _ = step(s, {"a": [13], "b": [22]})
    assert out.num_scheduled_tokens == {"a": 1, "b": 2}
    assert out.scheduled_encoder_inputs == ["b"]
    assert new_reqs(out) == {"b": ([8], [5, 6, 7])}
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 2}
    assert out.scheduled_encoder_inputs == ["c"]
    assert list(s.waiting) == []


def test_encoder_input_as_long_as_the_budget_runs_alone() -> None:
    s = make_scheduler(num_blocks=32, max_num_encoder_input_tokens=10)
    s.add_request(make_request("a", [10, 11], encoder_input=enc("A", 10)))
    s.add_request(make_request("b", [20, 21], encoder_input=enc("B", 1)))
    out, _ = step(s)
    assert out.scheduled_encoder_inputs == ["a"]
    assert out.num_scheduled_tokens == {"a": 2}
    out, _ = step(s)
    assert out.scheduled_encoder_inputs == ["b"]


def test_a_cross_hit_costs_no_encoder_budget_but_fifo_holds() -> None:
    s = make_scheduler(num_blocks=32, max_num_encoder_input_tokens=16)
    s.add_request(make_request("a", [10, 11], encoder_input=enc("A", 10)))
    s.add_request(make_request("b", [20, 21], encoder_input=enc("A", 10)))  # hits a's
    s.add_request(make_request("c", [30, 31], encoder_input=enc("C", 10)))  # 10 > 6 left
    s.add_request(make_request("d", [40, 41], encoder_input=enc("A", 10)))  # behind c
    out, _ = step(s, {"a": [12], "b": [22]})
    assert out.num_scheduled_tokens == {"a": 2, "b": 2}
    assert out.scheduled_encoder_inputs == ["a"]
    assert new_reqs(out) == {"a": ([4], [1, 2, 3]), "b": ([5], [1, 2, 3])}
    assert [r.request_id for r in s.waiting] == ["c", "d"]
    out, _ = step(s, {"a": [12], "b": [22]})
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 2, "d": 2}
    assert out.scheduled_encoder_inputs == ["c"]
    assert new_reqs(out) == {"c": ([9], [6, 7, 8]), "d": ([10], [1, 2, 3])}


# ---- cross slot mapping --------------------------------------------------------------------


def test_cross_slot_mapping_docstring_example() -> None:
    slots = compute_cross_slot_mapping([[7, 2], [5]], [6, 3], block_size=4)
    assert slots.tolist() == [28, 29, 30, 31, 8, 9, 20, 21, 22]
    assert slots.dtype == np.int64


def test_cross_slot_mapping_full_blocks_and_a_partial_last_block() -> None:
    slots = compute_cross_slot_mapping([[9], [4, 1, 6]], [4, 9], block_size=4)
    assert slots.tolist() == [36, 37, 38, 39, 16, 17, 18, 19, 4, 5, 6, 7, 24]
    slots = compute_cross_slot_mapping([[3, 11]], [3], block_size=2)  # unused 2nd block
    assert slots.tolist() == [6, 7, 22]


# ---- EncoderRunner ------------------------------------------------------------------------


class StubCrossLayer(torch.nn.Module):
    """K = (layer + 1) * encoder row, V = -K, as [n, 2 heads, 4]."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.scale = float(layer_idx + 1)
        self.attn = Attention(TorchSDPABackend, layer_idx, 2, 4, 2, 0.5,
                              AttentionType.ENCODER_DECODER)

    def project_kv(self, encoder_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = (encoder_out * self.scale).view(-1, 2, 4)
        return k, -k


class StubEncDecModel(torch.nn.Module):
    """`encode` turns row i of an input into 8 copies of 1000 * (first hash byte) + token i
    and records its inputs and the encoder attention metadata it ran under."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = [StubCrossLayer(0), StubCrossLayer(1)]
        self.calls: list[tuple[list[EncoderInput], EncoderAttentionMetadata]] = []

    def encode(self, inputs: list[EncoderInput]) -> torch.Tensor:
        self.calls.append((inputs, get_forward_context().encoder_attn_metadata))
        return torch.cat([encoder_rows(item) for item in inputs])

    def cross_attention_layers(self) -> list[StubCrossLayer]:
        return self.layers


def encoder_rows(item: EncoderInput) -> torch.Tensor:
    values = torch.tensor([1000.0 * item.content_hash[0] + t for t in item.token_ids])
    return values[:, None].expand(-1, 8).clone()


def test_encoder_runner_writes_exactly_the_scheduled_inputs_into_their_cross_slots() -> None:
    s = make_scheduler(num_blocks=16)
    ea, ec = enc("A", 6), enc("C", 3)
    s.add_request(make_request("a", [10, 11], encoder_input=ea))
    s.add_request(make_request("b", [20, 21], encoder_input=enc("A", 6)))  # hits a's
    s.add_request(make_request("c", [30, 31], encoder_input=ec))
    s.add_request(make_request("p", [40, 41]))  # decoder-only
    out = s.schedule()
    assert out.scheduled_encoder_inputs == ["a", "c"]
    assert new_reqs(out) == {"a": ([3], [1, 2]), "b": ([4], [1, 2]), "c": ([6], [5]),
                             "p": ([7], [])}
    model = StubEncDecModel()
    runner = EncoderRunner(model, BLOCK_SIZE, torch.device("cpu"))
    kv_caches = [torch.zeros(2, 16, BLOCK_SIZE, 2, 4) for _ in range(2)]
    runner.run(out, kv_caches)
    [(inputs, metadata)] = model.calls
    assert inputs == [ea, ec]
    assert (metadata.query_start_loc, metadata.uniform_len) == ([0, 6, 9], None)
    assert runner.num_inputs_encoded == 2
    slots = [4, 5, 6, 7, 8, 9, 20, 21, 22]  # blocks [1, 2] and [5]
    rows = torch.cat([encoder_rows(ea), encoder_rows(ec)]).view(-1, 2, 4)
    for layer, cache in enumerate(kv_caches):
        flat_k = cache[0].view(-1, 2, 4)
        flat_v = cache[1].view(-1, 2, 4)
        assert torch.equal(flat_k[slots], rows * (layer + 1))
        assert torch.equal(flat_v[slots], -rows * (layer + 1))
        others = [i for i in range(16 * BLOCK_SIZE) if i not in slots]
        assert not flat_k[others].any() and not flat_v[others].any()
    # A step without encoder inputs runs nothing.
    s.update_from_output(out, make_runner_output(out, {"a": [12], "b": [22], "c": [32],
                                                       "p": [42]}))
    out = s.schedule()
    assert out.scheduled_encoder_inputs == []
    runner.run(out, kv_caches)
    assert len(model.calls) == 1 and runner.num_inputs_encoded == 2


# ---- InputBatch cross tables ---------------------------------------------------------------


def enc_state(req_id: str, i: int, cross: list[int], num_encoder_tokens: int
              ) -> CachedRequestState:
    return CachedRequestState(req_id=req_id, prompt_token_ids=[10 * i, 10 * i + 1],
                              prompt_embeds=None, sampling_params=make_params(),
                              generator=None, block_ids=[20 + i], num_computed_tokens=2,
                              cross_block_ids=list(cross),
                              num_encoder_tokens=num_encoder_tokens)


def cross_rows(batch: InputBatch) -> list[list[int]]:
    t = batch.cross_block_table
    return [t.table[r, :t.num_blocks_per_row[r]].tolist() for r in range(batch.num_reqs)]


def test_input_batch_cross_rows_follow_condense() -> None:
    batch = InputBatch(6, max_model_len=16, block_size=4, vocab_size=50, max_encoder_len=12)
    assert batch.cross_block_table.table.shape == (6, 3)
    specs = {"a": ([1, 2, 3], 10), "b": ([4], 2), "c": ([5, 6], 7), "d": ([7], 4),
             "e": ([8, 9, 10], 12)}
    for i, (req_id, (cross, n)) in enumerate(specs.items()):
        assert batch.add_request(enc_state(req_id, i, cross, n)) == i
    assert cross_rows(batch) == [[1, 2, 3], [4], [5, 6], [7], [8, 9, 10]]
    assert batch.num_encoder_tokens[:5].tolist() == [10, 2, 7, 4, 12]
    assert batch.cross_block_table.table[2].tolist() == [5, 6, 0]
    batch.remove_request("b")
    batch.remove_request("d")
    # Removal clears the cross row as well as the self row.
    assert batch.cross_block_table.table[1].tolist() == [0, 0, 0]
    assert batch.cross_block_table.num_blocks_per_row[3] == 0
    batch.condense()
    assert batch.req_ids_in_order == ["a", "e", "c"]
    assert cross_rows(batch) == [[1, 2, 3], [8, 9, 10], [5, 6]]
    assert batch.num_encoder_tokens[:3].tolist() == [10, 12, 7]
    assert batch.block_table.table[:3, 0].tolist() == [20, 24, 22]
    # The moved row's source is cleared.
    assert batch.cross_block_table.table[4].tolist() == [0, 0, 0]
    assert batch.cross_block_table.num_blocks_per_row[4] == 0
    # A new request takes the next row with its own cross blocks.
    assert batch.add_request(enc_state("f", 5, [11], 3)) == 3
    assert cross_rows(batch) == [[1, 2, 3], [8, 9, 10], [5, 6], [11]]
    assert batch.num_encoder_tokens[:4].tolist() == [10, 12, 7, 3]


# ---- the runner's cross tables and cross metadata, driven by the scheduler -----------------


class RecordingBackend:
    """Metadata = (the `CommonAttentionMetadata`, causal), to read what the runner built."""

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata, block_size: int,
                       device: torch.device, causal: bool = True):
        return common, causal


def make_encdec_runner(max_encoder_len: int = 12) -> ModelRunner:
    hf_config = SimpleNamespace(is_encoder_decoder=True, vocab_size=100, d_model=8,
                                hidden_size=8, decoder_attention_heads=2, decoder_layers=1,
                                max_source_positions=max_encoder_len)
    model_config = ModelConfig(model="unused", tokenizer="unused", hf_config=hf_config,
                               dtype=torch.float32, max_model_len=32)
    config = VllmConfig(model_config=model_config,
                        cache_config=CacheConfig(block_size=BLOCK_SIZE),
                        scheduler_config=SchedulerConfig(max_num_seqs=4, max_model_len=32))
    runner = ModelRunner(config, torch.device("cpu"))
    runner.attn_backend = RecordingBackend
    return runner


def runner_step(runner: ModelRunner, out: SchedulerOutput, tokens: list[int]):
    runner._update_states(out)
    inputs = runner._prepare_inputs(out)
    sampled = torch.tensor(tokens[:len(inputs.sampling_rows)], dtype=torch.int64)
    runner._bookkeep(inputs.sampling_rows, SamplerOutput(sampled, None))
    return inputs


def test_runner_cross_tables_and_cross_metadata_follow_the_scheduler() -> None:
    s = make_scheduler(num_blocks=32, max_model_len=32)
    runner = make_encdec_runner()
    s.add_request(make_request("a", [10, 11], encoder_input=enc("A", 10), max_tokens=1))
    s.add_request(make_request("b", [20, 21, 22, 23, 24], encoder_input=enc("B", 5)))
    s.add_request(make_request("c", [30], encoder_input=enc("A", 10)))
    out = s.schedule()
    assert out.scheduled_encoder_inputs == ["a", "b"]
    assert new_reqs(out) == {"a": ([4], [1, 2, 3]), "b": ([7, 8], [5, 6]),
                             "c": ([9], [1, 2, 3])}
    inputs = runner_step(runner, out, [12, 25, 31])
    s.update_from_output(out, make_runner_output(out, {"a": [12], "b": [25], "c": [31]}))
    batch = runner.input_batch
    assert cross_rows(batch) == [[1, 2, 3], [5, 6], [1, 2, 3]]
    assert batch.num_encoder_tokens[:3].tolist() == [10, 5, 10]
    self_common, self_causal = inputs.attn_metadata
    cross_common, cross_causal = inputs.cross_attn_metadata
    assert (self_causal, cross_causal) == (True, False)
    assert cross_common.query_start_loc.tolist() == [0, 2, 7, 8]
    assert cross_common.seq_lens.tolist() == [10, 5, 10]
    assert cross_common.num_computed_tokens.tolist() == [0, 0, 0]
    assert cross_common.block_table.tolist() == [[1, 2, 3], [5, 6, 0], [1, 2, 3]]
    assert cross_common.slot_mapping.tolist() == []
    assert cross_common.num_actual_tokens == 8
    assert self_common.seq_lens.tolist() == [2, 5, 1]

    # a finished (max_tokens=1); c moves into its row, with its cross blocks.
    out = s.schedule()
    assert out.finished_req_ids == ["a"]
    inputs = runner_step(runner, out, [26, 32])
    assert batch.req_ids_in_order == ["c", "b"]
    assert cross_rows(batch) == [[1, 2, 3], [5, 6]]
    assert batch.num_encoder_tokens[:2].tolist() == [10, 5]
    cross_common, _ = inputs.cross_attn_metadata
    assert cross_common.query_start_loc.tolist() == [0, 1, 2]
    assert cross_common.seq_lens.tolist() == [10, 5]
    assert cross_common.block_table.tolist() == [[1, 2, 3], [5, 6, 0]]


# ---- attention: ENCODER_DECODER (cross) and ENCODER against dense references -------------

HEADS, KV_HEADS, HEAD_SIZE, NUM_BLOCKS = 6, 2, 16, 64


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Unmasked attention: q [n, heads, d] over every row of k/v [m, kv_heads, d]."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("plan", [
    [(1, 7), (5, 10)],  # one decode row, one multi-token prefill row
    [(1, 7), (5, 10), (1, 3), (3, 4)],  # mixed, two of each
    [(1, 9), (1, 4)],  # decode only
    [(6, 5), (2, 12)],  # prefill only
], ids=["mixed", "mixed4", "decode", "prefill"])
def test_cross_attention_matches_dense_reference(plan, native, dtype, monkeypatch) -> None:
    """plan: (decoder query tokens this step, encoder length) per request."""
    if not native:
        monkeypatch.setattr(torch_sdpa, "_native_ops", lambda device: None)
    elif torch_sdpa._native_ops(torch.device("cpu")) is None:
        pytest.skip("no compiler for the native kernel")
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_SIZE**-0.5
    # Garbage everywhere: a read past an encoder length or into a wrong block shows.
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE,
                           generator=gen).to(dtype)
    free = list(np.random.default_rng(1).permutation(np.arange(1, NUM_BLOCKS)))
    max_blocks = 4
    block_table = np.zeros((len(plan), max_blocks), dtype=np.int32)
    cross = []
    for i, (_, enc_len) in enumerate(plan):
        ids = [int(free.pop()) for _ in range(-(-enc_len // BLOCK_SIZE))]
        block_table[i, :len(ids)] = ids
        cross.append(ids)
    enc_lens = [e for _, e in plan]
    keys = torch.randn(sum(enc_lens), KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    values = torch.randn(sum(enc_lens), KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    impl = TorchSDPABackend.make_impl(HEADS, HEAD_SIZE, KV_HEADS, scale,
                                      AttentionType.ENCODER_DECODER)
    slots = torch.from_numpy(compute_cross_slot_mapping(cross, enc_lens, BLOCK_SIZE))
    impl.write_kv(keys, values, kv_cache, slots)
    q_lens = [n for n, _ in plan]
    q = torch.randn(sum(q_lens), HEADS, HEAD_SIZE, generator=gen).to(dtype)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    common = CommonAttentionMetadata(qsl, np.array(enc_lens, dtype=np.int32),
                                     np.zeros(len(plan), dtype=np.int32), block_table,
                                     np.zeros(0, dtype=np.int64), int(qsl[-1]))
    metadata = TorchSDPABackend.build_metadata(common, BLOCK_SIZE, torch.device("cpu"),
                                               causal=False)
    before = kv_cache.clone()
    out = impl.forward(q, None, None, kv_cache, metadata)
    assert out.shape == (sum(q_lens), HEADS * HEAD_SIZE)
    assert torch.equal(kv_cache, before)  # cross attention only reads the cache
    out = out.view(-1, HEADS, HEAD_SIZE)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    enc_starts = np.concatenate([[0], np.cumsum(enc_lens)])
    for i in range(len(plan)):
        k = keys[enc_starts[i]:enc_starts[i + 1]]
        v = values[enc_starts[i]:enc_starts[i + 1]]
        expected = dense(q[qsl[i]:qsl[i + 1]], k, v, scale)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].double(), expected, atol=tol,
                                   rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lens", "uniform"), [
    ([5, 9], None),  # one call per input
    ([3, 1, 6], None),
    ([6, 6], 6),  # batched
    ([4, 4, 4], 4),
    ([7], 7),
])
def test_encoder_attention_matches_dense_reference_per_input(lens, uniform, dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    scale = HEAD_SIZE**-0.5
    n = sum(lens)
    q = torch.randn(n, HEADS, HEAD_SIZE, generator=gen).to(dtype)
    k = torch.randn(n, KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    v = torch.randn(n, KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    metadata = EncoderAttentionMetadata.from_lens(lens)
    assert metadata.query_start_loc == np.concatenate([[0], np.cumsum(lens)]).tolist()
    assert metadata.uniform_len == uniform
    impl = TorchSDPABackend.make_impl(HEADS, HEAD_SIZE, KV_HEADS, scale,
                                      AttentionType.ENCODER)
    out = impl.forward(q, k, v, None, metadata)
    assert out.shape == (n, HEADS * HEAD_SIZE)
    out = out.view(n, HEADS, HEAD_SIZE)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    starts = metadata.query_start_loc
    for start, end in zip(starts[:-1], starts[1:], strict=True):
        expected = dense(q[start:end], k[start:end], v[start:end], scale)
        torch.testing.assert_close(out[start:end].double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("lens", [[5, 9], [6, 6]], ids=["per-input", "batched"])
def test_encoder_attention_on_strided_fused_projection_views(lens) -> None:
    """q/k/v as the models make them: `qkv.view(n, 3, heads, d).unbind(1)` (not
    contiguous), heads == kv heads."""
    gen = torch.Generator().manual_seed(3)
    n, scale = sum(lens), HEAD_SIZE**-0.5
    q, k, v = torch.randn(n, 3 * HEADS * HEAD_SIZE, generator=gen).view(
        n, 3, HEADS, HEAD_SIZE).unbind(1)
    assert not q.is_contiguous()
    impl = TorchSDPABackend.make_impl(HEADS, HEAD_SIZE, HEADS, scale, AttentionType.ENCODER)
    metadata = EncoderAttentionMetadata.from_lens(lens)
    out = impl.forward(q, k, v, None, metadata).view(n, HEADS, HEAD_SIZE)
    starts = metadata.query_start_loc
    for start, end in zip(starts[:-1], starts[1:], strict=True):
        expected = dense(q[start:end], k[start:end], v[start:end], scale)
        torch.testing.assert_close(out[start:end].double(), expected, atol=1e-5, rtol=1e-5)


# ---- scheduler + runner simulation -----------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("caching", [True, False])
def test_simulated_run_keeps_cross_and_self_kv_contents_consistent(seed: int,
                                                                   caching: bool) -> None:
    """Random arrivals over a few shared encoder inputs, aborts and preemptions on a small
    pool. A stand-in cache records per slot what was written there: the encoder pass
    writes (input, row) into the cross slots of the step's `scheduled_encoder_inputs`, the
    decoder (input, its tokens so far) into self slots. Every step, every scheduled
    request must find its whole encoder output in its cross blocks and its own KV in its
    self blocks; ref counts must equal the number of holders; the encoder budget holds."""
    rng = random.Random(seed)
    max_model_len, budget = 32, 12
    s = make_scheduler(num_blocks=12, max_model_len=max_model_len,
                       max_num_batched_tokens=10, max_num_seqs=4,
                       enable_prefix_caching=caching, max_num_encoder_input_tokens=budget)
    runner = make_encdec_runner(max_encoder_len=12)
    inputs_by_name = {name: enc(name, n) for name, n in [("A", 12), ("B", 5), ("C", 1),
                                                          ("D", 8)]}
    names = {e.content_hash: name for name, e in inputs_by_name.items()}
    kv: dict[int, tuple] = {}
    num_encoder_runs = 0
    for step_no in range(300):
        if step_no < 80 and rng.random() < 0.4:
            name = rng.choice(list(inputs_by_name))
            prompt = [rng.randint(3, 9) for _ in range(rng.randint(1, 6))]
            s.add_request(make_request(f"r{step_no}", prompt, ignore_eos=True,
                                       encoder_input=inputs_by_name[name],
                                       max_tokens=rng.randint(1, 16)))
        if step_no < 80 and rng.random() < 0.05 and s.requests:
            s.finish_requests([rng.choice(list(s.requests))], RequestStatus.FINISHED_ABORTED)
        if not s.has_requests():
            continue
        out = s.schedule()
        kvm = s.kv_cache_manager
        # Ref counts = holders; every running request holds cdiv(n, 4) cross blocks.
        holders = [0] * 12
        for blocks in (*kvm.req_to_blocks.values(), *kvm.req_to_cross_blocks.values()):
            for b in blocks:
                holders[b.block_id] += 1
        assert [b.ref_cnt for b in kvm.block_pool.blocks] == holders
        for request in s.running:
            assert len(kvm.get_cross_block_ids(request.request_id)) == \
                -(-request.num_encoder_tokens // BLOCK_SIZE)
        new_ids = [r.req_id for r in out.scheduled_new_reqs]
        assert set(out.scheduled_encoder_inputs) <= set(new_ids)
        assert sum(s.requests[r].num_encoder_tokens for r in out.scheduled_encoder_inputs) \
            <= budget
        if not caching:
            assert out.scheduled_encoder_inputs == new_ids
        # The encoder pass.
        runs = [r for r in out.scheduled_new_reqs if r.req_id in out.scheduled_encoder_inputs]
        num_encoder_runs += len(runs)
        if runs:
            slots = compute_cross_slot_mapping([r.cross_block_ids for r in runs],
                                               [r.encoder_input.num_tokens for r in runs],
                                               BLOCK_SIZE).tolist()
            rows = [(names[r.encoder_input.content_hash], i) for r in runs
                    for i in range(r.encoder_input.num_tokens)]
            kv.update(zip(slots, rows, strict=True))
        runner._update_states(out)
        batch = runner.input_batch
        assert sorted(batch.req_ids_in_order) == sorted(out.num_scheduled_tokens)
        if out.total_num_scheduled_tokens == 0:
            continue
        inputs = runner._prepare_inputs(out)
        self_common, _ = inputs.attn_metadata
        cross_common, _ = inputs.cross_attn_metadata
        slots = self_common.slot_mapping.tolist()
        qsl = self_common.query_start_loc
        for row, req_id in enumerate(batch.req_ids_in_order):
            request = s.requests[req_id]
            name = names[request.encoder_input.content_hash]
            assert cross_rows(batch)[row] == kvm.get_cross_block_ids(req_id)
            assert int(cross_common.seq_lens[row]) == request.num_encoder_tokens
            for i in range(request.num_encoder_tokens):
                slot = int(cross_common.block_table[row, i // BLOCK_SIZE]) * BLOCK_SIZE \
                    + i % BLOCK_SIZE
                assert kv.get(slot) == (name, i), (step_no, req_id, i)
            computed = int(batch.num_computed_tokens_cpu[row])
            for t in range(qsl[row], qsl[row + 1]):
                p = computed + t - qsl[row]
                kv[slots[t]] = (name, tuple(request.all_token_ids[:p + 1]))
            for p in range(request.num_computed_tokens):
                slot = int(batch.block_table.table[row, p // BLOCK_SIZE]) * BLOCK_SIZE \
                    + p % BLOCK_SIZE
                assert kv.get(slot) == (name, tuple(request.all_token_ids[:p + 1])), \
                    (step_no, req_id, p)
        tokens = torch.tensor([rng.randint(3, 9) for _ in inputs.sampling_rows])
        s.update_from_output(out, runner._bookkeep(inputs.sampling_rows,
                                                   SamplerOutput(tokens, None)))
    assert not s.has_requests()
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 11
    assert s.kv_cache_manager.req_to_cross_blocks == {}
    assert num_encoder_runs > 0


def test_short_cross_spans_become_paged_rows_per_query_token():
    """Cross-attention (causal=False): rows of up to 16 queries are computed one paged
    kernel row per query token; longer rows stay prefill spans over gathered blocks."""
    qsl = np.array([0, 1, 4, 44], dtype=np.int32)  # query lens [1, 3, 40]
    common = CommonAttentionMetadata(
        query_start_loc=qsl, seq_lens=np.array([5, 9, 6], dtype=np.int32),
        num_computed_tokens=np.zeros(3, dtype=np.int32),
        block_table=np.array([[1, 2, 0], [3, 4, 5], [6, 7, 0]], dtype=np.int32),
        slot_mapping=np.zeros(0, dtype=np.int64), num_actual_tokens=44)
    md = TorchSDPABackend.build_metadata(common, 4, torch.device("cpu"), causal=False)
    assert md.decode_token_idx.tolist() == [0, 1, 2, 3]
    table = (md.decode_block_table_i32 if md.decode_block_table_i32 is not None
             else md.decode_block_table)
    assert table.tolist() == [[1, 2, 0], [3, 4, 5], [3, 4, 5], [3, 4, 5]]
    assert [(s.start, s.end, s.computed, s.seq_len) for s in md.prefills] == [(4, 44, 0, 6)]
    assert md.prefills[0].block_ids.tolist() == [6, 7]
    assert not md.decode_only
    causal = TorchSDPABackend.build_metadata(common, 4, torch.device("cpu"))
    assert causal.decode_token_idx.tolist() == [0]
    assert [(s.start, s.end) for s in causal.prefills] == [(1, 4), (4, 44)]


def test_default_encoder_budget_is_eight_whole_inputs(tiny_bart_dir):
    from vllm.engine.arg_utils import ENCODER_INPUTS_PER_STEP, EngineArgs

    config = EngineArgs(model=tiny_bart_dir, max_model_len=64).create_engine_config()
    assert ENCODER_INPUTS_PER_STEP == 8
    assert config.scheduler_config.max_num_encoder_input_tokens == 8 * 1024
    explicit = EngineArgs(model=tiny_bart_dir, max_model_len=64,
                          max_num_encoder_input_tokens=4096).create_engine_config()
    assert explicit.scheduler_config.max_num_encoder_input_tokens == 4096
    with pytest.raises(ValueError, match="never split"):
        EngineArgs(model=tiny_bart_dir, max_model_len=64,
                   max_num_encoder_input_tokens=100).create_engine_config()
