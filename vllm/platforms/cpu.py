"""The CPU's abilities: its flags from /proc/cpuinfo, and the model dtype they call for.

`dtype="auto"` on CPU is bfloat16 only where the processor multiplies bfloat16 natively
(AMX tiles, or the AVX512-BF16 dot-product instructions); elsewhere bfloat16 matmuls are
emulated by widening to float32, and float32 itself is the faster choice (~2.5x on an
AVX-512 CPU without AVX512-BF16).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

CPUINFO_PATH = "/proc/cpuinfo"


class DtypeChoice(NamedTuple):
    dtype: torch.dtype
    reason: str


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The `flags` of the first processor in a /proc/cpuinfo text (x86: `flags`,
    ARM: `Features`).

    Example: "processor : 0\\nflags : fpu avx512f avx512_bf16\\n" -> {fpu, avx512f, avx512_bf16}
    """
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def read_cpu_flags(path: str = CPUINFO_PATH) -> frozenset[str]:
    """This machine's CPU flags; empty where /proc/cpuinfo cannot be read (not Linux)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse_cpu_flags(f.read())
    except OSError:
        return frozenset()


def choose_cpu_dtype(flags: Iterable[str]) -> DtypeChoice:
    """bfloat16 where the CPU multiplies it natively, float32 elsewhere, with the reason."""
    flags = set(flags)
    if {"amx_bf16", "amx_tile"} <= flags:
        return DtypeChoice(torch.bfloat16, "the CPU multiplies bfloat16 natively (AMX)")
    if "avx512_bf16" in flags:
        return DtypeChoice(torch.bfloat16,
                           "the CPU multiplies bfloat16 natively (AVX512-BF16)")
    return DtypeChoice(torch.float32, "the CPU has no native bfloat16 matmul (no AMX, no "
                                      "AVX512-BF16), so float32 is faster")
