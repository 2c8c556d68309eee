"""`quantization="int8"`: exact quantizer examples, the kernel each processor takes (torch's
int8 GEMM with VNNI or AMX, the native `int8_mm` without, equal to it bit for bit; Q8_0
blocks through `gguf_mm` on request), batch independence, and the drift of the default model
against its unquantized self in both forms (numbers in docs/speed.md)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.quant_drift import DRIFT_PROMPTS, greedy_runs, measure_drift
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.packed_linear import PackedLinear
from vllm.model_executor.layers.quantization import Int8Linear
from vllm.model_executor.layers.quantization.gguf_blocks import (
    GGUFBlockLinear,
    gguf_mm_available,
)
from vllm.model_executor.layers.quantization.int8 import (
    FORM_ENV,
    has_int8_dot,
    int8_form,
    int8_kernel,
    native_int8_mm,
    quantize_per_channel,
    quantize_per_token,
)

FORMS = ["int_mm", pytest.param("q8_0", marks=pytest.mark.skipif(
    not gguf_mm_available(), reason="Q8_0 int8 needs gguf_mm (AVX2 with FMA and F16C)"))]


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


def _built_int8_mm():
    """The native kernels' module where `int8_mm` was built (AVX2), else None."""
    from vllm._custom_ops import cpu_ops

    ops = cpu_ops()
    return ops if ops is not None and ops.int8_mm_available() else None


def _int8_mm_ops():
    """`_built_int8_mm()`, else skip, naming why."""
    ops = _built_int8_mm()
    if ops is None:
        pytest.skip("int8_mm needs the native kernels built with AVX2")
    return ops


@pytest.mark.parametrize("m,n,k", [(1, 16, 4), (1, 17, 9), (3, 33, 64), (4, 16, 3),
                                   (7, 40, 130), (64, 48, 576), (70, 100, 33)])
def test_int8_mm_equals_torch_int_mm_exactly(m, n, k) -> None:
    """Every row remainder (4-row tiles and 1-3 rows left), column tails past whole tiles of
    16, k past whole steps of 4, and extreme values: -128 weights and +-127 activations (the
    range `quantize_per_token` gives) at every position."""
    ops = _int8_mm_ops()
    torch.manual_seed(m * 1000 + n + k)
    x = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    x[0], w[0] = 127, -128
    if m > 1:
        x[1] = -127
    ref = x.int() @ w.int().t()
    got = torch.ops.vllm_cpu.int8_mm(x, ops.pack_int8_weight(w), n)
    assert got.dtype == torch.int32 and torch.equal(got, ref)
    # a slice (strided rows) multiplies as its contiguous copy
    wide = torch.randint(-127, 128, (m, k + 8), dtype=torch.int8)
    assert torch.equal(torch.ops.vllm_cpu.int8_mm(wide[:, :k], ops.pack_int8_weight(w), n),
                       wide[:, :k].int() @ w.int().t())


