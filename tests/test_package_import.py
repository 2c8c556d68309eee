"""`import vllm` has no lasting side effects on the process environment, while libgomp still
reads this engine's spin count when torch loads (vllm/platforms/openmp.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vllm.platforms.openmp import SPIN_COUNT, SPIN_COUNT_VAR, openmp_spin_count

_IMPORT_CHECK = """
import os, sys
before = dict(os.environ)
assert "torch" not in sys.modules
import vllm
assert "torch" in sys.modules
changed = sorted(k for k in before.keys() | os.environ.keys() if before.get(k) != os.environ.get(k))
print(changed)
"""


@pytest.mark.slow
def test_import_vllm_leaves_environ_unchanged():
    env = {k: v for k, v in os.environ.items() if k != SPIN_COUNT_VAR}
    out = subprocess.run([sys.executable, "-c", _IMPORT_CHECK], env=env, check=True,
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "[]"


def test_spin_count_set_only_inside_the_block(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(SPIN_COUNT_VAR, raising=False)
    with openmp_spin_count():
        assert os.environ[SPIN_COUNT_VAR] == SPIN_COUNT == "10000"
    assert SPIN_COUNT_VAR not in os.environ
    with pytest.raises(KeyError), openmp_spin_count():  # removed on an error too
        raise KeyError("x")
    assert SPIN_COUNT_VAR not in os.environ


def test_users_spin_count_wins(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(SPIN_COUNT_VAR, "123")
    with openmp_spin_count():
        assert os.environ[SPIN_COUNT_VAR] == "123"
    assert os.environ[SPIN_COUNT_VAR] == "123"
