"""LoRA adapters: PEFT parity (float32: greedy tokens equal the merged PEFT model's,
logprobs within 1e-4) on tiny Llama / Qwen2 and the default model, batches mixing adapters
and the base model, more adapters than slots, preemption, chunked prefill, prompt embeds,
graphs, prefix-cache separation; bad adapters; the slot / CPU-cache manager and the
scheduler's slot limit exactly."""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import cast

import numpy as np
import pytest
import torch

from tests.core_factories import make_request, make_scheduler
from tests.hf_reference import assert_identical_greedy, hf_greedy, load_hf_model
from tests.lora_utils import make_adapter, merged_model
from tests.model_factory import make_tiny_model
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
from vllm.model_executor.layers.packed_linear import can_pack
from vllm.v1.request import RequestStatus

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> (rank, alpha, targets, rslora): several ranks and target sets
SPECS = {
    "all8": (8, 16, ALL, False),
    "qdown4_rs": (4, 8, ("q_proj", "down_proj"), True),
    "kvo2": (2, 4, ("k_proj", "v_proj", "o_proj"), False),
    "gateup8": (8, 8, ("gate_proj", "up_proj"), False),
}


def _adapters(base: str, root: str, names: list[str]) -> dict[str, LoRARequest]:
    out = {}
    for i, name in enumerate(names):
        rank, alpha, targets, rslora = SPECS[name]
        path = make_adapter(base, os.path.join(root, name), rank=rank, alpha=alpha,
                            targets=targets, use_rslora=rslora, seed=10 + i)
        out[name] = LoRARequest(name, i + 1, path)
    return out


def _reference(base: str, lora: LoRARequest | None, prompt_ids: list[int] | None,
               max_tokens: int, embeds: torch.Tensor | None = None):
    model = load_hf_model(base) if lora is None else merged_model(base, lora.lora_path)
    return hf_greedy(model, prompt_ids, max_tokens, inputs_embeds=embeds)


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.model_executor.model_runner  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def llama_loras(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory):
    root = str(tmp_path_factory.mktemp("llama_loras"))
    return _adapters(tiny_llama_dir, root, list(SPECS))


@pytest.fixture(scope="module")
def llama_llm(tiny_llama_dir: str, llama_loras) -> LLM:
    """Two slots for four adapters, three of them on the CPU; a small KV cache (preemption)
    and token budget (chunked prefill); prompt embeds and hidden states on; eager."""
    return LLM(tiny_llama_dir, dtype="float32", enable_lora=True, max_loras=2,
               max_lora_rank=8, max_cpu_loras=3, enforce_eager=True,
               enable_prompt_embeds=True, enable_return_hidden_states=True, block_size=4,
               num_gpu_blocks_override=17, max_model_len=64, max_num_batched_tokens=24)


def test_mixed_batch_of_four_adapters_and_base_equals_merged_peft(
        tiny_llama_dir: str, llama_loras, llama_llm: LLM) -> None:
    names = [*SPECS, None, *SPECS, None]
    loras = [None if n is None else llama_loras[n] for n in names]
    prompts = [[5 + 7 * i + j for j in range(6 + 2 * i)] for i in range(len(names))]
    embeds_index = 2  # this prompt goes in as embeds rows, with its adapter
    embeds = load_hf_model(tiny_llama_dir).get_input_embeddings()(
        torch.tensor(prompts[embeds_index])).detach()
    inputs: list = [{"prompt_token_ids": p} for p in prompts]
    inputs[embeds_index] = {"prompt_embeds": embeds}
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=1)
    core = llama_llm.llm_engine.engine_core
    preemptions = core.scheduler.num_preemptions
    outputs = llama_llm.generate(inputs, params, lora_request=loras, use_tqdm=False)
    refs = [_reference(tiny_llama_dir, lora, None if i == embeds_index else prompt, 10,
                       embeds if i == embeds_index else None)
            for i, (lora, prompt) in enumerate(zip(loras, prompts))]
    assert_identical_greedy(outputs, refs)
    assert core.scheduler.num_preemptions > preemptions  # the small cache preempted
    manager = _runner(llama_llm).lora_manager
    assert len(manager.cpu_cache) <= 3 and len(manager.slots) == 2
    # Each adapter really changes the output (the references differ from the base's).
    base_ref = _reference(tiny_llama_dir, None, prompts[0], 10)
    assert refs[0].token_ids != base_ref.token_ids


