"""The dependency lock (`constraints.txt`, written by `make lock`): exact pins for every
dependency pyproject.toml declares, torch's CPU build, and no GPU stack; the checker refuses
locks that break any of these."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import check_lock  # noqa: E402

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_committed_lock_passes() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "check_lock.py")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    pins, bad = check_lock.read_lock((ROOT / "constraints.txt").read_text())
    assert not bad and pins["torch"] == "2.13.0+cpu"


def test_the_installed_environment_is_the_lock() -> None:
    """What runs these tests was installed from the lock (as `make` and CI install it)."""
    from importlib.metadata import version

    pins, _ = check_lock.read_lock((ROOT / "constraints.txt").read_text())
    for name in ("torch", "transformers", "pytest", "numpy", "fastapi"):
        assert version(name) == pins[name], name


def test_a_lock_that_moves_torch_or_pulls_a_gpu_stack_is_refused() -> None:
    lock = "\n".join([
        "torch==2.14.0",  # a CUDA build from PyPI
        "triton==3.5.0",
        "nvidia-cublas-cu12==12.8.4.1",
        "numpy>=2",  # a range, not a pin
        "transformers==5.0.0 \\",
        "    --hash=sha256:00",
        "    # via vllm",
    ])
    found = check_lock.problems(lock, PYPROJECT)
    text = "\n".join(found)
    assert "torch==2.14.0: the lock must pin the CPU build 2.13.0+cpu" in text
    assert "triton==3.5.0 would bring a GPU stack" in text
    assert "nvidia-cublas-cu12==12.8.4.1 would bring a GPU stack" in text
    assert "not one exact pin (name==version): 'numpy>=2'" in text
    # Everything declared but absent is named; transformers (pinned, with a hash) is not.
    assert "fastapi is a dependency in pyproject.toml but has no pin in the lock" in text
    assert not any(line.startswith("transformers ") for line in found)


def test_names_are_compared_normalized() -> None:
    assert check_lock.normalize("Foo_Bar.baz") == "foo-bar-baz"
    pins, bad = check_lock.read_lock("Python_Multipart==0.0.20\n")
    assert pins == {"python-multipart": "0.0.20"} and not bad
