"""`dtype="auto"` on CPU follows the processor's flags; explicit dtypes are honoured."""

from __future__ import annotations

import logging

import pytest
import torch

from vllm.config import resolve_dtype
from vllm.platforms.cpu import choose_cpu_dtype, parse_cpu_flags, read_cpu_flags

AVX512_VNNI = {"fpu", "sse2", "avx2", "avx512f", "avx512bw", "avx512_vnni"}


def test_parse_cpu_flags_reads_the_first_processor() -> None:
    text = ("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx512f avx512_bf16\n\n"
            "processor\t: 1\nflags\t\t: fpu\n")
    assert parse_cpu_flags(text) == {"fpu", "avx512f", "avx512_bf16"}
    assert parse_cpu_flags("Features\t: fp asimd bf16\n") == {"fp", "asimd", "bf16"}
    assert parse_cpu_flags("") == frozenset()


def test_read_cpu_flags_of_a_missing_file_is_empty(tmp_path) -> None:
    assert read_cpu_flags(str(tmp_path / "nope")) == frozenset()


@pytest.mark.parametrize(("flags", "dtype", "why"), [
    (AVX512_VNNI | {"amx_tile", "amx_bf16", "amx_int8"}, torch.bfloat16, "AMX"),
    (AVX512_VNNI | {"avx512_bf16"}, torch.bfloat16, "AVX512-BF16"),
    (AVX512_VNNI, torch.float32, "no native bfloat16"),
    (AVX512_VNNI | {"amx_tile", "amx_int8"}, torch.float32, "no native bfloat16"),
    (set(), torch.float32, "no native bfloat16"),
])
def test_choose_cpu_dtype_from_flags(flags: set[str], dtype: torch.dtype, why: str) -> None:
    choice = choose_cpu_dtype(flags)
    assert choice.dtype == dtype
    assert why in choice.reason


def test_auto_on_cpu_follows_the_flags_and_logs_why(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="vllm.config"):
        assert resolve_dtype("auto", "cpu", AVX512_VNNI) == torch.float32
        assert resolve_dtype("auto", "cpu", AVX512_VNNI | {"avx512_bf16"}) == torch.bfloat16
    assert "dtype auto -> float32 on CPU: the CPU has no native bfloat16" in caplog.text
    assert "dtype auto -> bfloat16 on CPU: the CPU multiplies bfloat16 natively" in caplog.text


def test_explicit_dtypes_are_honoured_whatever_the_cpu() -> None:
    assert resolve_dtype("bfloat16", "cpu", AVX512_VNNI) == torch.bfloat16
    assert resolve_dtype("float32", "cpu", {"amx_tile", "amx_bf16"}) == torch.float32
    assert resolve_dtype(torch.float16, "cpu", AVX512_VNNI) == torch.float16
    assert resolve_dtype("auto", "cuda", AVX512_VNNI) == torch.float16
    with pytest.raises(ValueError, match="Unknown dtype"):
        resolve_dtype("int8", "cpu")
