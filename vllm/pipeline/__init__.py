"""Stage pipelines: one engine per stage, each stage's outputs feeding the next's prompts."""

from typing import TYPE_CHECKING, Any

from vllm.pipeline.connectors import Connector, HiddenStatesToEmbeds, TextToPrompt
from vllm.pipeline.stage import Stage, load_pipeline_spec

if TYPE_CHECKING:
    from vllm.pipeline.pipeline import EventKind, Pipeline, PipelineEvent

__all__ = ["Connector", "EventKind", "HiddenStatesToEmbeds", "Pipeline", "PipelineEvent",
           "Stage", "TextToPrompt", "load_pipeline_spec"]

# The offline pipeline loads the engine core; the served one (`async_pipeline`) must not.
_LAZY = ("EventKind", "Pipeline", "PipelineEvent")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from vllm.pipeline import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'vllm.pipeline' has no attribute {name!r}")
