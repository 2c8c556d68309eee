"""How OpenMP threads wait for work: the spin count this engine wants libgomp to read.

OpenMP threads that wait for work spin briefly, then sleep (libgomp: GOMP_SPINCOUNT
iterations, ~10-40 us, when OMP_WAIT_POLICY is unset). Spinning long (libgomp's default,
300,000) makes every small op's parallel region wait on a thread that another process has
preempted: on a shared 2-core machine a [2, 384] layer norm + linear went from 0.2 ms to
4-16 ms with 2 threads, and Whisper transcription ran 1.7x slower. Not spinning at all
(OMP_WAIT_POLICY=PASSIVE, this engine's earlier default) puts a thread to sleep between
any two ops, and waking it costs more than most decode-step ops: default model, bfloat16,
2 threads, idle machine, 2 / 64 requests: 32.7 / 293 tok/s passive, 61 / 362 spinning
forever, 72 / 388 with 10,000.

libgomp reads the variable once, when it is loaded (the first `import torch` of a process),
so it must be in the environment at that moment: `import vllm` sets it around its own first
torch import, and the engine sets it around starting the processes it spawns (engine cores,
workers), each of which loads torch afresh. It is taken out again after either, so importing
or using this package leaves the caller's `os.environ` as it was. A value the user set wins.

This module imports nothing heavy: `vllm/__init__.py` uses it before torch is loaded.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

SPIN_COUNT_VAR = "GOMP_SPINCOUNT"
SPIN_COUNT = "10000"


@contextlib.contextmanager
def openmp_spin_count() -> Iterator[None]:
    """`GOMP_SPINCOUNT=10000` in the process environment inside the block (for a torch
    import or a process start), unless the user set one; removed again on leaving."""
    if SPIN_COUNT_VAR in os.environ:
        yield
        return
    os.environ[SPIN_COUNT_VAR] = SPIN_COUNT
    try:
        yield
    finally:
        os.environ.pop(SPIN_COUNT_VAR, None)
