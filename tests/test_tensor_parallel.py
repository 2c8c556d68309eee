"""Tensor parallel: two ranks (one thread each) give what one rank gives, in float32: the
same greedy tokens, logprobs within 1e-4, the same hidden states, for every model family
and feature; the sharding arithmetic exactly; bad sizes refused at start-up."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import types
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tests.model_factory import make_tiny_model
from vllm import LLM, SamplingParams
from vllm.distributed.utils import (
    check_tp_divisibility,
    cpus_for_rank,
    kv_head_start,
    kv_heads_per_rank,
)
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.quantization.int8 import FORM_ENV

PROMPTS = ["Hello world, this is", "The capital of France is", "A", "one two three four five"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
LOGPROB_TOL = 1e-4
# int8 as Q8_0 blocks (`VLLM_CPU_INT8_FORM=q8_0`, and MoE experts in int8): a row-parallel
# layer's ranks add their blocks' products in float in another order than one rank does, so
# the residual differs in its last bits, and an activation on a rounding edge takes the next
# Q8_0 code in a later layer. The logprobs of the step it happens in move (measured 0.0007 to
# 0.014: once in 7 prompt sets of the Qwen2 test, when it ran that form); the tokens stay.
# The `int_mm` form's int32 sums over the ranks are exact (torch's `_int_mm` or the native
# `int8_mm`), held to LOGPROB_TOL.
Q8_0_LOGPROB_TOL = 0.05


def _llm(path: str, tp: int, **kwargs) -> LLM:
    """Eager unless a test asks for graphs: sharding does not depend on them, and graphs
    under tp 2 are the subject of the mixed-batches test alone."""
    kwargs.setdefault("enforce_eager", True)
    kwargs.setdefault("kv_cache_memory_bytes", 8 * 1024**2)
    kwargs.setdefault("max_model_len", 128)
    return LLM(path, dtype="float32", tensor_parallel_size=tp, **kwargs)


def _assert_same(ones, twos, tol: float = LOGPROB_TOL) -> None:
    for a, b in zip(ones, twos, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids
            for lx, ly in zip(x.logprobs or [], y.logprobs or [], strict=True):
                assert lx.keys() == ly.keys()
                for t in lx:
                    assert abs(lx[t].logprob - ly[t].logprob) < tol


def _run_both(path: str, prompts, params=GREEDY, preemptions: list | None = None, **kwargs):
    outputs = []
    for tp in (1, 2):
        llm = _llm(path, tp, **kwargs)
        outputs.append(llm.generate(prompts, params, use_tqdm=False))
        if preemptions is not None:
            preemptions.append(llm.llm_engine.engine_core.scheduler.num_preemptions)
        llm.llm_engine.engine_core.shutdown()
        del llm
    return outputs


# ---- the arithmetic ---------------------------------------------------------------------


@contextlib.contextmanager
def _as_rank(rank: int, size: int) -> Iterator[None]:
    """Layers built inside see themselves as `rank` of `size` (no process group: only
    their shard arithmetic runs)."""
    from vllm.distributed import parallel_state

    group = types.SimpleNamespace(rank_in_group=rank, world_size=size)
    original = parallel_state._TP
    parallel_state._TP = group  # type: ignore[assignment]
    try:
        yield
    finally:
        parallel_state._TP = original


def test_kv_heads_split_or_replicated() -> None:
    # 4 KV heads over 2 ranks: 2 each, rank 1 from head 2.
    assert kv_heads_per_rank(4, 2) == 2 and kv_head_start(4, 2, 1) == 2
    # 2 KV heads over 4 ranks: one replicated head each, ranks 0-1 head 0, ranks 2-3 head 1.
    assert kv_heads_per_rank(2, 4) == 1
    assert [kv_head_start(2, 4, r) for r in range(4)] == [0, 0, 1, 1]


def test_cpu_binding_lists() -> None:
    assert cpus_for_rank("auto", 1, 2, available=list(range(16))) == list(range(8, 16))
    assert cpus_for_rank("0-3,8|4-7", 0, 2) == [0, 1, 2, 3, 8]
    assert cpus_for_rank("0-3,8|4-7", 1, 2) == [4, 5, 6, 7]
    assert cpus_for_rank("nobind", 0, 2) is None
    assert cpus_for_rank(None, 0, 1) is None
    with pytest.raises(ValueError, match="lists 1 core sets for 2 ranks"):
        cpus_for_rank("0-3", 0, 2)


def test_parallel_layers_shard_a_checkpoint_exactly() -> None:
    """Each rank's slice of fused q/k/v (KV replicated at tp 4 over 2 KV heads), of a
    row-parallel weight and of a padded vocabulary, from the rank's point of view."""
    from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    head = 2
    q = torch.arange(4 * head, dtype=torch.float32)[:, None].expand(-1, 3)  # 4 heads
    k = 100 + torch.arange(2 * head, dtype=torch.float32)[:, None].expand(-1, 3)  # 2 heads
    with _as_rank(3, 4):
        layer = QKVParallelLinear(3, head, 4, 2, bias=False)
        row = RowParallelLinear(8, 2, bias=False)
    assert layer.weight is not None and row.weight is not None
    for part, tensor in (("q", q), ("k", k), ("v", k + 100)):
        layer.weight_loader(layer.weight, tensor, part)
    # rank 3 of 4: query head 3 (rows 6, 7), the replicated KV head 1 (rows 2, 3).
    assert layer.weight[:, 0].tolist() == [6, 7, 102, 103, 202, 203]
    row.weight_loader(row.weight, torch.arange(16.0).view(2, 8))
    assert row.weight.tolist() == [[6, 7], [14, 15]]
    with _as_rank(1, 2):
        embed = VocabParallelEmbedding(5, 2)  # padded to 6: rank 1 holds ids 3, 4 and a pad
    embed.weight.weight_loader(embed.weight,  # type: ignore[attr-defined]
                               torch.arange(10.0).view(5, 2))
    assert embed.weight.tolist() == [[6, 7], [8, 9], [0, 0]]


