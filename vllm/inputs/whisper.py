"""Whisper's decoder prompts for transcription and translation, and its output read back into
timed segments.

A decoder prompt (token names as in Whisper's vocabulary)::

    [<|startofprev|> previous-text tokens]  <|startoftranscript|>
    [<|en|> <|transcribe|>]                  language and task: multilingual models only
    <|notimestamps|>  or  <|0.00|>           text only, or text between timestamp tokens

With timestamps the model writes `text <|2.40|><|2.40|> more text <|5.00|>`: each timestamp
token is a time in 20 ms steps from the start of the window (`<|0.00|>` is the first id
after the special tokens), closing one segment and opening the next.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from vllm.inputs.encoder_decoder import is_multilingual_whisper, special_token_id

TIME_PRECISION = 0.02  # seconds per timestamp token step
TASKS = ("transcribe", "translate")


class WhisperTokens(NamedTuple):
    """The special token ids a transcription prompt and its segments need."""

    start_of_transcript: int
    start_of_prev: int
    no_timestamps: int
    timestamp_begin: int  # <|0.00|>
    end_of_text: int

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> WhisperTokens:
        """Timestamps follow <|notimestamps|> in every Whisper vocabulary; some tokenizer
        files leave them out, so <|0.00|> is not looked up by name."""
        sot, prev, no_timestamps, eot = (special_token_id(tokenizer, name) for name in (
            "<|startoftranscript|>", "<|startofprev|>", "<|notimestamps|>", "<|endoftext|>"))
        return cls(sot, prev, no_timestamps, no_timestamps + 1, eot)


def language_code(language: str | None, hf_config: Any) -> str | None:
    """The ISO-639-1 code Whisper knows for `language` (a code or an English name, any case),
    or None when not given. Raises ValueError for an unknown language, or for a language
    other than English on an English-only (`.en`) model."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE

    if language is None or not language.strip():
        return None
    name = language.strip().lower()
    code = name if name in LANGUAGES else TO_LANGUAGE_CODE.get(name)
    if code is None:
        raise ValueError(f"Unknown language {language!r}: give an ISO-639-1 code Whisper "
                         "knows, such as 'en', 'de' or 'fr'.")
    if code != "en" and not is_multilingual_whisper(hf_config):
        raise ValueError(f"This model is English-only (a .en Whisper model): it cannot "
                         f"transcribe language {language!r}. Omit language, give 'en', or "
                         "serve a multilingual Whisper model.")
    return code


# Language tokens some Whisper vocabularies spell with an older ISO-639 code.
_OLD_CODES = {"iw": "he"}


def language_token_ids(tokenizer: Any, vocab_size: int) -> dict[int, str]:
    """Whisper's language tokens, the ids between <|startoftranscript|> and <|translate|>:
    id -> ISO-639-1 code. Example (multilingual vocabulary): {50259: "en", 50260: "zh",
    ..., 50357: "su"}; `<|iw|>` reads as "he"."""
    first = special_token_id(tokenizer, "<|startoftranscript|>") + 1
    end = min(special_token_id(tokenizer, "<|translate|>"), vocab_size)
    tokens = tokenizer.convert_ids_to_tokens(list(range(first, end)))
    codes = [str(token)[2:-2] for token in tokens]
    return {first + i: _OLD_CODES.get(code, code) for i, code in enumerate(codes)}


def language_token(tokenizer: Any, code: str) -> int:
    """The id of the language token of `code` (a code from `language_code`), under its
    older spelling where the vocabulary has only that."""
    older = {new: old for old, new in _OLD_CODES.items()}.get(code)
    if older is not None and tokenizer.convert_tokens_to_ids(f"<|{code}|>") in (
            None, getattr(tokenizer, "unk_token_id", None)):
        code = older
    return special_token_id(tokenizer, f"<|{code}|>")


def language_name(code: str) -> str:
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return LANGUAGES[code]


def decoder_prompt(tokenizer: Any, hf_config: Any, *, language: str | None, task: str,
                   previous_text_ids: list[int], timestamps: bool, max_model_len: int
                   ) -> list[int]:
    """The decoder prompt for one audio window (see the module docstring).

    `previous_text_ids` (the user's `prompt`, tokenized with its leading space) is cut to
    its last `max_model_len // 2 - 1` tokens, Whisper's own rule. `language` is a code from
    `language_code`; multilingual models default to English.
    """
    tokens = WhisperTokens.from_tokenizer(tokenizer)
    prompt = []
    if previous_text_ids:
        prompt = [tokens.start_of_prev, *previous_text_ids[-(max_model_len // 2 - 1):]]
    prompt.append(tokens.start_of_transcript)
    if is_multilingual_whisper(hf_config):
        prompt += [language_token(tokenizer, language or "en"),
                   special_token_id(tokenizer, f"<|{task}|>")]
    prompt.append(tokens.timestamp_begin if timestamps else tokens.no_timestamps)
    return prompt


def join_texts(pieces: list[str]) -> str:
    """Concatenates window texts in order, with a space where two would otherwise touch.

    Example: [" Hello there.", "", "General Kenobi."] -> " Hello there. General Kenobi."
    """
    text = ""
    for piece in pieces:
        if text and piece and not text[-1].isspace() and not piece[0].isspace():
            text += " "
        text += piece
    return text


class Segment(NamedTuple):
    start: float  # seconds from the start of the window
    end: float
    token_ids: list[int]  # text tokens only
    logprobs: list[float]  # of token_ids, when given


def timed_segments(token_ids: list[int], tokens: WhisperTokens, window_seconds: float,
                   logprobs: list[float] | None = None) -> list[Segment]:
    """Splits generated ids (after a prompt ending in `<|0.00|>`) at timestamp tokens;
    `logprobs` (one per id) are split alongside.

    Text the model did not close with a timestamp ends at the window's end. Times are
    clamped to the window and never run backwards. Example (ids shown as their text):
    `Hi. <|1.00|><|1.20|> Bye. <|2.00|> <|endoftext|>` in a 30 s window ->
    [Segment(0.0, 1.0, Hi.), Segment(1.2, 2.0, Bye.)].
    """
    if logprobs is None:
        logprobs = [0.0] * len(token_ids)
    segments: list[Segment] = []
    text: list[int] = []
    text_logprobs: list[float] = []
    opened = 0.0
    for token, logprob in zip(token_ids, logprobs):
        if token >= tokens.timestamp_begin:
            time = min((token - tokens.timestamp_begin) * TIME_PRECISION, window_seconds)
            time = max(time, opened)
            if text:
                segments.append(Segment(opened, time, text, text_logprobs))
                text, text_logprobs = [], []
            opened = time
        elif token < tokens.end_of_text:
            text.append(token)
            text_logprobs.append(logprob)
    if text:
        segments.append(Segment(opened, max(window_seconds, opened), text, text_logprobs))
    return segments

