"""Run `vllm serve` in a subprocess on a free loopback port, for the server tests."""

from __future__ import annotations

import base64
import io
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

import vllm

# The engine flags test servers share: small, exact and quick on CPU. Test servers run eagerly
# (graph capture costs seconds at every start); served graphs are the subject of
# test_server.py's server alone (GRAPHS_ENGINE_ARGS), and graphs against eager offline of
# test_graph_capture.py.
GRAPHS_ENGINE_ARGS = ["--dtype", "float32", "--kv-cache-memory-bytes", "64MiB",
                      "--max-model-len", "512", "--seed", "0"]
SMALL_ENGINE_ARGS = [*GRAPHS_ENGINE_ARGS, "--enforce-eager"]
# The default model served with the hermes tool template and parser, as the client-API test
# modules (chat tools, Responses, LangChain / instructor) share it (conftest's `tool_server`).
TOOL_MODEL = "smollm2"
HERMES_TEMPLATE = Path(__file__).parent.parent / "examples" / "tool_chat_template_hermes.jinja"
# Float weights (`--quantization none`): the Responses and Messages tests compare their
# answers with chat completions' to the same request, whose prompt the second request finds
# in the prefix cache. With the file's blocks kept, a prefill of up to 16 tokens takes int8
# activations and a longer one the dense weight, so a prefix hit would move near-ties.
TOOL_SERVER_ARGS = ["--served-model-name", TOOL_MODEL, "--chat-template", str(HERMES_TEMPLATE),
                    "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                    "--enable-prompt-embeds", *SMALL_ENGINE_ARGS, "--max-model-len", "1024",
                    "--kv-cache-memory-bytes", "128MiB", "--quantization", "none"]
STARTUP_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def encode_tensor(tensor: object) -> str:
    """base64 of torch.save(tensor): the wire form of `prompt_embeds`."""
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def _vllm_command() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "vllm")
    if os.path.exists(script):
        return [script]
    return [sys.executable, "-c", "import sys; from vllm.entrypoints.cli import main; "
            "sys.exit(main())"]


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc)."""
    result = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            result += [int(p) for p in f.read().split()]
    return result


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _same_vllm_env() -> dict[str, str]:
    """The environment with this `vllm` first on the path: the `vllm` script may belong to
    an editable install of another checkout."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(vllm.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


class RemoteServer:
    """`vllm serve MODEL ARGS` on 127.0.0.1:<free port>; stop() sends SIGTERM. MODEL None
    serves what the args say (e.g. `--pipeline stages.yaml`)."""

    def __init__(self, model: str | None, args: list[str],
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-serve-", suffix=".log")
        command = [*_vllm_command(), "serve", *([model] if model else []), "--host",
                   "127.0.0.1", "--port", str(self.port), "--disable-uvicorn-access-log", *args]
        # The clients (httpx, openai's) drop an idle connection after 5 s, the server's
        # default keep-alive too: a request sent on a connection the server is closing at
        # that moment fails ("Server disconnected without sending a response"; the tests'
        # clients do not retry). The server keeps connections longer, so the client always
        # drops them first.
        keep_alive = {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "30"}
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**_same_vllm_env(), **keep_alive, **(env or {})})
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n"
                                   f"{self.read_log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"vllm serve did not become healthy:\n{self.read_log()}")

    def engine_core_pids(self) -> list[int]:
        """The engine-core processes (spawned children) of the server."""
        return [p for p in child_pids(self.proc.pid) if "spawn_main" in _cmdline(p)]

    def read_log(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-5000:]

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait; returns the exit code (kills after `timeout`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.final_log = self.read_log()
            self.log.close()
        return self.proc.returncode


def scrape_metrics(server: RemoteServer) -> dict[str, float]:
    """The server's /metrics samples: `name{labels}` as printed -> value."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {name: float(value) for name, value in (
        line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))}


def requests_running(server: RemoteServer) -> float:
    """`vllm:num_requests_running` (0 before the engine has reported a step)."""
    return next((value for name, value in scrape_metrics(server).items()
                 if name.startswith("vllm:num_requests_running{")), 0.0)


def concurrent_completions(server: RemoteServer, model: str, prompts: list[str],
                           max_tokens: int = 8) -> list[str]:
    """The greedy completions of `prompts`, all requested at once (openai's async client)."""
    import asyncio

    import openai

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                                    timeout=120)

        async def one(prompt: str) -> str:
            out = await client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                extra_body={"ignore_eos": True})
            return out.choices[0].text

        return await asyncio.gather(*[one(p) for p in prompts])

    return asyncio.run(run())


def process_gone(pid: int) -> bool:
    """True once `pid` has exited (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except OSError:
        return True


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def wait_until(condition, what: str, tries: int = 200, every: float = 0.05) -> None:
    """Polls `condition` until it holds; bounded (tries * every seconds at most)."""
    for _ in range(tries):
        if condition():
            return
        time.sleep(every)
    raise AssertionError(f"never: {what}")