# ---- start-up errors --------------------------------------------------------------------


def test_heads_that_do_not_divide_are_refused(tiny_llama_dir) -> None:
    with pytest.raises(ValueError, match="4 attention heads cannot be split across "
                                         "tensor_parallel_size=3"):
        EngineArgs(tiny_llama_dir, tensor_parallel_size=3).create_engine_config()
    config = make_config(hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ValueError, match="3 key/value heads cannot be split across "
                                         "tensor_parallel_size=2"):
        check_tp_divisibility(config, 2)


def make_config(**overrides):
    from tests.model_factory import tiny_model_config

    return tiny_model_config("llama", 64, **overrides)


def test_more_ranks_than_cores_is_refused(tiny_llama_dir, monkeypatch) -> None:
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with pytest.raises(ValueError, match="4 CPU ranks .* need a core each, but this process "
                                         "may use 2"):
        EngineArgs(tiny_llama_dir, tensor_parallel_size=4).create_engine_config()
    with pytest.raises(ValueError, match="needs 'mp' or 'ray'"):
        EngineArgs(tiny_llama_dir, tensor_parallel_size=2,
                   distributed_executor_backend="uni").create_engine_config()


def test_ray_not_installed_is_refused(tiny_llama_dir, monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ValueError, match="needs Ray, which is not installed"):
        EngineArgs(tiny_llama_dir, tensor_parallel_size=2,
                   distributed_executor_backend="ray").create_engine_config()


# ---- two ranks equal one ----------------------------------------------------------------


