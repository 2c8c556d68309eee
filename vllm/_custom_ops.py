"""Native kernels from `csrc/`, compiled on first use (cached by torch); None if unavailable.

The CPU kernels are built with torch's C++ extension machinery the first time they are
needed (about a minute), then loaded from the cache. Setting `VLLM_DISABLE_NATIVE=1`, or a
machine without a compiler, falls back to the pure-torch paths.

They are built for this processor (`-march=native`): each kernel picks its instruction-set
form when it is compiled. `VLLM_CPU_MARCH=haswell` builds them for another target instead,
so that an AVX-512 machine runs the forms an AVX2-only one does (with
`ATEN_CPU_CAPABILITY=avx2` for torch's own kernels; docs/testing.md).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent.parent / "csrc"


def _march() -> str:
    """The `-march` target of the build: this processor unless `VLLM_CPU_MARCH` names one."""
    return os.environ.get("VLLM_CPU_MARCH") or "native"


def _build_signature(sources: list[Path], march: str) -> str:
    """Short hash of the CPU's feature flags, the `-march` target, the sources (headers
    included) and their paths: a build for this processor must never be loaded on a CPU with
    other instructions, nor a build for one target taken for another, nor one entry shared
    by two checkouts (the build records the sources' absolute paths, so two checkouts
    sharing one entry would keep rebuilding it for each other)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    key = flags.encode() + march.encode()
    for source in sources:
        key += source.read_bytes() + str(source.resolve()).encode()
    return hashlib.sha256(key).hexdigest()[:10]


@functools.cache
def cpu_ops() -> ModuleType | None:
    if os.environ.get("VLLM_DISABLE_NATIVE") == "1":
        return None
    sources = sorted((_CSRC / "cpu").glob("*.cpp"))
    if not sources:
        return None
    headers = sorted((_CSRC / "cpu").glob("*.h"))
    try:
        from torch.utils.cpp_extension import load

        march = _march()
        module = load(name=f"vllm_cpu_ops_{_build_signature(sources + headers, march)}",
                      sources=[str(s) for s in sources],
                      extra_cflags=["-O3", f"-march={march}", "-fopenmp", "-ffast-math",
                                    "-fno-finite-math-only"],
                      extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, ...: the torch path still works
        logger.warning("Native CPU kernels unavailable (%s); using the torch fallback.", e)
        return None
    assert isinstance(module, ModuleType)  # is_python_module=True (the default): a module
    _register_fakes()
    return module


def native_ops(device) -> ModuleType | None:
    """The native kernels for tensors on `device` (a `torch.device`): CPU only."""
    return cpu_ops() if device.type == "cpu" else None


def _register_fakes() -> None:
    """Shapes of the registered operators (`torch.ops.vllm_cpu.*`) for graph tracing."""
    import torch

    @torch.library.register_fake("vllm_cpu::quant_gemv")
    def _(x, codes, d, m, bits):
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("vllm_cpu::gguf_mm")
    def _(x, w, type):
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake("vllm_cpu::gguf_dequantize")
    def _(blocks, type):
        from vllm.model_executor.layers.quantization.gguf_blocks import block_layout

        values, size = block_layout(type)
        return blocks.new_empty(blocks.shape[0], blocks.shape[1] // size * values,
                                dtype=torch.float32)

    @torch.library.register_fake("vllm_cpu::moe_experts")
    def _(x, topk_weights, topk_ids, w1, w3, w2, w1_type, w3_type, w2_type):
        return torch.empty_like(x)

    @torch.library.register_fake("vllm_cpu::int8_mm")
    def _(x, packed, n):
        return x.new_empty(x.shape[0], n, dtype=torch.int32)

    @torch.library.register_fake("vllm_cpu::lora_delta")
    def _(x, indices, ranks, a, b, part_bounds):
        return x.new_empty(x.shape[0], part_bounds[-1])
