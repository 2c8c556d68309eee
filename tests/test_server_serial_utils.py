"""The engine-core wire format: msgpack bodies, tensors as raw frames, no pickle."""

from __future__ import annotations

import pickle

import msgspec
import pytest
import torch

from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from vllm.v1.engine.wire import UtilityCall
from vllm.v1.outputs import LogprobsLists
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder


def _round_trip(obj, msg_type):
    frames = MsgpackEncoder().encode(obj)
    # What ZMQ delivers: read-only buffers.
    return MsgpackDecoder(msg_type).decode([memoryview(bytes(f)) for f in frames]), frames


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_request_with_embeds_round_trips(dtype: torch.dtype) -> None:
    params = SamplingParams(temperature=0.5, top_k=3, stop=["x", "yz"], seed=11, n=1,
                            logprobs=2, output_kind=RequestOutputKind.DELTA)
    params.eos_token_id, params.all_stop_token_ids = 2, [5, 6]
    embeds = torch.randn(5, 8).to(dtype)
    request = EngineCoreRequest("req-1", None, embeds, params, 2, arrival_time=12.5)
    decoded, frames = _round_trip(request, EngineCoreRequest)
    assert len(frames) == 2 and len(frames[1]) == embeds.numel() * embeds.element_size()
    assert decoded.prompt_embeds.dtype == dtype
    assert torch.equal(decoded.prompt_embeds, embeds)
    assert decoded.prompt_embeds.is_contiguous()
    decoded.prompt_embeds.add_(1)  # owns writable memory
    for name in SamplingParams.__slots__:
        assert getattr(decoded.sampling_params, name) == getattr(params, name), name
    assert (decoded.request_id, decoded.eos_token_id, decoded.arrival_time) == ("req-1", 2,
                                                                                 12.5)


def test_token_request_and_special_tensors() -> None:
    request = EngineCoreRequest("r", [1, 2, 3], None, SamplingParams(), None)
    decoded, frames = _round_trip(request, EngineCoreRequest)
    assert len(frames) == 1 and decoded.prompt_token_ids == [1, 2, 3]
    assert decoded.prompt_embeds is None
    for tensor in (torch.empty(0, 4), torch.tensor(3.5), torch.arange(12.0).reshape(3, 4).t()):
        back = MsgpackDecoder(torch.Tensor).decode(MsgpackEncoder().encode(tensor))
        assert back.shape == tensor.shape and torch.equal(back, tensor)


def test_outputs_round_trip() -> None:
    outputs = EngineCoreOutputs(
        [EngineCoreOutput("a", [7], LogprobsLists([[7, 1]], [[-0.1, -2.0]], [1]),
                          FinishReason.STOP, "stop!", 4),
         EngineCoreOutput("b", [8, 9])],
        SchedulerStats(2, 1, 0.25, 32, 16, 0), timestamp=3.0)
    decoded, _ = _round_trip(outputs, EngineCoreOutputs)
    assert decoded == outputs
    assert decoded.outputs[0].finish_reason is FinishReason.STOP
    calls, _ = _round_trip(UtilityCall(3, "reset_prefix_cache", []), UtilityCall)
    assert calls == UtilityCall(3, "reset_prefix_cache", [])
    aborts, _ = _round_trip(["a", "b"], list[str])
    assert aborts == ["a", "b"]


def test_refuses_what_it_cannot_send_or_read() -> None:
    with pytest.raises(NotImplementedError):
        MsgpackEncoder().encode({"x": object()})
    with pytest.raises(NotImplementedError):
        MsgpackEncoder().encode(torch.randn(4, 4).to_sparse())
    with pytest.raises(msgspec.DecodeError):  # a pickle is not msgpack for a request
        MsgpackDecoder(EngineCoreRequest).decode([pickle.dumps({"request_id": "x"})])
    bad_header = msgspec.msgpack.Ext(1, msgspec.msgpack.encode(("object", [1], 1)))
    with pytest.raises(msgspec.DecodeError):
        MsgpackDecoder().decode([msgspec.msgpack.encode(bad_header), b"\0" * 8])
