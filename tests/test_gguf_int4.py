"""`quantization="gguf"`: GGUF Q4_0/Q4_1 blocks read exactly, the int4 kernel against the
dequantized weight, the small-step/large-step switch, and the drift on the default model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tests.quant_drift import greedy_runs, measure_drift
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.quantization.gguf_int4 import (
    INT4_MAX_ROWS,
    Int4Codes,
    Int4Linear,
    read_q4_codes,
)


def _q4_1_block(d: float, m: float, q: list[int]) -> bytes:
    nibbles = bytes((q[j] & 0xF) | (q[j + 16] << 4) for j in range(16))
    return np.float16(d).tobytes() + np.float16(m).tobytes() + nibbles


def test_read_q4_1_block() -> None:
    """One row of two blocks: w = d * q + m, nibble j low, j + 16 high."""
    q0, q1 = list(range(16)) * 2, [15 - (j % 16) for j in range(32)]
    raw = np.frombuffer(_q4_1_block(0.5, -2.0, q0) + _q4_1_block(0.25, 1.0, q1),
                        dtype=np.uint8)[None]
    codes = read_q4_codes(raw, "Q4_1", 64)
    assert codes.q[0].tolist() == q0 + q1
    w = (codes.q.astype(np.float32) - 8) * np.repeat(codes.scale, 32, 1) \
        + np.repeat(codes.zero, 32, 1)
    expected = [0.5 * v - 2.0 for v in q0] + [0.25 * v + 1.0 for v in q1]
    assert w[0].tolist() == expected


def test_read_q4_0_block() -> None:
    q = [(3 * j) % 16 for j in range(32)]
    nibbles = bytes((q[j] & 0xF) | (q[j + 16] << 4) for j in range(16))
    raw = np.frombuffer(np.float16(2.0).tobytes() + nibbles, dtype=np.uint8)[None]
    codes = read_q4_codes(raw, "Q4_0", 32)
    w = (codes.q.astype(np.float32) - 8) * codes.scale[:, :1] + codes.zero[:, :1]
    assert w[0].tolist() == [2.0 * (v - 8) for v in q]


def test_int4_linear_small_steps_match_the_dequantized_weight() -> None:
    rng = np.random.default_rng(0)
    n, k = 32, 64
    codes = Int4Codes(rng.integers(0, 16, (n, k)).astype(np.uint8),
                      rng.uniform(0.01, 0.02, (n, k // 32)).astype(np.float32),
                      rng.uniform(-0.1, 0.1, (n, k // 32)).astype(np.float32))
    dense = (codes.q.astype(np.float32) - 8) * np.repeat(codes.scale, 32, 1) \
        + np.repeat(codes.zero, 32, 1)
    linear = nn.Linear(k, n, bias=True).to(torch.bfloat16)
    linear.weight.data = torch.from_numpy(dense).to(torch.bfloat16)
    layer = Int4Linear(linear, codes)
    x = torch.randn(INT4_MAX_ROWS, k, dtype=torch.bfloat16)
    small = layer(x)  # int4 kernel
    ref = x.float() @ torch.from_numpy(dense).T + linear.bias.float()
    assert torch.allclose(small.float(), ref, atol=0.05, rtol=0.02)
    big = layer(torch.cat([x, x]))  # dense path
    assert torch.equal(big, linear(torch.cat([x, x])))
    with pytest.raises(ValueError, match="do not fit"):
        Int4Linear(nn.Linear(k, 48), codes)


def test_gguf_quantization_needs_a_gguf_file(tiny_llama_dir) -> None:
    with pytest.raises(ValueError, match="is not a .gguf file"):
        EngineArgs(tiny_llama_dir, quantization="gguf").create_engine_config()


def test_gguf_int4_drift_on_the_default_model_is_bounded(default_model_path) -> None:
    """One request at a time (every step takes the int4 kernel) against the dequantized
    bfloat16 model; bounds in the README ('Quantized weights')."""
    reference = greedy_runs(default_model_path, 16, dtype="bfloat16", enforce_eager=True,
                            max_num_seqs=1)
    candidate = greedy_runs(default_model_path, 16, dtype="bfloat16", quantization="gguf",
                            enforce_eager=True, max_num_seqs=1)
    drift = measure_drift(reference, candidate, first_n=4)
    assert drift.agreement >= 0.5
    assert drift.mean_common_prefix >= 5
    assert drift.mean_logprob_diff <= 0.3
