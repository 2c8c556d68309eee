"""Exact tests of the scheduler's per-step encoder budget for requests with images: which
requests' images are encoded in which step, for given budgets and encoder-cache contents,
and that their rows are computed once however their prompts are chunked or preempted.

A fake encoder stands in for the vision tower: image "v" is a [3, 2, 2] tensor of v, its
rows are HIDDEN-wide copies of v, and every call is recorded as the list of its images.
"""

from __future__ import annotations

import hashlib

import torch

from tests.core_factories import (
    HIDDEN,
    make_params,
    make_request,
    make_runner_output,
    make_scheduler,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreRequest, FinishReason
from vllm.v1.engine.media_rows import MediaRows
from vllm.v1.messages import MediaInput
from vllm.v1.request import RequestStatus

IMAGE = 9  # the placeholder id at image positions


class FakeTower:
    """Rows [num_tokens, HIDDEN] of each image's value; records each call's images."""

    def __init__(self, num_tokens: dict[int, int], fail_on: int | None = None) -> None:
        self.num_tokens = num_tokens  # image value -> its positions
        self.fail_on = fail_on
        self.calls: list[list[int]] = []

    def __call__(self, modality: str, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        values = [int(p[0, 0, 0]) for p in pixels]
        self.calls.append(values)
        if self.fail_on in values:
            raise RuntimeError("vision tower failed")
        return [torch.full((self.num_tokens[v], HIDDEN), float(v)) for v in values]


def image_request(request_id: str, *images: tuple[int, int]) -> EngineCoreRequest:
    """A prompt [1, <run of image 1>, 1, <run of image 2>, ..., 1]; `images` are
    (value, positions) pairs: the same value is the same image (content hash)."""
    ids, mask, media = [], [], []
    for value, num_tokens in images:
        ids.append(1)
        mask.append(True)
        media.append(MediaInput("image", torch.full((3, 2, 2), float(value)), len(ids),
                                num_tokens, hashlib.sha256(bytes([value])).digest()))
        ids += [IMAGE] * num_tokens
        mask += [False] * num_tokens
    ids.append(1)
    mask.append(True)
    return EngineCoreRequest(request_id, ids, None, make_params(max_tokens=4), 2,
                             prompt_is_token_ids=torch.tensor(mask), mm_inputs=media)


def setup(budget: int, num_tokens: dict[int, int], **kwargs
          ) -> tuple[Scheduler, MediaRows, FakeTower]:
    tower = FakeTower(num_tokens, kwargs.pop("fail_on", None))
    media = MediaRows(tower)
    scheduler = make_scheduler(max_num_encoder_input_tokens=budget, media=media, **kwargs)
    return scheduler, media, tower


def step(scheduler: Scheduler) -> SchedulerOutput:
    """One step; every request whose scheduled tokens reach its end samples token 5."""
    out = scheduler.schedule()
    sampled = {r: [5] for r in out.num_scheduled_tokens
               if scheduler.requests[r].num_computed_tokens == scheduler.requests[r].num_tokens}
    scheduler.update_from_output(out, make_runner_output(out, sampled))
    return out


def test_a_burst_is_encoded_a_budget_at_a_time_and_its_text_waits() -> None:
    """Budget 8, five distinct images of 4 positions: two images a step; a request's
    tokens are scheduled in the step that encodes its image, never before."""
    s, media, tower = setup(8, {v: 4 for v in range(1, 6)})
    for v in range(1, 6):
        s.add_request(image_request(f"r{v}", (v, 4)))
    assert s.get_num_unfinished_requests() == 5 and len(s.waiting) == 0
    out = step(s)
    assert tower.calls == [[1, 2]]
    assert list(out.num_scheduled_tokens) == ["r1", "r2"]
    assert out.num_scheduled_tokens == {"r1": 6, "r2": 6}
    assert [r.request_id for r in media.pending] == ["r3", "r4", "r5"]
    first = out.scheduled_new_reqs[0]
    assert first.prompt_embeds is not None and first.prompt_embeds[:, 0].tolist() == [1] * 4
    out = step(s)
    assert tower.calls == [[1, 2], [3, 4]]
    assert list(out.num_scheduled_tokens) == ["r1", "r2", "r3", "r4"]  # two decodes first
    out = step(s)
    assert tower.calls == [[1, 2], [3, 4], [5]] and media.pending == []
    assert out.num_scheduled_tokens["r5"] == 6
    assert media.stats()["encoder_cache_misses"] == 5


def test_cache_hits_and_repeats_cost_nothing() -> None:
    """Image 1 cached; budget 8: [1, 2, 1, 3, 4] costs 0 + 4 + 0 + 4, then image 4 does
    not fit; an image twice in one step (and twice in one prompt) is encoded once."""
    s, media, tower = setup(8, {v: 4 for v in range(1, 6)})
    s.add_request(image_request("warm", (1, 4)))
    step(s)
    assert tower.calls == [[1]]
    for name, v in (("a", 1), ("b", 2), ("c", 1), ("d", 3), ("e", 4)):
        s.add_request(image_request(name, (v, 4)))
    out = step(s)
    assert tower.calls == [[1], [2, 3]]
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a", "b", "c", "d"]
    assert [r.request_id for r in media.pending] == ["e"]
    assert media.hits == 1  # image 1, read once for "a" and "c"
    s.add_request(image_request("f", (5, 4), (5, 4)))
    s.add_request(image_request("g", (5, 4)))
    step(s)
    assert tower.calls == [[1], [2, 3], [4, 5]]  # "e" (4) and image 5 once for "f", "g"
    assert media.pending == []


def test_a_large_image_waits_its_turn_but_free_requests_pass() -> None:
    """Budget 8: image 1 (6 positions) fits, image 2 (4) then does not; image 3 (2) would
    fit the 2 left over but does not overtake image 2, while a request whose image is
    already in this step costs nothing and is taken. Next step: 2 and 3."""
    s, media, tower = setup(8, {1: 6, 2: 4, 3: 2})
    s.add_request(image_request("big", (1, 6)))
    s.add_request(image_request("mid", (2, 4)))
    s.add_request(image_request("small", (3, 2)))
    s.add_request(image_request("again", (1, 6)))
    out = step(s)
    assert tower.calls == [[1]]
    assert [r.req_id for r in out.scheduled_new_reqs] == ["big", "again"]
    assert [r.request_id for r in media.pending] == ["mid", "small"]
    step(s)
    assert tower.calls == [[1], [2, 3]]


def test_an_image_over_the_whole_budget_is_encoded_alone() -> None:
    """An image is never split: with budget 4, an image of 6 positions takes a step of
    its own (the first of the step, the budget untouched), the next image the step after."""
    s, media, tower = setup(4, {1: 6, 2: 6})
    s.add_request(image_request("a", (1, 6)))
    s.add_request(image_request("b", (2, 6)))
    step(s)
    assert tower.calls == [[1]]
    step(s)
    assert tower.calls == [[1], [2]]


def test_rows_are_encoded_once_across_chunks_and_preemption() -> None:
    """Token budget 3 cuts the image's run of 8 positions across four chunks; the rows
    travel whole with the request, the encoder runs once; a preempted request comes back
    with its rows (no encoder run)."""
    s, media, tower = setup(64, {1: 8}, max_num_batched_tokens=3, block_size=4)
    s.add_request(image_request("a", (1, 8)))
    chunks = []
    for _ in range(4):
        out = step(s)
        chunks.append(out.num_scheduled_tokens["a"])
    assert chunks == [3, 3, 3, 1] and tower.calls == [[1]]
    request = s.requests["a"]
    assert request.prompt_embeds is not None and request.prompt_embeds.shape == (8, HIDDEN)
    s.running.remove(request)
    s._preempt(request)
    out = step(s)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a"]
    assert out.scheduled_new_reqs[0].prompt_embeds is request.prompt_embeds
    assert tower.calls == [[1]]


def test_aborted_and_failed_image_requests() -> None:
    """An abort before the rows exist drops the request from the media stage; an image
    that breaks the encoder fails its request alone, with FinishReason.ERROR."""
    s, media, tower = setup(64, {1: 4, 2: 4, 3: 4}, fail_on=2)
    for name, v in (("a", 1), ("b", 2), ("c", 3)):
        s.add_request(image_request(name, (v, 4)))
    s.add_request(image_request("gone", (1, 4)))
    s.finish_requests(["gone"], RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    assert tower.calls == [[1, 2, 3], [1], [2], [3]]  # the batch, then each alone
    assert list(out.num_scheduled_tokens) == ["a", "c"]
    result = s.update_from_output(out, make_runner_output(out))
    assert [(o.request_id, o.finish_reason) for o in result.outputs] == [
        ("b", FinishReason.ERROR)]
    assert media.pending == [] and "b" not in s.requests


# ---- media attending bidirectionally (Gemma 3): spans never split -------------------------


def spans_request(request_id: str, prompt: list[int], spans: list[tuple[int, int]],
                  **params) -> EngineCoreRequest:
    request = make_request(request_id, prompt, **params)
    request.bidirectional_spans = spans
    return request


def test_a_chunk_never_ends_inside_a_bidirectional_span() -> None:
    """Budget 8, a 20-token prompt with the span [3, 9): the first chunk ends before the
    span (3), the next takes it whole (8: 3..11), then 8 and 1; the same prompt without
    the span is cut 8, 8, 4."""
    s = make_scheduler(max_num_batched_tokens=8)
    s.add_request(spans_request("a", list(range(10, 30)), [(3, 9)], max_tokens=2))
    s.add_request(make_request("b", list(range(40, 60)), max_tokens=2))
    counts = []
    for _ in range(6):
        out = step(s)
        counts.append(dict(out.num_scheduled_tokens))
    assert counts[:3] == [{"a": 3, "b": 5}, {"a": 8}, {"a": 8}]
    assert counts[3] == {"a": 1, "b": 7}  # a's last prompt token, b on from 5


def test_a_span_waits_for_a_step_with_room_for_it_whole() -> None:
    """A running request's prompt chunk leaves 3 of the budget of 8; the waiting request's
    prompt starts with a span of 6 positions: it is not scheduled (not even its first 3),
    and takes the span whole in the next step."""
    s = make_scheduler(max_num_batched_tokens=8)
    s.add_request(make_request("a", list(range(10, 23)), max_tokens=1))
    s.add_request(spans_request("b", list(range(40, 50)), [(0, 6)], max_tokens=1))
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 8}
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 5}  # b's 6 do not fit the 3 left
    out = step(s)
    assert out.num_scheduled_tokens == {"b": 8}


def test_a_prefix_hit_never_ends_inside_a_bidirectional_span() -> None:
    """Block size 4: b shares a's first 12 tokens, which a computed; the hit of 3 blocks
    would end at 12, inside the span [6, 14): it is rounded down to the block before the
    span (4 tokens). Without the span, b hits all 12."""
    prompt = list(range(10, 27))
    for spans, expected_hit in (([(6, 14)], 4), ([], 12)):
        s = make_scheduler(max_num_batched_tokens=64)
        s.add_request(spans_request("a", prompt, spans, max_tokens=1))
        step(s)
        step(s)
        assert not s.has_unfinished_requests()
        s.add_request(spans_request("b", prompt[:12] + [90, 91, 92, 93, 94], spans,
                                    max_tokens=1))
        out = step(s)
        [new] = out.scheduled_new_reqs
        assert new.num_computed_tokens == expected_hit
        assert out.num_scheduled_tokens == {"b": 17 - expected_hit}
        assert new.bidirectional_spans == spans


# ---- a starved run: budget reserved for it ----------------------------------------------


def decoders(s: Scheduler, n: int) -> list[str]:
    """`n` requests of 2 prompt tokens, each then decoding one token a step."""
    names = [f"d{i}" for i in range(1, n + 1)]
    for name in names:
        s.add_request(make_request(name, [3, 4], max_tokens=30))
    return names


def test_a_run_starved_by_decodes_gets_the_budget_reserved() -> None:
    """Budget 8, max_num_seqs 4: three requests decode while c's prompt of 10 holds the
    run [2, 8). Step 1 prefills everyone (c up to the run); in step 2 the decodes leave 5
    of 8, c is blocked (before the fix it stayed blocked as long as they decoded); step 3
    reserves its 6: d1 and d2 decode, c takes its run, d3 waits that one step; step 4
    takes the three decodes and c's last 2 tokens (its first sampled token)."""
    s = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    decoders(s, 3)
    s.add_request(spans_request("c", list(range(10, 20)), [(2, 8)], max_tokens=4))
    counts = [dict(step(s).num_scheduled_tokens) for _ in range(5)]
    assert counts == [
        {"d1": 2, "d2": 2, "d3": 2, "c": 2},
        {"d1": 1, "d2": 1, "d3": 1},
        {"d1": 1, "d2": 1, "c": 6},
        {"d1": 1, "d2": 1, "d3": 1, "c": 2},
        {"d1": 1, "d2": 1, "d3": 1, "c": 1},
    ]
    assert s.requests["c"].output_token_ids == [5, 5]


def test_a_waiting_run_is_admitted_ahead_of_newer_work() -> None:
    """Budget 8: c's prompt starts with a run of 6, behind three decodes (5 left); e, newer,
    would fit. Step 2 finds c blocked (e waits behind it); step 3 reserves 6: d3 and e
    wait, c is admitted with its run; step 4: the decodes, c's last 2 tokens, e."""
    s = make_scheduler(max_num_batched_tokens=8, max_num_seqs=5)
    decoders(s, 3)
    step(s)
    s.add_request(spans_request("c", list(range(10, 18)), [(0, 6)], max_tokens=4))
    s.add_request(make_request("e", [7, 7], max_tokens=4))
    counts = [dict(step(s).num_scheduled_tokens) for _ in range(3)]
    assert counts == [
        {"d1": 1, "d2": 1, "d3": 1},
        {"d1": 1, "d2": 1, "c": 6},
        {"d1": 1, "d2": 1, "d3": 1, "c": 2, "e": 2},
    ]


def test_a_run_as_long_as_the_budget_is_served() -> None:
    """A run of 8 positions with a budget of 8 fits only a step with nothing else: the
    reserved step holds back both decodes (one step), then they go on."""
    s = make_scheduler(max_num_batched_tokens=8, max_num_seqs=3)
    decoders(s, 2)
    s.add_request(spans_request("c", list(range(10, 20)), [(1, 9)], max_tokens=4))
    counts = [dict(step(s).num_scheduled_tokens) for _ in range(4)]
    assert counts == [
        {"d1": 2, "d2": 2, "c": 1},
        {"d1": 1, "d2": 1},
        {"c": 8},
        {"d1": 1, "d2": 1, "c": 1},
    ]


def test_two_starved_runs_take_turns_and_no_decode_waits_two_steps() -> None:
    """Budget 8, two decodes, b and c each with a run of 7 after one text token: at most
    every other step is reserved, so b's run is taken in step 3, c's in step 5, and a
    decode left out of a step always runs in the next one."""
    s = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    names = decoders(s, 2)
    s.add_request(spans_request("b", list(range(10, 19)), [(1, 8)], max_tokens=20))
    s.add_request(spans_request("c", list(range(30, 39)), [(1, 8)], max_tokens=20))
    counts = [dict(step(s).num_scheduled_tokens) for _ in range(7)]
    assert counts == [
        {"d1": 2, "d2": 2, "b": 1, "c": 1},
        {"d1": 1, "d2": 1},
        {"d1": 1, "b": 7},
        {"d1": 1, "d2": 1, "b": 1},
        {"c": 7, "d1": 1},
        {"d1": 1, "d2": 1, "b": 1, "c": 1},
        {"d1": 1, "d2": 1, "b": 1, "c": 1},
    ]
    for before, after in zip(counts, counts[1:]):
        assert all(name in before or name in after for name in names)


def test_a_reservation_its_request_cannot_use_goes_back_to_the_decodes() -> None:
    """Five blocks of 4 (one the null block): c is blocked in step 2 and reserved for in
    step 3, but its run needs two blocks and one is free: c waits, and d3, left out by the
    reservation, decodes in the same step."""
    s = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4, num_blocks=5)
    decoders(s, 3)
    step(s)
    s.add_request(spans_request("c", list(range(10, 18)), [(0, 6)], max_tokens=4))
    assert dict(step(s).num_scheduled_tokens) == {"d1": 1, "d2": 1, "d3": 1}
    assert s.span_reservation.req_id == "c"
    assert dict(step(s).num_scheduled_tokens) == {"d1": 1, "d2": 1, "d3": 1}
    assert s.requests["c"].status == RequestStatus.WAITING


def test_a_starved_request_aborted_leaves_no_reservation() -> None:
    """c is blocked in step 2, then aborted: step 3 reserves nothing, the three decode."""
    s = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    decoders(s, 3)
    s.add_request(spans_request("c", list(range(10, 20)), [(2, 8)], max_tokens=4))
    step(s)
    assert dict(step(s).num_scheduled_tokens) == {"d1": 1, "d2": 1, "d3": 1}
    s.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert dict(step(s).num_scheduled_tokens) == {"d1": 1, "d2": 1, "d3": 1}
    assert s.span_reservation.req_id is None
