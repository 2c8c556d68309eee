"""`quantization="int8"`: exact quantizer examples, batch independence, and the drift of the
default model against its unquantized self (numbers in the README)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.quant_drift import greedy_runs, measure_drift
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.quantization import Int8Linear
from vllm.model_executor.layers.quantization.int8 import (
    quantize_per_channel,
    quantize_per_token,
)


def test_quantize_per_channel_example() -> None:
    q, scale = quantize_per_channel(torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]]))
    assert q.dtype == torch.int8
    assert q.tolist() == [[64, -127, 32], [0, 0, 0]]
    assert scale[0].item() == pytest.approx(1 / 127)


def test_quantize_per_token_scales_each_row_by_its_own_absmax() -> None:
    q, scale = quantize_per_token(torch.tensor([[2.0, -1.0], [0.0, 0.5]]))
    assert q.tolist() == [[127, -64], [0, 127]]
    assert scale.flatten().tolist() == pytest.approx([2 / 127, 0.5 / 127])


def test_int8_linear_is_close_to_the_float_linear_and_batch_independent() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(5, 64)
    x[2] *= 100  # an outlier row must not change the other rows (per-token scales)
    quantized = Int8Linear(linear)
    y = quantized(x)
    ref = linear(x)
    assert torch.allclose(y, ref, rtol=0.05, atol=0.05 * ref.abs().max().item())
    for i in range(5):
        assert torch.equal(quantized(x[i:i + 1]), y[i:i + 1])


def test_int8_applies_to_every_linear_layer_but_the_vocabulary_projection(
        tiny_llama_dir) -> None:
    from vllm import LLM
    from vllm.model_executor.layers.linear import LinearBase

    llm = LLM(tiny_llama_dir, dtype="float32", quantization="int8", enforce_eager=True,
              kv_cache_memory_bytes=8 * 1024**2, max_model_len=64)
    model = llm.llm_engine.engine_core.model_executor.model_runner.model
    kernels = {name: type(m.kernel) for name, m in model.named_modules()
               if isinstance(m, LinearBase)}
    assert kernels.pop("lm_head") is type(None)
    assert kernels and set(kernels.values()) == {Int8Linear}
    assert model.layers[0].self_attn.qkv_proj.weight is None  # the int8 copy replaced it


def test_engine_args_check_quantization(tiny_llama_dir) -> None:
    with pytest.raises(ValueError, match="Unknown quantization 'fp8'"):
        EngineArgs(tiny_llama_dir, quantization="fp8").create_engine_config()
    with pytest.raises(ValueError, match="runs on CPU only"):
        EngineArgs(tiny_llama_dir, quantization="int8", device="cuda").create_engine_config()
    config = EngineArgs(tiny_llama_dir, quantization="int8").create_engine_config()
    assert config.model_config.quantization == "int8"


@pytest.mark.slow
def test_int8_drift_on_the_default_model_is_bounded(default_model_path) -> None:
    """Bounds measured drift with a margin (README: 'Quantized weights'): per-token int8
    activations are the main source; a broken kernel would share no prefix at all. Where
    greedy paths part is decided by near-ties, so the prefix moves with the CPU's float
    rounding: 12 prompts gave a mean prefix of 4.83 (logprob diff mean 0.105, max 0.53) on
    an AVX2-only CPU, more on the AVX-512 one; the logprob bounds are the tighter check."""
    reference = greedy_runs(default_model_path, 16, dtype="float32")
    candidate = greedy_runs(default_model_path, 16, dtype="float32", quantization="int8")
    drift = measure_drift(reference, candidate, first_n=4)
    assert drift.agreement >= 0.5
    assert drift.mean_common_prefix >= 4
    assert drift.mean_logprob_diff <= 0.3
    assert drift.max_logprob_diff <= 1.5
