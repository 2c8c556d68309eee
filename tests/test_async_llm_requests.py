"""`AsyncLLM`'s request bookkeeping against a fake engine core: ids and bounded streams.

No engine process: the client is replaced by a recorder, and the test plays the engine
core by feeding `EngineCoreOutputs` to the output handler.
"""

from __future__ import annotations

import asyncio

import pytest

import vllm.v1.engine.async_llm as async_llm_module
from vllm import EngineArgs, SamplingParams
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.engine.async_llm import AsyncLLM, RequestStream
from vllm.v1.engine.core_client import EngineDeadError, EngineLost


class FakeClient:
    """Records what `AsyncLLM` sends; outputs come from `emit`."""

    def __init__(self, vllm_config: object) -> None:
        self.num_blocks = 64
        self.dead_error = None
        self.sent: list[tuple[str, object]] = []
        self.outputs: asyncio.Queue | None = None
        self.next_engine = 0  # where a request not pinned to an engine goes

    def is_alive(self) -> bool:
        return True

    async def add_request_async(self, request, engine_index: int | None = None) -> int:
        self.sent.append(("add", request.request_id))
        return self.next_engine if engine_index is None else engine_index

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:  # as the real client: nothing to send
            self.sent.append(("abort", list(request_ids)))

    async def stop_requests_async(self, request_ids: list[str]) -> None:
        self.sent.append(("stop", list(request_ids)))

    async def get_output_async(self) -> EngineCoreOutputs:
        if self.outputs is None:
            self.outputs = asyncio.Queue()
        return await self.outputs.get()

    def emit(self, *outputs: EngineCoreOutput, engine_index: int = 0) -> None:
        self.put(EngineCoreOutputs(list(outputs), engine_index=engine_index))

    def put(self, item: EngineCoreOutputs | EngineLost) -> None:
        if self.outputs is None:
            self.outputs = asyncio.Queue()
        self.outputs.put_nowait(item)

    def shutdown(self) -> None:
        pass


@pytest.fixture()
def engine(tiny_qwen2_dir: str, monkeypatch: pytest.MonkeyPatch) -> AsyncLLM:
    monkeypatch.setattr(async_llm_module, "AsyncMPClient", FakeClient)
    return AsyncLLM.from_engine_args(EngineArgs(model=tiny_qwen2_dir, max_model_len=128))


def added(engine: AsyncLLM) -> list[str]:
    return [body for kind, body in engine.engine_core.sent if kind == "add"]


def params(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=4, **kwargs)


def test_reused_id_rejected_while_live(engine: AsyncLLM) -> None:
    async def run() -> None:
        await engine.add_request("x", {"prompt_token_ids": [1, 2]}, params())
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("x", {"prompt_token_ids": [3]}, params())
        assert len(added(engine)) == 1
        core_id = added(engine)[0]
        engine.engine_core.emit(EngineCoreOutput(core_id, [5], finish_reason=FinishReason.LENGTH))
        await asyncio.sleep(0.05)
        # Finished: the id may be used again, under a new engine-core id.
        await engine.add_request("x", {"prompt_token_ids": [3]}, params())
        assert added(engine)[1] != core_id and added(engine)[1].startswith("x-")

    asyncio.run(run())


def test_late_abort_never_reaches_a_newer_request(engine: AsyncLLM) -> None:
    """A request is aborted and its id reused at once: the abort still in flight and the
    first request's late outputs name its own engine-core id, not the new request's."""

    async def run() -> None:
        await engine.add_request("r", {"prompt_token_ids": [1, 2]}, params())
        engine.abort_nowait(["r"])
        second = await engine.add_request("r", {"prompt_token_ids": [1, 2]}, params())
        await asyncio.sleep(0.05)
        first_id, second_id = added(engine)
        aborts = [body for kind, body in engine.engine_core.sent if kind == "abort"]
        assert aborts == [[first_id]] and first_id != second_id
        engine.engine_core.emit(EngineCoreOutput(first_id, [9]),
                                EngineCoreOutput(second_id, [7],
                                                 finish_reason=FinishReason.LENGTH))
        output = await asyncio.wait_for(second.get(), 5)
        assert output.request_id == "r" and output.outputs[0].token_ids == [7]

    asyncio.run(run())