def test_tensor_parallel_shards_adapters_like_their_layers(tiny_llama_dir: str,
                                                          llama_loras) -> None:
    """Two ranks: A and B sliced with their layers (q/k/v and gate/up parts by rows, o and
    down by input columns with the partial x A^T all-reduced), equal to the merged model."""
    llm = LLM(tiny_llama_dir, dtype="float32", tensor_parallel_size=2, enable_lora=True,
              max_loras=2, max_lora_rank=8, enforce_eager=True, max_model_len=128,
              kv_cache_memory_bytes=8 * 2**20)
    loras = [llama_loras["all8"], llama_loras["qdown4_rs"], None]
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22], [30, 31, 32, 33]]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                           lora_request=loras, use_tqdm=False)
    assert_identical_greedy(outputs, [_reference(tiny_llama_dir, lora, p, 8)
                                      for lora, p in zip(loras, prompts)])


def test_bad_adapters_are_clear_errors(tiny_llama_dir: str, llama_loras, llama_llm: LLM,
                                       tmp_path) -> None:
    params = SamplingParams(max_tokens=2)

    def fails(lora: LoRARequest, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            llama_llm.generate("hello", params, lora_request=lora, use_tqdm=False)

    big = make_adapter(tiny_llama_dir, str(tmp_path / "big"), rank=16)
    fails(LoRARequest("big", 90, big), "rank 16, over max_lora_rank=8")
    deep = _renamed_adapter(llama_loras["all8"].lora_path, str(tmp_path / "deep"),
                            "layers.1.", "layers.7.")  # the model has 2 layers
    fails(LoRARequest("deep", 91, deep),
          r"targets .model\.layers\.7\.\S+, which the base model lacks")
    fused = _renamed_adapter(llama_loras["all8"].lora_path, str(tmp_path / "fused"),
                             "q_proj", "c_attn")
    fails(LoRARequest("fused", 95, fused), "targets 'model.layers.0.self_attn.c_attn'")
    other = make_tiny_model(str(tmp_path / "other"), "llama", hidden_size=32,
                            intermediate_size=64)
    foreign = make_adapter(other, str(tmp_path / "foreign"))
    fails(LoRARequest("foreign", 92, foreign), r"q_proj.lora_A.weight has shape \(8, 32\)")
    missing = str(tmp_path / "missing")
    shutil.copytree(llama_loras["all8"].lora_path, missing)
    os.remove(os.path.join(missing, "adapter_model.safetensors"))
    fails(LoRARequest("missing", 93, missing), "has no adapter_model.safetensors")
    fails(LoRARequest("nowhere", 94, str(tmp_path / "nowhere")), "does not exist")
    with pytest.raises(ValueError, match="Got 1 LoRA requests for 2 prompts"):
        llama_llm.generate(["a", "b"], params, lora_request=[llama_loras["all8"]])
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("zero", 0, big)
    # The engine still serves after the refusals.
    assert llama_llm.generate("hello", params, use_tqdm=False)[0].outputs[0].token_ids


def _renamed_adapter(source: str, target: str, old: str, new: str) -> str:
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    path = os.path.join(target, "adapter_model.safetensors")
    save_file({k.replace(old, new): v for k, v in load_file(path).items()}, path)
    return target


def test_structured_output_with_an_adapter(llama_loras, llama_llm: LLM) -> None:
    from vllm.sampling_params import StructuredOutputsParams

    choices = ["the quick fox", "a lazy dog"]
    params = SamplingParams(max_tokens=16, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    outputs = llama_llm.generate(["hello there", "once upon"], params, use_tqdm=False,
                                 lora_request=[llama_loras["all8"], llama_loras["kvo2"]])
    assert all(o.outputs[0].text in choices for o in outputs)


def test_n_children_and_hidden_states_with_an_adapter(tiny_llama_dir: str, llama_loras,
                                                     llama_llm: LLM) -> None:
    """Every child of an `n > 1` request runs through the request's adapter, and its hidden
    states are the merged model's."""
    params = SamplingParams(n=2, max_tokens=6, temperature=0.0, logprobs=1,
                            return_hidden_states=True)
    loras = [llama_loras["all8"], llama_loras["gateup8"]]
    prompts = [[9, 10, 11, 12, 13], [40, 41, 42]]
    outputs = llama_llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 lora_request=loras, use_tqdm=False)
    for output, lora, prompt in zip(outputs, loras, prompts):
        ref = _reference(tiny_llama_dir, lora, prompt, 6)
        assert len(output.outputs) == 2
        assert_identical_greedy([dataclasses.replace(output, outputs=[child])
                                 for child in output.outputs], [ref, ref])
        assert ref.token_ids != _reference(tiny_llama_dir, None, prompt, 6).token_ids
        with torch.inference_mode():
            hf_out = merged_model(tiny_llama_dir, lora.lora_path)(
                input_ids=torch.tensor([prompt + ref.token_ids[:-1]]),
                output_hidden_states=True)
        for child in output.outputs:
            assert child.hidden_states is not None
            torch.testing.assert_close(child.hidden_states, hf_out.hidden_states[-1][0],
                                       atol=1e-4, rtol=0)


def test_rewritten_adapter_files_get_fresh_kv(tiny_llama_dir: str, llama_loras,
                                             llama_llm: LLM, tmp_path) -> None:
    """An adapter removed and read again under the same id and path after its files changed
    never reuses the K/V its old weights computed (block hashes include the files'
    fingerprint)."""
    path = str(tmp_path / "rewritten")
    shutil.copytree(llama_loras["all8"].lora_path, path)
    lora = LoRARequest("rewritten", 40, path)
    prompt = {"prompt_token_ids": list(range(50, 62))}  # three full blocks of 4
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1)
    llama_llm.generate(prompt, params, lora_request=lora, use_tqdm=False)
    again = llama_llm.generate(prompt, params, lora_request=lora, use_tqdm=False)[0]
    assert again.num_cached_tokens == 8  # the same files: the prefix is reused
    core = llama_llm.llm_engine.engine_core
    assert core.remove_lora(40)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(os.path.join(llama_loras["kvo2"].lora_path, name),
                        os.path.join(path, name))
    fresh = llama_llm.generate(prompt, params, lora_request=lora, use_tqdm=False)[0]
    assert fresh.num_cached_tokens == 0
    assert_identical_greedy([fresh], [_reference(tiny_llama_dir, llama_loras["kvo2"],
                                                 prompt["prompt_token_ids"], 4)])


