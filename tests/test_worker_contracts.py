"""The worker reads capabilities off the model and backend protocols, never off concrete
classes: no module under `vllm/v1/worker/` imports a model family or a concrete attention
backend, and the fused decoder's eligibility comes from what a model declares
(`fused_decode_spec`) and what its attention backend declares (`fused_decode_attention`)."""

from __future__ import annotations

import ast
import logging
import pathlib
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
import transformers
from torch import nn

import vllm._custom_ops
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.olmo2 import Olmo2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.v1.attention.backends.abstract import AttentionBackend, AttentionType
from vllm.v1.attention.backends.torch_sdpa import TorchSDPABackend
from vllm.v1.worker.fused_decode import FusedDecode, unsupported_reason


def _worker_dir() -> pathlib.Path:
    return pathlib.Path(vllm.__file__).parent / "v1" / "worker"


def _imports(path: pathlib.Path) -> list[tuple[str, str]]:
    """(module, name) of every import in a file, `import x.y` as ("x.y", "")."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            found += [(node.module, alias.name) for alias in node.names]
    return found


def test_the_worker_imports_no_model_family_nor_concrete_backend() -> None:
    files = sorted(_worker_dir().glob("*.py"))
    assert any(f.name == "fused_decode.py" for f in files)
    offending = []
    for path in files:
        for module, name in _imports(path):
            family = (module.startswith("vllm.model_executor.models.")
                      and module != "vllm.model_executor.models.interfaces")
            concrete_backend = (module.startswith("vllm.v1.attention.backends.")
                                and module != "vllm.v1.attention.backends.abstract")
            if family or concrete_backend or name in ("TorchSDPAImpl", "TorchSDPAMetadata"):
                offending.append(f"{path.name}: {module} {name}".strip())
    assert offending == []


class _Undeclared(nn.Module):
    """A model that declares no fused decode description."""

    packed_modules_mapping = {}


def _fake_native_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Native kernels as `FusedDecode.build` checks for them (never called here)."""
    ops = SimpleNamespace(FusedDecoder=None, quant_gemv_available=lambda: True)
    monkeypatch.setattr(vllm._custom_ops, "cpu_ops", lambda: ops)


def test_a_model_without_the_declaration_gets_the_logged_reason(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    model = cast(Any, _Undeclared())
    reason = "_Undeclared declares no fused decoder form"
    assert unsupported_reason(model, [], torch.float32, lora=False) == reason
    _fake_native_ops(monkeypatch)
    with caplog.at_level(logging.INFO, logger="vllm.v1.worker.fused_decode"):
        assert FusedDecode.build(model, [], torch.float32, [], False, AttentionBackend) is None
    assert f"Fused decode steps off: {reason}." in caplog.messages


def _llama_config(**kwargs) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, **kwargs)


def test_the_llama_family_and_its_backend_declare_the_reasons() -> None:
    """The reasons come from the model's declaration (dense projections, q/k norms over the
    whole projection, a family's own forward pieces) and its backend's (attention its
    decoder does not compute: cross-attention). A window and per-head q/k norms (Qwen3)
    are forms the decoder computes: only the dense projections stop those."""
    caches = [torch.zeros(1)] * 2
    dense = "layer 0 has a projection other than a one-rank GGUF or int8 kernel"
    plain = LlamaForCausalLM(_llama_config(), TorchSDPABackend, 64, torch.float32)
    assert unsupported_reason(cast(Any, plain), caches, torch.float32, lora=False) == dense
    windowed = LlamaForCausalLM(_llama_config(sliding_window=4), TorchSDPABackend, 64,
                                torch.float32)
    assert unsupported_reason(cast(Any, windowed), caches, torch.float32, lora=False) == dense
    qwen3 = Qwen3ForCausalLM(_llama_config(head_dim=32), TorchSDPABackend, 64, torch.float32)
    assert unsupported_reason(cast(Any, qwen3), caches, torch.float32, lora=False) == dense
    olmo2 = Olmo2ForCausalLM(_llama_config(), TorchSDPABackend, 64, torch.float32)
    assert unsupported_reason(cast(Any, olmo2), caches, torch.float32, lora=False) \
        == "layer 0 is not a plain Llama layer"
    cross = plain.layers[0].self_attn.attn.impl
    cross.attn_type = AttentionType.ENCODER_DECODER
    assert unsupported_reason(cast(Any, plain), caches, torch.float32, lora=False) \
        == "layer 0's attention is not one its backend lets the fused decoder compute"
    assert unsupported_reason(cast(Any, plain), caches, torch.float64, lora=False) \
        == "dtype torch.float64"


def test_every_rpc_names_a_worker_method() -> None:
    """The executors reach the workers by method name (`collective_rpc("execute_model",
    ...)`), which the type checker cannot follow: every name sent anywhere in the package
    is a method of `Worker`, with the number of arguments sent, so renaming one without
    its callers fails here."""
    import inspect

    from vllm.v1.worker.worker import Worker

    calls = []
    for path in pathlib.Path(vllm.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "collective_rpc" and node.args
                    and isinstance(node.args[0], ast.Constant)):
                sent = node.args[1] if len(node.args) > 1 else None
                count = len(sent.elts) if isinstance(sent, ast.Tuple) else 0
                calls.append((path.name, node.args[0].value, count))
    assert {name for _, name, _ in calls} >= {"execute_model", "initialize_kv_cache",
                                               "shutdown"}
    for where, name, count in calls:
        method = getattr(Worker, name, None)
        assert callable(method), f"{where}: collective_rpc({name!r}) names no Worker method"
        parameters = list(inspect.signature(method).parameters.values())[1:]  # not self
        required = [p for p in parameters if p.default is inspect.Parameter.empty]
        assert len(required) <= count <= len(parameters), (where, name, count)
