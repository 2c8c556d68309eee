"""A from-scratch LLM inference engine with vLLM's public API."""

from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.llm import LLM
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.pipeline import Pipeline, Stage
from vllm.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs",
           "RequestOutputKind", "Pipeline", "Stage", "__version__"]