def test_lora_off_refuses_an_adapter(tiny_llama_dir: str, llama_loras) -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.processor import Processor

    config = EngineArgs(model=tiny_llama_dir, dtype="float32").create_engine_config()
    processor = Processor(config.model_config, None)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        processor.process_inputs("r", {"prompt_token_ids": [5, 6]}, SamplingParams(),
                                 lora_request=llama_loras["all8"])
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineArgs(model=tiny_llama_dir, enable_lora=True, max_loras=4,
                   max_cpu_loras=2).create_engine_config()


def test_qwen2_graphs_and_prefix_cache_separation(tiny_qwen2_dir: str, tmp_path) -> None:
    loras = _adapters(tiny_qwen2_dir, str(tmp_path), ["all8", "kvo2"])
    llm = LLM(tiny_qwen2_dir, dtype="float32", enable_lora=True, max_loras=4,
              max_lora_rank=8, compilation_config={"cudagraph_capture_sizes": [4]})
    prompt = {"prompt_token_ids": list(range(5, 29))}  # 24 tokens: one full block of 16
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)
    order = [loras["all8"], loras["kvo2"], loras["all8"], None]
    outputs = [llm.generate(prompt, params, lora_request=lora, use_tqdm=False)[0]
               for lora in order]
    refs = [_reference(tiny_qwen2_dir, lora, prompt["prompt_token_ids"], 6) for lora in order]
    assert_identical_greedy(outputs, refs)
    # Blocks computed through one adapter serve only that adapter.
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 16, 0]
    # A batch mixing both adapters and the base model, through the graphs.
    graphs = _runner(llm).graphs
    before = sum(graphs.replays.values())
    mixed = llm.generate([{"prompt_token_ids": [7, 8, 9]}] * 3, params,
                         lora_request=[loras["kvo2"], None, loras["all8"]], use_tqdm=False)
    assert sum(graphs.replays.values()) > before
    assert_identical_greedy(mixed, [_reference(tiny_qwen2_dir, lora, [7, 8, 9], 6)
                                    for lora in (loras["kvo2"], None, loras["all8"])])


