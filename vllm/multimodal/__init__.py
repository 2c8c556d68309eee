"""Media in prompts: images decoded and preprocessed (`image`), audio clips turned into
log-mel features (`audio`), media URLs read (`media`), placeholder runs in the prompt
(`processing`). Media reach the language model on the prompt-embeds path: the engine
core fills each placeholder run with the encoder's rows (`vllm/v1/engine/media_rows.py`)."""

from __future__ import annotations

# The modalities `limit_mm_per_prompt` may name (vLLM's keys).
MODALITIES = ("image", "audio", "video")
# Items of one modality a prompt may carry when `limit_mm_per_prompt` does not say (vLLM's).
DEFAULT_MM_LIMIT = 999
