"""A from-scratch LLM inference engine with vLLM's public API."""

import os

# OpenMP threads that wait for work spin briefly, then sleep (libgomp: GOMP_SPINCOUNT
# iterations, ~10-40 us, when OMP_WAIT_POLICY is unset). Spinning long (libgomp's default,
# 300,000) makes every small op's parallel region wait on a thread that another process has
# preempted: on a shared 2-core machine a [2, 384] layer norm + linear went from 0.2 ms to
# 4-16 ms with 2 threads, and Whisper transcription ran 1.7x slower. Not spinning at all
# (OMP_WAIT_POLICY=PASSIVE, this engine's earlier default) puts a thread to sleep between
# any two ops, and waking it costs more than most decode-step ops: default model, bfloat16,
# 2 threads, idle machine, 2 / 64 requests: 32.7 / 293 tok/s passive, 61 / 362 spinning
# forever, 72 / 388 with 10,000. Read once, when torch loads its OpenMP runtime, so it is
# set before the first torch import; a user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

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