def test_default_model_with_an_adapter(default_model_path: str, tmp_path) -> None:
    path = make_adapter(default_model_path, str(tmp_path / "smol"), rank=8,
                        targets=("q_proj", "v_proj", "down_proj"), std=0.05)
    lora = LoRARequest("smol", 1, path)
    llm = LLM(default_model_path, dtype="float32", quantization="none", enable_lora=True,
              max_lora_rank=8, enforce_eager=True, max_model_len=128,
              kv_cache_memory_bytes=32 * 2**20)
    tokenizer = llm.get_tokenizer()
    ids = tokenizer("The capital of France is")["input_ids"]
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1)
    outputs = llm.generate({"prompt_token_ids": ids}, params, lora_request=lora,
                           use_tqdm=False)
    assert_identical_greedy(outputs, [_reference(default_model_path, lora, ids, 4)])


# ---- the slot / CPU-cache manager and the LoRA layer, exactly --------------------------------


def test_manager_slots_lru_and_layer_product(tiny_llama_dir: str, llama_loras) -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.lora.manager import LoRAModelManager
    from vllm.model_executor.model_loader.loader import get_model
    from vllm.v1.attention.backends import get_attn_backend

    config = EngineArgs(model=tiny_llama_dir, dtype="float32", enable_lora=True, max_loras=2,
                        max_lora_rank=8, max_cpu_loras=3).create_engine_config()
    assert config.lora_config is not None
    model = get_model(config.model_config, get_attn_backend(None), torch.device("cpu"))
    base_qkv = model.layers[0].self_attn.qkv_proj  # type: ignore[attr-defined]
    manager = LoRAModelManager(cast(torch.nn.Module, model), config.lora_config,
                               config.model_config.hf_config, 16, torch.device("cpu"),
                               torch.float32)
    assert len(manager.layers) == 2 * 4  # qkv, o, gate_up, down per layer
    a1, a2, a3, a4 = (llama_loras[n] for n in SPECS)
    manager.set_step([a1, None, a2], np.array([2, 1, 3]))
    assert manager.slots == [1, 2]
    assert manager.state.indices[:8].tolist() == [0, 0, -1, 1, 1, 1, -1, -1]
    assert manager.state.active
    # a3 takes the slot of a2 (not needed by this step); a1 keeps its slot.
    manager.set_step([a3, a1], np.array([1, 1]))
    assert manager.slots == [1, 3] and manager.state.indices[:3].tolist() == [1, 0, -1]
    assert manager.list_loras() == [1, 2, 3]
    manager.add_lora(a4)  # the least recently used adapter in no slot goes: a2
    assert manager.list_loras() == [1, 3, 4]
    with pytest.raises(RuntimeError, match="3 adapters, over max_loras=2"):
        manager.set_step([a1, a3, a4], np.array([1, 1, 1]))
    manager.set_step([None, None], np.array([2, 2]))
    assert not manager.state.active and manager.state.indices.max().item() == -1
    # The layer: rows with an adapter add x A^T (scaling B)^T per q/k/v part; others are
    # exactly the base layer's output.
    layer = model.layers[0].self_attn.qkv_proj  # type: ignore[attr-defined]
    assert layer.base_layer is base_qkv
    manager.set_step([a1, None, a3], np.array([1, 1, 1]))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out, base = layer(x), base_qkv(x)
    assert torch.equal(out[1], base[1])
    for row, lora in ((0, a1), (2, a3)):
        weights = manager.cpu_cache[lora.lora_int_id].weights
        assert weights is not None
        expected = []
        for part in ("q_proj", "k_proj", "v_proj"):
            pair = weights.get(f"model.layers.0.self_attn.{part}")
            size = 64 if part == "q_proj" else 32
            expected.append(torch.zeros(size) if pair is None else pair[1] @ (pair[0] @ x[row]))
        torch.testing.assert_close(out[row] - base[row], torch.cat(expected), atol=1e-5,
                                   rtol=1e-5)
    assert manager.remove_lora(1) and manager.slots == [None, 3]


