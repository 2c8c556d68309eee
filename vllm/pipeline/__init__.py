"""Stage pipelines: one engine per stage, each stage's outputs feeding the next's prompts."""

from vllm.pipeline.connectors import Connector, HiddenStatesToEmbeds, TextToPrompt
from vllm.pipeline.pipeline import EventKind, Pipeline, PipelineEvent
from vllm.pipeline.stage import Stage, load_pipeline_spec

__all__ = ["Connector", "EventKind", "HiddenStatesToEmbeds", "Pipeline", "PipelineEvent",
           "Stage", "TextToPrompt", "load_pipeline_spec"]
