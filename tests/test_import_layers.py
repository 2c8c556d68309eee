"""The package's layering, read from its import statements (ast; nothing imported):

    entrypoints/openai/ (server)  ──►  entrypoints/ (LLM, chat_utils, errors)  ──►  engine
                                                                       v1/, model_executor/

- the engine (vllm/v1, vllm/model_executor) never imports an entrypoint, and only the CLI
  reaches the server package from outside it;
- module-level imports form no cycle; a lazy import (inside a function) that would close one
  is listed in `CYCLE_BREAKS` with its reason, and the list holds nothing stale;
- in a subprocess: `import vllm` loads neither the server nor the engine core, and offline
  `LLM.chat` (rendering, prompt_embeds parts) loads no server module, FastAPI or uvicorn.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "vllm"

# Lazy imports that would close an import cycle were they at module level: importer ->
# imported, and why the cycle is wanted.
CYCLE_BREAKS = {
    ("vllm.v1.executor.abstract", "vllm.v1.executor.uniproc"):
        "Executor.get_class picks a subclass by name; the subclasses import their base.",
    ("vllm.v1.executor.abstract", "vllm.v1.executor.multiproc"):
        "Executor.get_class picks a subclass by name; the subclasses import their base.",
    ("vllm.v1.executor.abstract", "vllm.v1.executor.ray_executor"):
        "Executor.get_class picks a subclass by name; the subclasses import their base "
        "(and ray stays optional).",
}

# Who may import the server package (vllm.entrypoints.openai) from outside it.
SERVER_IMPORTERS = ("vllm.entrypoints.cli",)  # `vllm serve`
SERVER_PACKAGES = ("vllm.entrypoints.openai", "vllm.entrypoints.anthropic")


@dataclass(frozen=True, slots=True)
class Import:
    target: str  # the vllm module imported (a name imported from a package: the package)
    line: int
    lazy: bool  # inside a function
    type_only: bool  # under `if TYPE_CHECKING:`


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(name: str) -> str | None:
    """The longest module prefix of `name`: `vllm.outputs.RequestOutput` -> `vllm.outputs`."""
    while name and name not in modules():
        name = name.rpartition(".")[0]
    return name or None


@cache
def imports_of(module: str) -> tuple[Import, ...]:
    """The vllm modules `module` imports, relative imports resolved."""
    path = modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True, type_only)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), lazy, True)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), lazy, type_only)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                for name in _imported_names(child, package):
                    target = _resolve(name)
                    if target is not None and target != module:
                        found.append(Import(target, child.lineno, lazy, type_only))
            else:
                visit(child, lazy, type_only)

    visit(ast.parse(path.read_text(), str(path)), False, False)
    return tuple(found)


def _imported_names(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """Dotted names an import statement reaches: `from .x import y` in `vllm.a` ->
    ["vllm.a.x.y"] (`y` may be a module or a name in `vllm.a.x`)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == "vllm"]
    base = node.module or ""
    if node.level:
        parent = package.split(".")[:len(package.split(".")) - (node.level - 1)]
        base = ".".join(parent + ([base] if base else []))
    if base.split(".")[0] != "vllm":
        return []
    return [f"{base}.{alias.name}" for alias in node.names]


def _runtime_edges() -> dict[str, list[str]]:
    """Module-level imports run at import time (TYPE_CHECKING blocks left out)."""
    return {m: sorted({i.target for i in imports_of(m) if not i.lazy and not i.type_only})
            for m in modules()}