def _lora_request(request_id: str, lora_id: int | None):
    request = make_request(request_id, [1, 2, 3, 4], max_tokens=4)
    lora = None if lora_id is None else LoRARequest(f"a{lora_id}", lora_id, "/nowhere")
    return dataclasses.replace(request, lora_request=lora)


def test_scheduler_never_schedules_more_adapters_than_slots() -> None:
    scheduler = make_scheduler()
    scheduler.config.max_loras = 2
    for request_id, lora_id in (("r1", 1), ("r2", 2), ("r3", 3), ("r4", 1), ("r5", None),
                                ("r6", 2)):
        scheduler.add_request(_lora_request(request_id, lora_id))
    out = scheduler.schedule()
    # r3 needs a third slot and waits; r4 and r6 (running adapters) wait behind it so that
    # it cannot starve; the base-model request goes ahead.
    assert list(out.num_scheduled_tokens) == ["r1", "r2", "r5"]
    assert [r.request_id for r in scheduler.waiting] == ["r3", "r4", "r6"]
    scheduler.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)
    out = scheduler.schedule()
    # A slot is free: r3 takes it; r4 (adapter 1) would need a third one; r6 waits behind.
    assert [r.req_id for r in out.scheduled_new_reqs] == ["r3"]
    assert [r.request_id for r in scheduler.waiting] == ["r4", "r6"]
    scheduler.finish_requests(["r2", "r3"], RequestStatus.FINISHED_ABORTED)
    out = scheduler.schedule()
    assert [r.req_id for r in out.scheduled_new_reqs] == ["r4", "r6"]
    assert out.scheduled_new_reqs[0].lora_request == LoRARequest("a1", 1, "/nowhere")


def _kernel_reference(x: torch.Tensor, indices: list[int], a: torch.Tensor, b: torch.Tensor,
                      bounds: list[int], rank: int) -> torch.Tensor:
    """float64 delta: row i through slot s = indices[i], part p: B[p's rows, s] (A[p, s] x_i)
    (xa rounded to x's dtype between the two, as the kernel's bfloat16 path does).
    a [P, L, rank, K], b [N, L, rank]."""
    out = torch.zeros(len(indices), bounds[-1], dtype=torch.float64)
    for i, slot in enumerate(indices):
        for p in range(len(bounds) - 1):
            if slot >= 0:
                xa = (a[p, slot].double() @ x[i].double()).to(x.dtype).double()
                out[i, bounds[p]:bounds[p + 1]] = b[bounds[p]:bounds[p + 1], slot].double() @ xa
    return out


