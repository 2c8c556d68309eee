"""`quantization="gguf"`: GGUF Q4_0/Q4_1/Q8_0 blocks read exactly, the native block kernel
(`quant_gemv`) and torch's int4 kernel against the dequantized weight, the small-step /
large-step switch, and the drift on the default model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tests.quant_drift import greedy_runs, measure_drift
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.quantization.gguf_blocks import (
    MAX_ROWS,
    BlockCodes,
    GGUFLinear,
    _native_kernel,
    read_block_codes,
    row_switch_tokens,
)
from vllm.v1.worker.graph_capture import ANY_MIN_TOKENS

native = pytest.mark.skipif(_native_kernel() is None,
                            reason="quant_gemv needs the native kernels and AVX-512 VNNI "
                                   "or AVX2 with FMA and F16C")


def _q4_1_block(d: float, m: float, q: list[int]) -> bytes:
    nibbles = bytes((q[j] & 0xF) | (q[j + 16] << 4) for j in range(16))
    return np.float16(d).tobytes() + np.float16(m).tobytes() + nibbles


def test_read_q4_1_block() -> None:
    """One row of two blocks: w = d * q + m, nibble j low, j + 16 high."""
    q0, q1 = list(range(16)) * 2, [15 - (j % 16) for j in range(32)]
    raw = np.frombuffer(_q4_1_block(0.5, -2.0, q0) + _q4_1_block(0.25, 1.0, q1),
                        dtype=np.uint8)[None]
    codes = read_block_codes(raw, "Q4_1", 64)
    assert codes.bits == 4 and codes.u[0].tolist() == q0 + q1
    expected = [0.5 * v - 2.0 for v in q0] + [0.25 * v + 1.0 for v in q1]
    assert codes.dequantize()[0].tolist() == expected


def test_read_q4_0_block() -> None:
    q = [(3 * j) % 16 for j in range(32)]
    nibbles = bytes((q[j] & 0xF) | (q[j + 16] << 4) for j in range(16))
    raw = np.frombuffer(np.float16(2.0).tobytes() + nibbles, dtype=np.uint8)[None]
    codes = read_block_codes(raw, "Q4_0", 32)
    assert codes.dequantize()[0].tolist() == [2.0 * (v - 8) for v in q]


def test_read_q8_0_block() -> None:
    """Signed bytes become unsigned codes q + 128 with m = -128 d."""
    q = [(-1) ** j * (4 * j) for j in range(32)]  # -124 .. 124
    raw = np.frombuffer(np.float16(0.5).tobytes() + np.array(q, np.int8).tobytes(),
                        dtype=np.uint8)[None]
    codes = read_block_codes(raw, "Q8_0", 32)
    assert codes.bits == 8 and codes.u[0].tolist() == [v + 128 for v in q]
    assert codes.dequantize()[0].tolist() == [0.5 * v for v in q]


def _random_codes(n: int, k: int, bits: int, seed: int = 0) -> BlockCodes:
    rng = np.random.default_rng(seed)
    d = rng.uniform(0.01, 0.02, (n, k // 32)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.1, 0.1, (n, k // 32)).astype(np.float16).astype(np.float32)
    return BlockCodes(rng.integers(0, 2**bits, (n, k)).astype(np.uint8), d, m, bits)


def _quantized_rows_reference(x: torch.Tensor, codes: BlockCodes) -> torch.Tensor:
    """x quantized per row and block of 32 to int8 (absmax / 127, round half to even),
    times the dequantized weight, in float64: what the kernel computes. The codes come from
    the kernel's own float32 arithmetic (x * (127 / amax), both float32): a float64 product
    rounds differently where it lands next to a half, one code apart."""
    rows, k = x.shape
    blocks = x.float().view(rows, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    q = torch.round(blocks * (127 / amax)).nan_to_num(0).double()
    xq = (q * (amax / 127).double()).view(rows, k)
    return xq @ torch.from_numpy(codes.dequantize()).double().T


@native
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [128, 96, 576, 32, 160])  # padded: 96 to a quad of
# blocks; 576, 32, 160 to quads and a last half quad (4.5, 0.5, 1.5 quads)
def test_quant_gemv_equals_the_quantized_rows_reference(bits: int, k: int) -> None:
    n = 48
    codes = _random_codes(n, k, bits)
    layer = GGUFLinear(nn.Linear(k, n, bias=False), codes)
    assert layer.kernel == "quant_gemv"
    gen = torch.Generator().manual_seed(k * bits)
    for rows in range(1, MAX_ROWS + 1):
        x = torch.randn(rows, k, generator=gen)
        got = layer(x)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        ref = _quantized_rows_reference(x, codes)
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max())
        # Against the exact product: only the activations' rounding (~1/254 per block).
        exact = x.double() @ torch.from_numpy(codes.dequantize()).double().T
        assert (got.double() - exact).abs().max() <= 0.02 * exact.abs().max()
    # Past 8 rows the kernel runs passes over tiles of the weight: every row's result is
    # the bits it has alone (a verification step's rows equal one-token steps').
    alone = torch.cat([layer(row[None]) for row in x])
    assert torch.equal(got, alone)
    wide = torch.randn(32, k, generator=gen)  # the native limit, past the layer's MAX_ROWS
    got = torch.ops.vllm_cpu.quant_gemv(wide, layer.codes, layer.d, layer.m, bits)
    assert torch.allclose(got.double(), _quantized_rows_reference(wide, codes), rtol=1e-5,
                          atol=1e-5 * got.abs().max().item())
    bf16 = layer(x.to(torch.bfloat16))
    assert bf16.dtype == torch.bfloat16
    ref = _quantized_rows_reference(x.to(torch.bfloat16).float(), codes)
    assert (bf16.double() - ref).abs().max() <= 0.01 * ref.abs().max()  # bfloat16's rounding


@native
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [128, 576])  # whole quads; quads and a last half quad
def test_quant_gemv_large_steps(bits: int, k: int) -> None:
    """Past 32 rows quant_gemv runs passes of 32 (the layer keeps no dense weight for large
    steps): every row as the quantized-rows reference has it, and the bits it has alone."""
    n = 40
    codes = _random_codes(n, k, bits, seed=k + bits)
    layer = GGUFLinear(nn.Linear(k, n, bias=False), codes)
    assert layer.dense is None and layer.kernel == "quant_gemv"
    gen = torch.Generator().manual_seed(k * bits)
    x = torch.randn(69, k, generator=gen)
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (69, n)
    ref = _quantized_rows_reference(x, codes)
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max())
    assert torch.equal(got[40:], layer(x[40:]))
    low = layer(x.to(torch.bfloat16))
    assert low.dtype == torch.bfloat16
    ref = _quantized_rows_reference(x.to(torch.bfloat16).float(), codes)
    assert (low.double() - ref).abs().max() <= 0.01 * ref.abs().max()


@native
def test_quant_gemv_rejects_bad_inputs() -> None:
    layer = GGUFLinear(nn.Linear(64, 16, bias=False), _random_codes(16, 64, 4))
    with pytest.raises(RuntimeError, match="at least one row"):
        torch.ops.vllm_cpu.quant_gemv(torch.randn(0, 64), layer.codes, layer.d, layer.m, 4)
    with pytest.raises(RuntimeError, match="does not fit"):
        torch.ops.vllm_cpu.quant_gemv(torch.randn(1, 256), layer.codes, layer.d, layer.m, 4)


@pytest.mark.parametrize("use_native", [pytest.param(True, marks=native), False])
def test_gguf_linear_small_steps_match_the_dequantized_weight(use_native: bool) -> None:
    n, k = 32, 64
    codes = _random_codes(n, k, 4)
    linear = nn.Linear(k, n, bias=True).to(torch.bfloat16)
    linear.weight.data = torch.from_numpy(codes.dequantize()).to(torch.bfloat16)
    layer = GGUFLinear(linear, codes, native=use_native)
    assert layer.kernel == ("quant_gemv" if use_native else "int4pack")
    x = torch.randn(MAX_ROWS, k, dtype=torch.bfloat16)
    small = layer(x)  # the block kernel
    ref = x.float() @ torch.from_numpy(codes.dequantize()).T + linear.bias.float()
    assert torch.allclose(small.float(), ref, atol=0.05, rtol=0.02)
    big = layer(torch.cat([x, x]))
    if use_native:  # quant_gemv takes every step: the layer keeps no dense weight
        assert layer.dense is None
        assert torch.allclose(big.float(), torch.cat([ref, ref]), atol=0.05, rtol=0.02)
    else:  # the int4 kernel's large steps: the dense weight
        assert torch.equal(big, linear(torch.cat([x, x])))
    with pytest.raises(ValueError, match="do not fit"):
        GGUFLinear(nn.Linear(k, 48), codes, native=use_native)


def test_without_the_native_kernel_8_bit_codes_stay_dense() -> None:
    with pytest.raises(ValueError, match="no kernel for 8-bit"):
        GGUFLinear(nn.Linear(64, 32), _random_codes(32, 64, 8), native=False)


def test_row_switch_fits_the_graphs_any_size() -> None:
    """The CPU's ANY graphs of a model with GGUF layers take steps of more than MAX_ROWS
    tokens only, so a graph with a symbolic size never sees GGUFLinear's row switch;
    other models keep ANY_MIN_TOKENS."""
    codes = _random_codes(32, 64, 4)
    gguf = nn.Sequential(nn.Linear(64, 64), GGUFLinear(nn.Linear(64, 32, bias=False), codes,
                                                       native=False))
    assert row_switch_tokens(gguf) == MAX_ROWS
    assert row_switch_tokens(nn.Sequential(nn.Linear(64, 32))) == 0
    assert ANY_MIN_TOKENS < MAX_ROWS


def test_gguf_quantization_needs_a_gguf_file(tiny_llama_dir) -> None:
    with pytest.raises(ValueError, match="is not a .gguf file"):
        EngineArgs(tiny_llama_dir, quantization="gguf").create_engine_config()


@pytest.mark.slow
def test_gguf_drift_on_the_default_model_is_bounded(default_model_path) -> None:
    """One request at a time (every step takes the block kernel) against the dequantized
    bfloat16 model; bounds in the README ('Quantized weights')."""
    reference = greedy_runs(default_model_path, 16, dtype="bfloat16", quantization="none",
                            enforce_eager=True, max_num_seqs=1)
    candidate = greedy_runs(default_model_path, 16, dtype="bfloat16", quantization="gguf",
                            enforce_eager=True, max_num_seqs=1)
    drift = measure_drift(reference, candidate, first_n=4)
    assert drift.agreement >= 0.5
    assert drift.mean_common_prefix >= 5
    assert drift.mean_logprob_diff <= 0.3
