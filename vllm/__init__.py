"""A from-scratch LLM inference engine with vLLM's public API."""

from vllm.platforms.openmp import openmp_spin_count

# libgomp reads its spin count when torch loads it: see vllm/platforms/openmp.py.
with openmp_spin_count():
    import torch  # noqa: F401

from typing import TYPE_CHECKING, Any  # noqa: E402

from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from vllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

if TYPE_CHECKING:
    from vllm.entrypoints.llm import LLM
    from vllm.pipeline import Pipeline, Stage

# Imported on first use: the API process of `vllm serve` needs none of them, and they load
# the engine core (scheduler, runner, models).
_LAZY = {"LLM": "vllm.entrypoints.llm", "Pipeline": "vllm.pipeline", "Stage": "vllm.pipeline.stage"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vllm' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs",
           "RequestOutputKind", "Pipeline", "Stage", "__version__"]
