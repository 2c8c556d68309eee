"""Prompt rules for encoder/decoder models: which part goes to the encoder, which to the
decoder, and the decoder's default prompt.

    "text" / {"prompt": ...} / {"prompt_token_ids": [...]} / {"prompt_embeds": T}
        singleton: the encoder's input; the decoder gets the model's default prompt
    {"encoder_prompt": P, "decoder_prompt": Q}
        explicit: either side any singleton form; Q gets <DEC> in front unless it has it
    {"prompt": DECODER_TEXT, "multi_modal_data": {"audio": (waveform, rate)}}
        audio models (Whisper): the audio is the encoder's input, the text the decoder's

Example (BART, <DEC> = 2, <BOS> = 0): "The rain in spain" -> encoder tokens of the text,
decoder [2, 0]; {"encoder_prompt": "...", "decoder_prompt": [0, 51, 178]} -> decoder
[2, 0, 51, 178].
"""

from __future__ import annotations

from typing import Any, NamedTuple

_EXPLICIT_KEYS = ("encoder_prompt", "decoder_prompt")


class EncoderDecoderPrompt(NamedTuple):
    encoder: Any  # a singleton prompt, or {"multi_modal_data": {"audio": ...}, ...}
    decoder: Any | None  # a singleton prompt; None for the model's default


def split_encoder_decoder_prompt(prompt: Any) -> EncoderDecoderPrompt:
    if isinstance(prompt, dict) and any(k in prompt for k in _EXPLICIT_KEYS):
        if prompt.get("encoder_prompt") is None:
            raise ValueError("An explicit encoder/decoder prompt needs 'encoder_prompt'.")
        extra = sorted(set(prompt) - set(_EXPLICIT_KEYS))
        if extra:
            raise ValueError(f"An explicit encoder/decoder prompt takes only encoder_prompt "
                             f"and decoder_prompt; got also {extra}.")
        return EncoderDecoderPrompt(prompt["encoder_prompt"], prompt.get("decoder_prompt"))
    if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
        # vLLM's singleton audio form: the text (if any) is the decoder's prompt.
        text = prompt.get("prompt") or None
        token_ids = prompt.get("prompt_token_ids")
        decoder = ({"prompt_token_ids": token_ids} if token_ids is not None
                   else text)
        return EncoderDecoderPrompt({"multi_modal_data": prompt["multi_modal_data"]}, decoder)
    return EncoderDecoderPrompt(prompt, None)


def with_decoder_start(token_ids: list[int], decoder_start_token_id: int) -> list[int]:
    """Prepends <DEC> unless the prompt already starts with it."""
    if token_ids and token_ids[0] == decoder_start_token_id:
        return token_ids
    return [decoder_start_token_id, *token_ids]


def default_decoder_prompt(hf_config: Any, tokenizer: Any, is_audio_model: bool) -> list[int]:
    """BART-like: <DEC><BOS>. Whisper: <|startoftranscript|>, then <|en|><|transcribe|> on
    multilingual models, then <|notimestamps|>."""
    start = hf_config.decoder_start_token_id
    if not is_audio_model:
        bos = getattr(hf_config, "bos_token_id", None)
        return [start] if bos is None else [start, bos]
    if tokenizer is None:
        raise ValueError("Whisper's default decoder prompt needs the tokenizer "
                         "(skip_tokenizer_init is set): pass a decoder prompt of token ids.")
    names = ["<|en|>", "<|transcribe|>"] if is_multilingual_whisper(hf_config) else []
    names.append("<|notimestamps|>")
    return [start, *(special_token_id(tokenizer, name) for name in names)]


def is_multilingual_whisper(hf_config: Any) -> bool:
    """English-only Whisper checkpoints (`*.en`) have 51864 tokens, multilingual 51865+."""
    return hf_config.vocab_size >= 51865


def special_token_id(tokenizer: Any, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    # Unknown tokens map to the unknown token's id (Whisper's is <|endoftext|> itself).
    unknown = (token_id == getattr(tokenizer, "unk_token_id", None)
               and token != getattr(tokenizer, "unk_token", None))
    if token_id is None or unknown:
        raise ValueError(f"The tokenizer has no {token} token.")
    return token_id
