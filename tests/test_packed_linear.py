"""`PackedLinear` (oneDNN-packed bfloat16 weights): bit-identical to `nn.Linear` eagerly and
inside a compiled graph, swapped in for every linear of a Llama model in bfloat16 on CPU
(the tied vocabulary projection included) without changing a single token; where oneDNN
refuses the bfloat16 reorder (AVX2-only CPUs), layers keep `F.linear`, equally exact. The
float32 vocabulary projection is packed too: within float rounding of `F.linear`, and each
row's logits independent of the batch and of a tensor-parallel rank's slice."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vllm.model_executor.model_loader.loader as loader
from vllm import LLM, SamplingParams
from vllm.model_executor.layers.linear import LinearBase, ReplicatedLinear
from vllm.model_executor.layers.packed_linear import (
    PackedLinear,
    can_pack,
    can_pack_float32,
)
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

PACKS = can_pack(torch.bfloat16, torch.device("cpu"))
packs = pytest.mark.skipif(
    not PACKS, reason="no oneDNN bfloat16 reorder: it needs AVX-512 BW+VL+DQ or "
                      "AVX-NE-CONVERT (or a torch build with oneDNN); [unpacked] checks the "
                      "F.linear path layers take here")
# "packed" where oneDNN reorders bfloat16 weights; "unpacked" the path the loader takes
# where it refuses (here on AVX2), forced where it would not.
PATHS = [pytest.param("packed", marks=packs), "unpacked"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bias", [False, True])
@torch._dynamo.config.patch(recompile_limit=64)  # a graph per size
def test_kernel_equals_linear_for_every_row_count(path: str, bias: bool) -> None:
    """A bfloat16 layer's kernel after loading (packed: `PackedLinear`; unpacked: none,
    `F.linear` on the weight) is bit-identical to `nn.Linear`, eagerly and compiled."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 80, bias=bias).to(torch.bfloat16)
    layer = ReplicatedLinear(96, 80, bias=bias)
    layer.weight.data = linear.weight.data.clone()
    if bias:
        layer.bias.data = linear.bias.data.clone()
    kind = layer.process_weights_after_loading(None, pack=path == "packed")
    assert kind == ("packed" if path == "packed" else "dense")
    assert isinstance(layer.kernel, PackedLinear) if path == "packed" else layer.kernel is None
    compiled = torch.compile(layer, dynamic=False, fullgraph=True)
    with torch.inference_mode():
        for rows in (1, 3, 8, 64, 300):
            x = torch.randn(rows, 96, dtype=torch.bfloat16)
            assert torch.equal(layer(x), linear(x))
            assert torch.equal(compiled(x), linear(x))


def test_only_bfloat16_on_cpu_is_packed() -> None:
    assert not can_pack(torch.float32, torch.device("cpu"))
    assert not can_pack(torch.bfloat16, torch.device("cuda"))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
def test_packing_follows_the_cpu_flags() -> None:
    """oneDNN's bfloat16 reorder raises on CPUs without AVX-512 BW/VL/DQ or AVX-NE-CONVERT
    (an AVX2-only CPU), so such a CPU keeps `F.linear`."""
    cpu = torch.device("cpu")
    avx2 = frozenset({"avx", "avx2", "fma", "f16c"})
    assert not can_pack(torch.bfloat16, cpu, cpu_flags=avx2)
    assert not can_pack(torch.bfloat16, cpu, cpu_flags=avx2 | {"avx512f", "avx512bw"})
    assert can_pack(torch.bfloat16, cpu, cpu_flags=avx2 | {"avx512bw", "avx512vl", "avx512dq"})
    assert can_pack(torch.bfloat16, cpu, cpu_flags=avx2 | {"avx_ne_convert"})


