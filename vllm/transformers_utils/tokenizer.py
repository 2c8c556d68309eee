"""Tokenizer loading (local directory or GGUF file) and a cached view of its vocabulary."""

from __future__ import annotations

import os
from typing import Any

from transformers import AutoTokenizer


def get_tokenizer(path: str) -> Any:
    if path.endswith(".gguf"):
        from vllm.model_executor.model_loader.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    if not os.path.isdir(path):
        raise ValueError(f"Tokenizer path {path!r} is not a directory or .gguf file.")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
