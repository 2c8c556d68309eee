"""Tokenizer loading (local directory, GGUF file or CTranslate2 Whisper directory) and a cached
view of its vocabulary."""

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
    from vllm.model_executor.model_loader.ct2_loader import is_ct2_model_dir, load_ct2_tokenizer

    if is_ct2_model_dir(path):
        return load_ct2_tokenizer(path)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