@pytest.mark.slow  # an engine: left out of `make test-fast`
def test_unpacked_model_keeps_f_linear(tiny_llama_tied_dir, monkeypatch) -> None:
    """Where packing is refused (here, or forced where it would not be), the loader installs
    no `PackedLinear`: every linear of the bfloat16 model runs `F.linear` on its weight."""
    if PACKS:
        monkeypatch.setattr(loader, "can_pack", lambda dtype, device: False)
    llm = LLM(tiny_llama_tied_dir, dtype="bfloat16", enforce_eager=True,
              kv_cache_memory_bytes=16 * 1024**2, max_model_len=256)
    model = llm.llm_engine.engine_core.model_executor.model_runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert model.lm_head in linears and model.layers[0].self_attn.qkv_proj in linears
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    x = torch.randn(5, model.layers[0].self_attn.qkv_proj.in_features, dtype=torch.bfloat16)
    for layer in (model.lm_head, model.layers[0].self_attn.qkv_proj):
        assert layer.kernel is None and layer.weight.dtype == torch.bfloat16
        with torch.inference_mode():
            assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate(["Hello world"], params, use_tqdm=False)[0].outputs[0]
               .token_ids) == 4


@pytest.mark.slow  # an engine: left out of `make test-fast`
@packs
def test_packed_model_gives_the_same_tokens(tiny_llama_tied_dir, monkeypatch) -> None:
    prompts = ["Hello world, this is", "The capital of France is", "A"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)

    def run() -> tuple[LLM, list]:
        llm = LLM(tiny_llama_tied_dir, dtype="bfloat16", enforce_eager=True,
                  kv_cache_memory_bytes=16 * 1024**2, max_model_len=256)
        return llm, llm.generate(prompts, params, use_tqdm=False)

    llm, packed = run()
    model = llm.llm_engine.engine_core.model_executor.model_runner.model
    assert isinstance(model.lm_head.kernel, PackedLinear)
    assert isinstance(model.layers[0].self_attn.qkv_proj.kernel, PackedLinear)
    monkeypatch.setattr(loader, "can_pack", lambda dtype, device: False)
    _, plain = run()
    for a, b in zip(packed, plain, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in d.items()} for d in a.outputs[0].logprobs] == \
            [{t: lp.logprob for t, lp in d.items()} for d in b.outputs[0].logprobs]


ONEDNN = pytest.mark.skipif(not can_pack_float32(torch.device("cpu")),
                            reason="this torch build has no oneDNN: the float32 head keeps "
                                   "F.linear")


@ONEDNN
def test_float32_head_rows_do_not_depend_on_the_batch_or_the_slice() -> None:
    """What greedy decoding and tensor parallelism need of the packed float32 head: row i's
    logits are the same bits alone, in a batch of any size and from half the vocabulary
    (one rank's rows); and within float32 rounding of MKL's `F.linear`."""
    torch.manual_seed(0)
    vocab, hidden = 1000, 96
    weight = torch.randn(vocab, hidden) * 0.1
    head = ParallelLMHead(vocab, hidden)
    head.weight.data.copy_(weight)
    assert head.process_weights_after_loading(None, pack=False) == "packed"
    assert isinstance(head.kernel, PackedLinear) and head.weight is None  # untied: one copy
    half = ParallelLMHead(vocab // 2, hidden)
    half.weight.data.copy_(weight[:vocab // 2])
    half.process_weights_after_loading(None, pack=False)
    x = torch.randn(300, hidden)
    with torch.inference_mode():
        full = head.compute_logits(x)
        torch.testing.assert_close(full, nn.functional.linear(x, weight), atol=1e-5, rtol=1e-5)
        for rows in (1, 3, 7, 64):
            assert torch.equal(head.compute_logits(x[:rows]), full[:rows])
        assert torch.equal(half.compute_logits(x), full[:, :vocab // 2])


@ONEDNN
@pytest.mark.slow  # an engine: left out of `make test-fast`
def test_float32_model_packs_its_head_and_keeps_the_tied_table(tiny_llama_tied_dir) -> None:
    llm = LLM(tiny_llama_tied_dir, dtype="float32", enforce_eager=True,
              kv_cache_memory_bytes=16 * 1024**2, max_model_len=256)
    model = llm.llm_engine.engine_core.model_executor.model_runner.model
    assert isinstance(model.lm_head.kernel, PackedLinear)
    assert model.layers[0].self_attn.qkv_proj.kernel is None  # the layers keep F.linear
    assert model.embed_tokens.weight is not None and model.embed_tokens.weight.dtype == \
        torch.float32  # tied: the embedding still looks rows up in the dense table
