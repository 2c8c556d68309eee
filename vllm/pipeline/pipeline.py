"""`Pipeline`: offline multi-stage generation, one `LLMEngine` per stage.

    prompts ─► stage 0 ─(connector 0)─► stage 1 ─► ... ─► stage N-1 ─► RequestOutput
               LLMEngine                LLMEngine                      (.stage_outputs: the
               own scheduler, KV cache, stage-output cache               earlier stages')

The driver steps the engines round-robin. A request finished by stage k enters stage k+1
at once (no batch barrier), and every engine keeps batching whatever it holds. The engine
cores know nothing of pipelines.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.outputs import RequestOutput
from vllm.pipeline.stage import (
    Stage,
    load_pipeline_spec,
    resolve_connectors,
    stage_engine_args,
    stage_params,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.llm_engine import LLMEngine

ParamsArg = SamplingParams | Sequence[SamplingParams] | None


class EventKind(enum.Enum):
    ADD = "add"  # the request entered the stage
    FINISH = "finish"  # the stage finished it


@dataclass(frozen=True, slots=True)
class PipelineEvent:
    stage: int
    kind: EventKind
    request_id: str


@dataclass(slots=True)
class _Run:
    """One `generate` call in flight."""

    params: dict[str, list[SamplingParams]]  # request id -> its params, per stage
    earlier: dict[str, list[RequestOutput]]  # request id -> outputs of the stages done
    results: dict[str, RequestOutput]  # request id -> last stage's output


class Pipeline:
    """Runs prompts through stages in order; returns the last stage's outputs.

    Args:
        stages: the stages, first to last.
        connectors: one per boundary: callables `RequestOutput -> prompt`, or connector
            names (`vllm.pipeline.connectors`); default: hidden states to prompt embeds.
            What a connector needs is switched on in the stages around it (hidden states
            kept by the stage before, prompt embeds accepted by the stage after).

    Attributes:
        events: what happened, in order: each request entering and leaving each stage.
    """

    def __init__(self, stages: list[Stage], connectors: list[Any] | None = None) -> None:
        self.stages = list(stages)
        self.connectors = resolve_connectors(self.stages, connectors)
        self.engines = [LLMEngine.from_engine_args(args)
                        for args in stage_engine_args(self.stages, self.connectors)]
        self.events: list[PipelineEvent] = []
        self._request_counter = itertools.count()

    @classmethod
    def from_yaml(cls, path: str) -> Pipeline:
        spec = load_pipeline_spec(path)
        return cls(spec.stages, spec.connectors)

    def generate(self, prompts: Any, sampling_params: Sequence[ParamsArg] | None = None
                 ) -> list[RequestOutput]:
        """Runs every prompt through every stage; outputs come back in prompt order.

        Args:
            prompts: as `LLM.generate` takes them (the first stage's input).
            sampling_params: one entry per stage: a `SamplingParams`, a list with one per
                prompt, or None for the stage's own defaults.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_per_stage(sampling_params, len(prompts))
        request_ids = [str(next(self._request_counter)) for _ in prompts]
        run = _Run({r: [p[i] for p in params] for i, r in enumerate(request_ids)},
                   {r: [] for r in request_ids}, {})
        try:
            for request_id, prompt in zip(request_ids, prompts):
                self._add(run, 0, request_id, prompt)
            while len(run.results) < len(request_ids):
                if not self._step_all(run):
                    raise RuntimeError("The pipeline's engines stopped with requests unfinished.")
        except BaseException:
            self._abort([r for r in request_ids if r not in run.results])
            raise
        return [run.results[r] for r in request_ids]

    def _params_per_stage(self, sampling_params: Sequence[ParamsArg] | None,
                          num_prompts: int) -> list[list[SamplingParams]]:
        """[stage][prompt] params, as each stage's requests run with them."""
        given = list(sampling_params) if sampling_params is not None else [None] * len(
            self.stages)
        if len(given) != len(self.stages):
            raise ValueError(f"Got {len(given)} sampling params for {len(self.stages)} "
                             "stages (give one entry per stage, None for its defaults).")
        result = []
        for k, (stage, entry) in enumerate(zip(self.stages, given)):
            entry = stage.sampling_params if entry is None else entry
            per_prompt = [entry] * num_prompts if isinstance(entry, SamplingParams) \
                else list(entry)
            if len(per_prompt) != num_prompts:
                raise ValueError(f"Stage {k}: got {len(per_prompt)} sampling params for "
                                 f"{num_prompts} prompts.")
            connector = self.connectors[k] if k < len(self.connectors) else None
            result.append([stage_params(p, connector, final_only=True) for p in per_prompt])
        return result

    def _add(self, run: _Run, stage: int, request_id: str, prompt: Any) -> None:
        self.engines[stage].add_request(request_id, prompt, run.params[request_id][stage])
        self.events.append(PipelineEvent(stage, EventKind.ADD, request_id))

    def _step_all(self, run: _Run) -> bool:
        """One step of every engine that has work; finished requests move on at once.
        Returns False if no engine had any."""
        stepped = False
        for stage, engine in enumerate(self.engines):
            if not engine.has_unfinished_requests():
                continue
            stepped = True
            for output in engine.step():
                if not output.finished:
                    continue
                self.events.append(PipelineEvent(stage, EventKind.FINISH, output.request_id))
                self._move_on(run, stage, output)
        return stepped

    def _move_on(self, run: _Run, stage: int, output: RequestOutput) -> None:
        request_id = output.request_id
        earlier = run.earlier[request_id]
        if stage == len(self.engines) - 1:
            output.stage_outputs = earlier
            run.results[request_id] = output
            return
        earlier.append(output)
        self._add(run, stage + 1, request_id, self.connectors[stage](output))

    def _abort(self, request_ids: list[str]) -> None:
        for engine in self.engines:
            engine.abort_request(request_ids)