def test_abort_reaches_only_user_ids(engine: AsyncLLM) -> None:
    """The children of an n=2 request have engine-core ids of their own; an abort naming
    one of them (or anything but a live user id) does nothing."""

    async def run() -> None:
        await engine.add_request("a", {"prompt_token_ids": [1, 2]}, params(n=2))
        children = added(engine)
        assert len(children) == 2
        await engine.abort([*children, "0_a", "unknown"])
        assert not [kind for kind, _ in engine.engine_core.sent if kind == "abort"]
        await engine.abort("a")
        assert engine.engine_core.sent[-1] == ("abort", children)

    asyncio.run(run())


def test_lost_engine_fails_only_its_requests(engine: AsyncLLM) -> None:
    """Data parallel: an n=2 request on engine 1 and a request on engine 0; engine 1 is
    lost. Its request fails with the engine's error, the other finishes; the next request
    of an OpenAI call follows its first (`data_parallel_rank`)."""

    async def run() -> None:
        core = engine.engine_core
        on_zero = await engine.add_request("a", {"prompt_token_ids": [1, 2]}, params())
        core.next_engine = 1
        on_one = await engine.add_request("b", {"prompt_token_ids": [1, 2]}, params(n=2))
        assert (on_zero.engine_index, on_one.engine_index) == (0, 1)
        pinned = await engine.add_request("c", {"prompt_token_ids": [3]}, params(),
                                          data_parallel_rank=0)
        assert pinned.engine_index == 0
        core.put(EngineLost(1, EngineDeadError("Engine core 1 process exited.")))
        with pytest.raises(EngineDeadError, match="Engine core 1"):
            await asyncio.wait_for(on_one.get(), 5)
        a_id, _, _, c_id = added(engine)
        core.emit(EngineCoreOutput(a_id, [5], finish_reason=FinishReason.LENGTH),
                  EngineCoreOutput(c_id, [6], finish_reason=FinishReason.LENGTH))
        assert (await asyncio.wait_for(on_zero.get(), 5)).outputs[0].token_ids == [5]
        assert (await asyncio.wait_for(pinned.get(), 5)).outputs[0].token_ids == [6]

    asyncio.run(run())


def delta(index: int, text: str, tokens: list[int], finish: str | None = None
          ) -> RequestOutput:
    return RequestOutput("s", None, None, None,
                         [CompletionOutput(index, text, tokens, None, None, finish)],
                         finished=finish is not None)


def test_stream_folds_outputs_of_a_slow_reader() -> None:
    """A reader that falls behind finds one pending output holding everything since its
    last read, in order, not a queue growing by one entry per step."""

    async def run() -> None:
        stream = RequestStream("s", delta=True)
        for i in range(1000):
            stream.put(delta(i % 2, f"{i},", [i]))
        stream.put(delta(0, "end", [1000], "length"))
        output = await stream.get()
        assert not stream.has_pending
        by_index = {c.index: c for c in output.outputs}
        assert by_index[0].token_ids == [*range(0, 1000, 2), 1000]
        assert by_index[1].text == "".join(f"{i}," for i in range(1, 1000, 2))
        assert by_index[0].finish_reason == "length" and output.finished

    asyncio.run(run())


def test_cumulative_stream_keeps_the_latest() -> None:
    async def run() -> None:
        stream = RequestStream("s", delta=False)
        stream.put(delta(0, "a", [1]))
        stream.put(delta(0, "ab", [1, 2]))
        assert (await stream.get()).outputs[0].text == "ab"

    asyncio.run(run())


def test_output_kind_is_delta_for_streams(engine: AsyncLLM) -> None:
    async def run() -> None:
        stream = await engine.add_request(
            "d", {"prompt_token_ids": [1]}, params(output_kind=RequestOutputKind.DELTA))
        assert stream.delta

    asyncio.run(run())