def _lora_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """"native": skip where the kernel is not built (it needs AVX-512); "portable": layers
    built from here on take the traced product over all slots, as on such CPUs."""
    from vllm.lora import layers

    if path == "portable":
        monkeypatch.setattr(layers, "native_kernel_step", lambda *args: None)
    elif layers.native_kernel_step(torch.float32, torch.device("cpu"), 64) is None:
        pytest.skip("no AVX-512 (avx512f): the native LoRA kernel is not built; "
                    "[portable] checks the product the layers take")


LORA_PATHS = ["native", "portable"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", LORA_PATHS)
def test_lora_delta_against_float64(path: str, dtype: torch.dtype,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """native: `vllm_cpu::lora_delta` (packed by `pack_slot_a` / `pack_slot_b`); portable:
    a fused layer's `delta` over slots written by `set_slot` (the masked product over all
    slots). Rows of several adapters and none, ranks below the maximum (odd ones too), an
    empty slot and a slot whose rank is 0, parts whose bounds are not multiples of 16,
    ranks over 16 lanes."""
    from vllm.lora.layers import (
        LoRALinear,
        LoRAState,
        native_kernel_step,
        pack_slot_a,
        pack_slot_b,
    )
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    _lora_path(path, monkeypatch)
    generator = torch.Generator().manual_seed(0)
    for in_features, bounds, max_rank, slot_ranks, indices in (
            (64, [0, 40, 52, 64], 8, [8, 3, 0, 5], [0, -1, 3, 0, 1, 1, 0, 0, 0, 0, 0, 0, 3,
                                                    -1, 0, 0, 0, 1]),
            (96, [0, 23, 50], 20, [20, 17, 1], [1, 1, -1, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1]),
            (32, [0, 16], 4, [4, 0], [1, 0, -1])):
        parts, slots = len(bounds) - 1, len(slot_ranks)
        a = torch.zeros(parts, slots, max_rank, in_features)
        b = torch.zeros(bounds[-1], slots, max_rank)
        for slot, rank in enumerate(slot_ranks):
            a[:, slot, :rank] = torch.randn(parts, rank, in_features, generator=generator)
            b[:, slot, :rank] = torch.randn(bounds[-1], rank, generator=generator)
        a, b = a.to(dtype), b.to(dtype)
        x = torch.randn(len(indices), in_features, generator=generator).to(dtype)
        index_buffer = torch.tensor(indices + [5, 5], dtype=torch.int64)  # past n: unread
        if path == "native":
            step = native_kernel_step(dtype, torch.device("cpu"), in_features)
            assert step is not None
            padded = -(-max_rank // 16) * 16
            a_packed = torch.stack([pack_slot_a(a[:, s], padded, step) for s in range(slots)],
                                   1)
            b_packed = torch.stack([pack_slot_b(b[:, s], padded, step) for s in range(slots)])
            got = torch.ops.vllm_cpu.lora_delta(x, index_buffer, torch.tensor(slot_ranks),
                                                a_packed.contiguous(), b_packed, bounds)
        else:
            base = MergedColumnParallelLinear(
                in_features, [hi - lo for lo, hi in zip(bounds, bounds[1:])], bias=False)
            state = LoRAState(len(indices) + 2, slots, max_rank, torch.device("cpu"))
            layer = LoRALinear(base, list(range(parts)), slots, max_rank, state, dtype)
            assert layer.step is None
            for slot, rank in enumerate(slot_ranks):
                if rank:
                    layer.set_slot(slot, [(a[p, slot, :rank], b[first:last, slot, :rank])
                                          for p, (first, last) in
                                          enumerate(zip(bounds, bounds[1:]))])
                elif slot == 2:  # the first case's rank-0 slot: an adapter of no part
                    layer.set_slot(slot, [None] * parts)
                # (the last case's slot 1 is never written: empty)
            state.indices.copy_(index_buffer)
            got = layer.delta(x)
        want = _kernel_reference(x, indices, a, b, bounds, max_rank)
        scale = want.abs().max().item()
        assert got.dtype == dtype and got.shape == want.shape and scale > 1
        rtol = 1e-5 if dtype == torch.float32 else 2 ** -8  # bfloat16: one ulp
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=rtol * scale)
        assert not got[[i for i, s in enumerate(indices) if slot_ranks[s] == 0 or s < 0]].any()
    if path == "native":
        with pytest.raises(RuntimeError, match="row 1 has slot 2, not in"):
            torch.ops.vllm_cpu.lora_delta(x[:2], torch.tensor([0, 2]),
                                          torch.tensor(slot_ranks), a_packed.contiguous(),
                                          b_packed, bounds)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", LORA_PATHS)
def test_layer_product_against_float64(path: str, dtype: torch.dtype,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU layer's product (native: the kernel over slots packed by `set_slot`;
    portable: the traced product over all slots) against the adapters' product in float64,
    for q/k/v parts of different sizes, ranks below max_rank, a part an adapter leaves
    alone, a slot rewritten with a smaller adapter, an empty slot. Natively it also equals
    the traced product."""
    from vllm.lora.layers import LoRALinear, LoRAState
    from vllm.model_executor.layers.linear import QKVParallelLinear

    _lora_path(path, monkeypatch)
    generator = torch.Generator().manual_seed(0)
    base = QKVParallelLinear(32, 8, 4, 2, bias=False)  # q 32 rows, k and v 16 each
    assert base.weight is not None
    base.weight.data.copy_(torch.randn(base.weight.shape, generator=generator))
    base.weight.data = base.weight.data.to(dtype)
    base.process_weights_after_loading(None, pack=can_pack(dtype, torch.device("cpu")))
    state = LoRAState(8, 4, 4, torch.device("cpu"))
    layer = LoRALinear(base, ["q", "k", "v"], 4, 4, state, dtype)
    assert (layer.step is None) == (path == "portable")
    assert layer.part_rows == [(0, 32), (32, 16), (48, 16)]

    def adapter(rank: int, skip: str | None = None):
        return [(torch.randn(rank, 32, generator=generator),
                 torch.randn(out, rank, generator=generator)) if part != skip else None
                for part, out in (("q", 32), ("k", 16), ("v", 16))]

    written = {}
    for slot, rank, skip in ((0, 4, None), (1, 2, "v"), (3, 4, None), (3, 3, "q")):
        written[slot] = adapter(rank, skip)
        layer.set_slot(slot, written[slot])  # slot 3 rewritten, slot 2 left empty
    if path == "native":
        assert layer.slot_ranks.tolist() == [4, 2, 0, 3]
    x = torch.randn(5, 32, generator=generator).to(dtype)
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -8  # bfloat16: one ulp
    for slots in ([0, -1, 0, 0, -1], [1, 0, -1, 1, 0], [3, 1, 0, -1, 3], [2, 3, 2, 1, 0]):
        state.indices[:5] = torch.tensor(slots)
        with torch.inference_mode():
            got = layer.delta(x)
        # Row i: per part, B (A x_i) (x A^T rounded to x's dtype, as both products do).
        want = torch.zeros(5, 64, dtype=torch.float64)
        for i, slot in enumerate(slots):
            for (first, count), pair in zip(layer.part_rows, written.get(slot, [None] * 3)):
                if slot >= 0 and pair is not None:
                    a, b = (t.to(dtype).double() for t in pair)
                    xa = (a @ x[i].double()).to(dtype).double()
                    want[i, first:first + count] = b @ xa
        scale = want.abs().max().item()
        assert got.shape == (5, 64) and scale > 1
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=rtol * scale)
        assert not got[[i for i, s in enumerate(slots) if s in (-1, 2)]].any()
        if path == "native":
            with torch.inference_mode():
                all_slots = layer.delta_all_slots(x)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.float(), all_slots.float(), atol=tol * 10, rtol=tol)