def test_int8_mm_refuses_a_weight_of_another_shape() -> None:
    ops = _int8_mm_ops()
    packed = ops.pack_int8_weight(torch.zeros(32, 64, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="not 40 columns of 64 inputs"):
        torch.ops.vllm_cpu.int8_mm(torch.zeros(2, 64, dtype=torch.int8), packed, 40)
    with pytest.raises(RuntimeError, match="x must be int8"):
        torch.ops.vllm_cpu.int8_mm(torch.zeros(2, 64), packed, 32)


def test_int8_linear_gives_the_same_bits_on_either_kernel(monkeypatch) -> None:
    """The native `int8_mm` and torch's `_int_mm` (a reference loop without VNNI) hold the
    same int32 sums, so a layer's output is the same bits on every processor."""
    from vllm.model_executor.layers.quantization import int8

    _int8_mm_ops()
    torch.manual_seed(0)
    linear = nn.Linear(96, 40)
    x = torch.randn(6, 96)
    layer = Int8Linear(linear)
    if not layer.native:
        pytest.skip("this processor has int8 dot products: _int_mm is the kernel")
    monkeypatch.setattr(int8, "native_int8_mm", lambda: None)
    reference = Int8Linear(linear)
    assert not reference.native
    assert torch.equal(layer(x), reference(x))


def test_int8_form_follows_the_request(monkeypatch) -> None:
    """`Int8Linear` everywhere (its product is `_int_mm` or the native `int8_mm`, the same
    sums); Q8_0 blocks only when `VLLM_CPU_INT8_FORM` asks and gguf_mm can run them."""
    monkeypatch.delenv(FORM_ENV, raising=False)
    assert int8_form(576) == "int_mm"
    assert int8_form(48) == "int_mm"
    monkeypatch.setenv(FORM_ENV, "q8_0")
    assert int8_form(576) == ("q8_0" if gguf_mm_available() else "int_mm")
    assert int8_form(48) == "int_mm"  # not whole blocks of 32
    monkeypatch.setenv(FORM_ENV, "int_mm")
    assert int8_form(576) == "int_mm"
    monkeypatch.setenv(FORM_ENV, "fast")
    with pytest.raises(ValueError, match="VLLM_CPU_INT8_FORM='fast'"):
        int8_form(576)
    # the product: torch's where the processor has int8 dot products, else the native one
    assert (native_int8_mm() is None) == (has_int8_dot() or _built_int8_mm() is None)


@pytest.mark.skipif(not gguf_mm_available(), reason="gguf_mm not built on this CPU")
def test_q8_0_row_parallel_shards_are_the_whole_rows_blocks(monkeypatch) -> None:
    """Without VNNI a row-parallel shard takes Q8_0 too: a slice of whole blocks of 32 holds
    the whole row's blocks byte for byte (each block's scale is its own 32 weights'), the
    activations are quantized per 32 alike, so the shards' products sum to the whole row's
    but for the order of the float sums."""
    from vllm.model_executor.layers.quantization.gguf_blocks import quantize_q8_0

    monkeypatch.setenv(FORM_ENV, "q8_0")
    torch.manual_seed(0)
    weight, x = torch.randn(40, 128), torch.randn(3, 128)
    whole = quantize_q8_0(weight)
    halves = [quantize_q8_0(weight[:, :64]), quantize_q8_0(weight[:, 64:])]
    assert torch.equal(torch.cat(halves, dim=1), whole)
    parts = []
    for h in range(2):
        shard = nn.Linear(64, 40, bias=False).requires_grad_(False)
        shard.weight.copy_(weight[:, 64 * h:64 * (h + 1)])
        kernel, name = int8_kernel(shard, lambda: pytest.fail("a Q8_0 shard reads no absmax"))
        assert name == "int8 as Q8_0"
        parts.append(kernel(x[:, 64 * h:64 * (h + 1)]))
    linear = nn.Linear(128, 40, bias=False).requires_grad_(False)
    linear.weight.copy_(weight)
    full, _ = int8_kernel(linear)
    torch.testing.assert_close(parts[0] + parts[1], full(x), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not gguf_mm_available(), reason="gguf_mm not built on this CPU")
def test_q8_0_int8_is_close_to_the_float_linear_and_batch_independent(monkeypatch) -> None:
    monkeypatch.setenv(FORM_ENV, "q8_0")
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(5, 64)
    x[2] *= 100
    quantized, name = int8_kernel(linear)
    assert isinstance(quantized, GGUFBlockLinear) and name == "int8 as Q8_0"
    y = quantized(x)
    ref = linear(x).detach()
    assert torch.allclose(y, ref, rtol=0.02, atol=0.02 * ref.abs().max().item())
    for i in range(5):
        assert torch.equal(quantized(x[i:i + 1]), y[i:i + 1])


@pytest.mark.parametrize("form", FORMS)
def test_int8_applies_to_every_linear_layer_but_the_vocabulary_projection(
        tiny_llama_dir, form, monkeypatch) -> None:
    from vllm import LLM
    from vllm.model_executor.layers.linear import LinearBase

    monkeypatch.setenv(FORM_ENV, form)

    llm = LLM(tiny_llama_dir, dtype="float32", quantization="int8", enforce_eager=True,
              kv_cache_memory_bytes=8 * 1024**2, max_model_len=64)
    model = llm.llm_engine.engine_core.model_executor.model_runner.model
    kernels = {name: type(m.kernel) for name, m in model.named_modules()
               if isinstance(m, LinearBase)}
    # The vocabulary projection stays float32 (in oneDNN's layout where it is built).
    assert kernels.pop("lm_head") in (type(None), PackedLinear)
    assert model.lm_head.kernel is None or model.lm_head.kernel.packed_weight.dtype == \
        torch.float32
    assert kernels and set(kernels.values()) == {
        Int8Linear if form == "int_mm" else GGUFBlockLinear}
    assert model.layers[0].self_attn.qkv_proj.weight is None  # the int8 copy replaced it


def test_engine_args_check_quantization(tiny_llama_dir) -> None:
    with pytest.raises(ValueError, match="Unknown quantization 'fp8'"):
        EngineArgs(tiny_llama_dir, quantization="fp8").create_engine_config()
    with pytest.raises(ValueError, match="runs on CPU only"):
        EngineArgs(tiny_llama_dir, quantization="int8", device="cuda").create_engine_config()
    config = EngineArgs(tiny_llama_dir, quantization="int8").create_engine_config()
    assert config.model_config.quantization == "int8"


def test_a_gguf_file_keeps_its_blocks_unless_told_otherwise(default_model_path) -> None:
    """As llama.cpp and Ollama run it: a .gguf file's own block types by default on CPU;
    `"none"` widens every tensor to dtype; on another device (no block kernels) None."""
    def resolved(**kwargs) -> str | None:
        config = EngineArgs(default_model_path, **kwargs).create_engine_config()
        return config.model_config.quantization

    assert resolved() == "gguf"
    assert resolved(quantization="gguf") == "gguf"
    assert resolved(quantization="none") is None
    assert resolved(quantization="int8") == "int8"
    assert EngineArgs._resolve_quantization(None, "cuda", default_model_path) is None
    # A draft model's file resolves the same way; the user's config keeps "none".
    for asked, resolved_to in ((None, "gguf"), ("none", None)):
        spec = {"method": "draft_model", "model": default_model_path,
                "num_speculative_tokens": 2, "quantization": asked}
        config = EngineArgs(default_model_path, speculative_config=spec).create_engine_config()
        assert config.speculative_config is not None
        draft = config.speculative_config.draft_model_config
        assert draft is not None and draft.quantization == resolved_to
        assert spec["quantization"] == asked
    with pytest.raises(ValueError, match="choose one of int8, gguf, none"):
        resolved(quantization="q4")


@pytest.fixture(scope="module")
def float32_runs(default_model_path) -> list[tuple[list[int], list[float]]]:
    """The default model's unquantized greedy runs, the reference of both int8 forms.
    Eager engines: the drift is the weights' and activations' quantization, not the graphs'
    (tests/test_graph_capture.py holds graphs against eager)."""
    return greedy_runs(default_model_path, 16, dtype="float32", quantization="none",
                       enforce_eager=True)


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_int8_drift_on_the_default_model_is_bounded(default_model_path, float32_runs, form,
                                                    monkeypatch) -> None:
    """Bounds measured drift with a margin (README: 'Quantized weights'): per-token int8
    activations are the main source; a broken kernel would share no prefix at all. Where
    greedy paths part is decided by near-ties, so the prefix moves with the CPU's float
    rounding: 12 prompts gave a mean prefix of 4.83 (logprob diff mean 0.105, max 0.53) on
    an AVX2-only CPU, more on the AVX-512 one; the logprob bounds are the tighter check.
    On a processor without int8 dot products `_int_mm` is torch's reference loop (about a
    minute for the twelve prompts on a Zen 3), and not the form that processor's layers
    take: its drift there is measured on the first six prompts."""
    prompts = DRIFT_PROMPTS
    if form == "int_mm" and native_int8_mm() is None and not has_int8_dot():
        prompts = DRIFT_PROMPTS[:6]
    monkeypatch.setenv(FORM_ENV, form)
    reference = float32_runs[:len(prompts)]
    candidate = greedy_runs(default_model_path, 16, prompts, dtype="float32",
                            quantization="int8", enforce_eager=True)
    drift = measure_drift(reference, candidate, first_n=4)
    assert drift.agreement >= 0.5
    assert drift.mean_common_prefix >= 4
    assert drift.mean_logprob_diff <= 0.3
    assert drift.max_logprob_diff <= 1.5
