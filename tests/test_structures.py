"""docs/structures.md stays one line per module of the tree (`tools/check_structures.py`):
a module added, moved or removed without its line fails here, in the fast layer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_structures_lists_every_module_once() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "check_structures.py")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
