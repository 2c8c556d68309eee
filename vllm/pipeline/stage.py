"""`Stage` (one engine of a pipeline) and the pipeline's YAML description.

    name: thinker-talker                 # optional; the served model name
    stages:
      - model: /models/thinker           # every other key is an engine argument
        dtype: float32
        max_model_len: 2048
        sampling_params: {temperature: 0, max_tokens: 64}   # defaults for this stage
      - model: /models/talker
    connectors: [hidden_states_to_embeds]   # one per boundary; names or {name, projection}
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import yaml

from vllm.engine.arg_utils import EngineArgs
from vllm.pipeline.connectors import Connector, HiddenStatesToEmbeds, make_connector
from vllm.sampling_params import RequestOutputKind, SamplingParams


class Stage:
    """One stage: a model with its engine arguments (vLLM's names), and the sampling params
    its requests get when the caller gives none.

        Stage(model="/models/thinker", dtype="float32", max_model_len=2048)

    Each stage is an engine of its own: its own scheduler, KV cache and stage-output cache.
    """

    def __init__(self, model: str | None = None, *, name: str | None = None,
                 sampling_params: SamplingParams | None = None, **engine_kwargs: Any) -> None:
        self.engine_args = EngineArgs.from_kwargs(model=model, **engine_kwargs)
        self.name = name or (os.path.basename(str(model)) if model else "default")
        self.sampling_params = sampling_params or SamplingParams()

    def __repr__(self) -> str:
        return f"Stage(name={self.name!r}, model={self.engine_args.model!r})"


@dataclass(slots=True)
class PipelineSpec:
    stages: list[Stage]
    connectors: list[Connector]
    name: str | None = None


def resolve_connectors(stages: list[Stage], connectors: list[Any] | None) -> list[Connector]:
    """One connector per boundary; hidden states to prompt embeds when none are given."""
    if not stages:
        raise ValueError("A pipeline needs at least one stage.")
    if connectors is None:
        connectors = [HiddenStatesToEmbeds() for _ in stages[1:]]
    if len(connectors) != len(stages) - 1:
        raise ValueError(f"{len(stages)} stages need {len(stages) - 1} connectors, got "
                         f"{len(connectors)}.")
    return [make_connector(c) for c in connectors]


def stage_engine_args(stages: list[Stage], connectors: list[Connector]) -> list[EngineArgs]:
    """Each stage's engine arguments, with what its connectors need switched on: hidden
    states kept by the stage before a connector that reads them, prompt embeds accepted by
    the stage after one that makes them."""
    args = [dataclasses.replace(stage.engine_args) for stage in stages]
    for k, connector in enumerate(connectors):
        if getattr(connector, "needs_hidden_states", False):
            args[k].enable_return_hidden_states = True
        if getattr(connector, "makes_embeds", False):
            args[k + 1].enable_prompt_embeds = True
    return args


def stage_params(params: SamplingParams, next_connector: Connector | None,
                 final_only: bool = False) -> SamplingParams:
    """The params one stage's request runs with; an earlier stage (it has a next connector)
    runs one sequence to completion, returning hidden states if the connector reads them.
    The last stage keeps the caller's output kind unless `final_only`."""
    params = params.clone()
    if final_only:
        params.output_kind = RequestOutputKind.FINAL_ONLY
    if next_connector is None:
        return params
    if params.n != 1:
        raise ValueError(f"Only the last stage may sample n > 1 sequences, got n={params.n}.")
    params.output_kind = RequestOutputKind.FINAL_ONLY
    if getattr(next_connector, "needs_hidden_states", False):
        params.return_hidden_states = True
    return params


def load_pipeline_spec(path: str) -> PipelineSpec:
    """Stages and connectors from a YAML file (see the module docstring)."""
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict) or not isinstance(data.get("stages"), list):
        raise ValueError(f"{path}: expected a mapping with a 'stages' list.")
    unknown = sorted(set(data) - {"name", "stages", "connectors"})
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(unknown)}.")
    stages = [_stage_from_dict(path, i, entry) for i, entry in enumerate(data["stages"])]
    return PipelineSpec(stages, resolve_connectors(stages, data.get("connectors")),
                        data.get("name"))


def _stage_from_dict(path: str, index: int, entry: Any) -> Stage:
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: stage {index} must be a mapping, got {entry!r}.")
    entry = dict(entry)
    params = entry.pop("sampling_params", None) or {}
    try:
        return Stage(sampling_params=SamplingParams(**params), **entry)
    except TypeError as e:
        raise ValueError(f"{path}: stage {index}: {e}") from None