@pytest.mark.slow
def test_llama_prompt_embeds_mixed_batches_hidden_states_and_graphs(tiny_llama_dir) -> None:
    """4 heads / 2 KV heads, graphs on: text, prompt embeds and both in one batch, with the
    hidden states returned once, equal across tp 1 and 2."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    embeds = [hf.get_input_embeddings()(torch.tensor(tok(p).input_ids)).detach()
              for p in PROMPTS[:2]]
    prompts = [*PROMPTS, *({"prompt_embeds": e} for e in embeds)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3,
                            return_hidden_states=True)
    # Graphs of the sizes these steps take: every decode step holds the 6 rows (padded to
    # 8), the prefill runs the ANY graphs; both sets, on one rank and on each of two.
    ones, twos = _run_both(tiny_llama_dir, prompts, params, enable_prompt_embeds=True,
                           enable_return_hidden_states=True, enforce_eager=False,
                           compilation_config={"cudagraph_capture_sizes": [8]})
    _assert_same(ones, twos)
    for a, b in zip(ones, twos):
        ha, hb = a.outputs[0].hidden_states, b.outputs[0].hidden_states
        assert ha is not None and hb is not None and ha.shape == hb.shape
        torch.testing.assert_close(ha, hb, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_llama_one_kv_head_replicated_eager(tmp_path) -> None:
    """4 heads / 1 KV head: each rank keeps a copy of the only KV head; graphs off; a
    chunked prefill, a prefix-cache hit and preemptions (a cache of 40 blocks for ~80
    blocks of requests) on the way; random sampling, seeded and not, draws the same tokens
    on every rank as on one."""
    path = make_tiny_model(str(tmp_path / "mqa"), "llama", num_key_value_heads=1)
    long = " ".join(["word"] * 40)
    prompts = [long, long + " again", *PROMPTS, *PROMPTS]
    random = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24,
                            ignore_eos=True, logprobs=3)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    unseeded = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, logprobs=3)
    # Unseeded rows draw from the global generator, which every rank (and one rank) reseeds
    # after set-up: ranks that drew differently would feed different tokens on.
    params = [greedy] * 6 + [random] * 2 + [unseeded] * 2
    preemptions: list[int] = []
    ones, twos = _run_both(path, prompts, params, preemptions,
                           max_num_batched_tokens=32, block_size=4,
                           num_gpu_blocks_override=40)
    assert preemptions[0] > 0 and preemptions[0] == preemptions[1]
    _assert_same(ones, twos)


def _mostly_copying_llama(path: str) -> str:
    """A tiny tied-embeddings Llama whose layers' outputs are scaled down (o_proj and
    down_proj x 0.6), so its greedy text falls into repeats now and then: prompt lookup's
    drafts are sometimes accepted and sometimes rejected (a random model never repeats)."""
    from safetensors.torch import load_file, save_file

    make_tiny_model(path, "llama", tie_word_embeddings=True)
    (file,) = (os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    weights = load_file(file)
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * 0.6
    save_file(weights, file, metadata={"format": "pt"})
    return path


@pytest.mark.slow
def test_prompt_lookup_speculation_equals_one_rank(tmp_path) -> None:
    """ngram speculation under tp 2: a verification step is one forward of 1 + k rows per
    request on every rank; greedy and seeded random rows, drafts accepted and rejected,
    come out as on one rank, and greedy as without speculation."""
    path = _mostly_copying_llama(str(tmp_path / "copying"))
    prompts = ["Hello world, this is", "The capital of France is"] * 2
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True,
                            logprobs=3)
    params = [greedy, greedy, seeded, seeded]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    outputs, counts = [], []
    for tp in (1, 2):
        llm = _llm(path, tp, speculative_config=spec)
        outputs.append(llm.generate(prompts, params, use_tqdm=False))
        metrics = {m.name: m for m in llm.get_metrics()}
        counts.append([metrics[f"vllm:spec_decode_num_{what}_tokens"].value  # type: ignore[attr-defined]
                       for what in ("draft", "accepted")])
        llm.llm_engine.engine_core.shutdown()
        del llm
    drafted, accepted = counts[0]
    assert 0 < accepted < drafted and counts[0] == counts[1]
    _assert_same(*outputs)
    plain = _llm(path, 1).generate(prompts[:2], greedy, use_tqdm=False)
    _assert_same(outputs[1][:2], plain)


@pytest.mark.slow
def test_qwen2_biases_int8(tiny_qwen2_dir, monkeypatch) -> None:
    """Qwen2's q/k/v biases sharded with their rows; int8 (`int_mm`: `_int_mm` or the
    native `int8_mm`) as on one rank: row-parallel shards scale by their whole rows' absmax
    and sum int32 accumulators exactly. (The opt-in Q8_0 form's shards are the whole rows'
    blocks: test_quantization's layer-level check; its float sum over the ranks at engine
    level: test_moe's OLMoE experts.)"""
    ones, twos = _run_both(tiny_qwen2_dir, PROMPTS)
    _assert_same(ones, twos)
    monkeypatch.setenv(FORM_ENV, "int_mm")  # the spawned ranks inherit it
    ones, twos = _run_both(tiny_qwen2_dir, PROMPTS, quantization="int8")
    _assert_same(ones, twos)


@pytest.mark.slow
def test_bart_and_whisper(tiny_bart_dir, tiny_whisper_dir) -> None:
    """Encoder/decoder: encoder heads, decoder self- and cross-attention heads sharded; the
    cross K/V each rank writes are its heads'."""
    ones, twos = _run_both(tiny_bart_dir, PROMPTS, block_size=4)
    _assert_same(ones, twos)
    t = np.arange(16000 * 2) / 16000
    audio = [(0.3 * np.sin(2 * np.pi * f * t)).astype(np.float32) for f in (220.0, 440.0)]
    prompts = [{"prompt": "", "multi_modal_data": {"audio": (a, 16000)}} for a in audio]
    ones, twos = _run_both(tiny_whisper_dir, prompts, max_model_len=64)
    _assert_same(ones, twos)


@pytest.mark.parametrize("layer_kind", ["row", "qkv"])
def test_gguf_block_codes_shard_like_their_weights(layer_kind: str) -> None:
    """GGUF codes go through the layers' own slicing: the ranks' quantized products put
    together (summed for a row-parallel layer, concatenated per part for q/k/v) equal the
    one-rank layer's, up to float summation order."""
    from tests.test_gguf_blocks import _random_codes
    from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear

    def build(rank: int, size: int):
        with _as_rank(rank, size):
            if layer_kind == "row":
                layer = RowParallelLinear(256, 64, bias=False)
            else:
                layer = QKVParallelLinear(64, 16, 4, 2, bias=False)  # q 64 rows, k/v 32 each
        if layer_kind == "row":
            parts = [(None, _random_codes(64, 256, 4))]
        else:
            parts = [("q", _random_codes(64, 64, 4, seed=1)),
                     ("k", _random_codes(32, 64, 4, seed=2)),
                     ("v", _random_codes(32, 64, 4, seed=3))]
        assert layer.weight is not None
        for shard_id, codes in parts:
            dense = torch.from_numpy(codes.dequantize())
            layer.weight_loader(layer.weight, dense, shard_id)
            layer.add_block_codes(codes, shard_id)
        kind = layer.process_weights_after_loading("gguf", pack=False)
        return layer, kind

    x = torch.randn(3, 256 if layer_kind == "row" else 64,
                    generator=torch.Generator().manual_seed(0))
    one, kind = build(0, 1)
    assert kind.startswith("gguf")
    reference = one.linear(x, None)
    ranks = [build(r, 2)[0] for r in range(2)]
    if layer_kind == "row":
        got = sum(layer.linear(x[:, r * 128:(r + 1) * 128], None)
                  for r, layer in enumerate(ranks))
    else:  # rank r: q heads 2r, 2r+1 (32 rows), k head r, v head r (16 rows each)
        outs = [layer.linear(x, None) for layer in ranks]
        got = torch.cat([torch.cat([o[:, :32] for o in outs], 1),
                         torch.cat([o[:, 32:48] for o in outs], 1),
                         torch.cat([o[:, 48:] for o in outs], 1)], 1)
    torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_numa_placement_and_memory_binding() -> None:
    """`auto` with two visible nodes: ranks fill the nodes in order and split each node's
    cores; `CPU_VISIBLE_MEMORY_NODES` must name nodes that exist; binding memory to this
    machine's node 0 (in a child process) sets an MPOL_BIND policy on it."""
    import subprocess
    import sys

    from vllm.distributed.utils import memory_node_for_rank, visible_memory_nodes

    nodes = {0: list(range(8)), 1: list(range(8, 16))}
    visible = visible_memory_nodes(nodes, env="")
    assert visible == [0, 1]
    assert [memory_node_for_rank(r, 4, visible) for r in range(4)] == [0, 0, 1, 1]
    place = [cpus_for_rank("auto", r, 4, available=list(range(16)), nodes=nodes,
                           visible=visible) for r in range(4)]
    assert place == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert visible_memory_nodes({0: [0, 1]}, env="") is None  # one node: nothing to place
    assert visible_memory_nodes(nodes, env="1") == [1]
    with pytest.raises(ValueError, match=r"names NUMA node\(s\) \[2\]"):
        visible_memory_nodes(nodes, env="0,2")
    probe = ("import ctypes, platform\n"
             "from vllm.distributed.utils import bind_memory_to_node\n"
             "bind_memory_to_node(0)\n"
             "mode, mask = ctypes.c_int(), ctypes.c_ulong()\n"
             "number = {'x86_64': 239, 'aarch64': 236}[platform.machine()]\n"
             "libc = ctypes.CDLL(None)\n"
             "assert libc.syscall(number, ctypes.byref(mode), ctypes.byref(mask), 64, 0, 0) == 0\n"
             "print(mode.value, mask.value)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["2", "1"]  # MPOL_BIND, node 0




@pytest.mark.slow
def test_olmo2_sharded_qk_norms_int8(tmp_path, monkeypatch) -> None:
    """OLMo-2's q/k norm over the whole projection: its sum of squares all-reduced, with
    one KV head that each rank holds a replica of (counted half by each); int8 layers in
    the `int_mm` form, whose sums over the ranks are exact (Q8_0's: test_moe's experts)."""
    monkeypatch.setenv(FORM_ENV, "int_mm")
    path = make_tiny_model(str(tmp_path / "olmo2"), "olmo2", num_key_value_heads=1)
    ones, twos = _run_both(path, PROMPTS, quantization="int8")
    _assert_same(ones, twos)