def _find_cycle(edges: dict[str, list[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in edges:
        if root in state:
            continue
        path = [root]
        stack = [iter(edges[root])]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(edges[nxt]))
    return None


def _reachable(edges: dict[str, list[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in edges[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_graph_reader_resolves_relative_and_absolute_imports():
    tree = ast.parse("from . import outputs\nfrom ..sched.output import X\nimport vllm.config")
    relative, deeper, absolute = tree.body
    assert isinstance(relative, ast.ImportFrom) and isinstance(deeper, ast.ImportFrom)
    assert isinstance(absolute, ast.Import)
    assert _imported_names(relative, "vllm") == ["vllm.outputs"]
    assert _imported_names(deeper, "vllm.v1.core.sched") == ["vllm.v1.core.sched.output.X"]
    assert _imported_names(absolute, "vllm.v1") == ["vllm.config"]
    assert _resolve("vllm.v1.core.sched.output.X") == "vllm.v1.core.sched.output"
    assert _find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": ["b", "c"], "b": ["c"], "c": []}) is None
    llm = {i.target: i for i in imports_of("vllm.entrypoints.llm")}
    assert not llm["vllm.entrypoints.chat_utils"].lazy
    assert llm["vllm.v1.engine.llm_engine"].target == "vllm.v1.engine.llm_engine"


def test_engine_imports_no_entrypoint():
    wrong = [f"{m}:{i.line} imports {i.target}" for m in modules()
             if m.startswith(("vllm.v1", "vllm.model_executor")) for i in imports_of(m)
             if i.target.startswith("vllm.entrypoints")]
    assert wrong == []


def test_only_the_cli_reaches_the_server():
    """The server's packages (the OpenAI API and the Messages API on it) import each other;
    of the rest, only the CLI imports them."""
    def in_server(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in SERVER_PACKAGES)

    wrong = [f"{m}:{i.line} imports {i.target}" for m in modules()
             if not in_server(m) and m not in SERVER_IMPORTERS
             for i in imports_of(m) if in_server(i.target)]
    assert wrong == []


def test_no_import_cycle():
    assert _find_cycle(_runtime_edges()) is None


def test_lazy_imports_close_no_undeclared_cycle():
    edges = _runtime_edges()
    closing = sorted({(m, i.target) for m in modules() for i in imports_of(m)
                      if i.lazy and not i.type_only and m in _reachable(edges, i.target)})
    assert closing == sorted(CYCLE_BREAKS)


_LIGHTNESS_CHECK = """
import json, sys

def loaded(*prefixes):
    return sorted(m for m in sys.modules if m.split(".")[0] in ("fastapi", "uvicorn", "ray")
                  or m.startswith(prefixes))

import vllm
after_vllm = loaded("vllm.entrypoints", "vllm.v1.engine", "vllm.v1.core", "vllm.v1.worker",
                    "vllm.model_executor.models")

import base64, io
from types import SimpleNamespace
import torch
from vllm.entrypoints.llm import LLM

class Tokenizer:
    def apply_chat_template(self, messages, tokenize, add_generation_prompt, chat_template,
                            tools, **kwargs):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text, add_special_tokens):
        return [ord(c) for c in text]

config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=64, hidden_size=4,
                                                    mm_modalities=()))
llm = object.__new__(LLM)
llm.llm_engine = SimpleNamespace(get_tokenizer=Tokenizer, vllm_config=config)
llm.generate = lambda prompts, *args: prompts
buffer = io.BytesIO()
torch.save(torch.ones(3, 4), buffer)
parts = [{"type": "text", "text": "a"},
         {"type": "prompt_embeds", "data": base64.b64encode(buffer.getvalue()).decode()},
         {"type": "prompt_embeds", "data": torch.zeros(2, 4)}]
text, mixed = llm.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": parts}]])
segments = [s if isinstance(s, str) else list(s.shape) for s in mixed["prompt_segments"]]
print(json.dumps({"after_vllm": after_vllm, "text": text["prompt"], "segments": segments,
                  "after_chat": loaded("vllm.entrypoints.openai")}))
"""


@pytest.mark.slow
def test_import_vllm_and_offline_chat_load_no_server():
    out = subprocess.run([sys.executable, "-c", _LIGHTNESS_CHECK], check=True,
                         capture_output=True, text=True, timeout=300,
                         cwd=PACKAGE.parent)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["after_vllm"] == []
    assert result["text"] == "<user>hi<assistant>"
    assert result["segments"] == ["<user>a\n", [3, 4], "\n", [2, 4], "<assistant>"]
    assert result["after_chat"] == []
