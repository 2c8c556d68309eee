"""The engine: front end (processor, output processor, `LLMEngine`, `AsyncLLM`) and core.

Its wire types live in `vllm.v1.messages` (below the engine, so the scheduler, requests and
models need not import upward); they are re-exported here under vLLM's import path.
"""

from vllm.v1.messages import (
    BeamHypothesis,
    EmbedsLayout,
    EncoderInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)

__all__ = ["BeamHypothesis", "EmbedsLayout", "EncoderInput", "EngineCoreOutput",
           "EngineCoreOutputs", "EngineCoreRequest", "FinishReason", "SchedulerStats"]
