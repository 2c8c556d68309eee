"""`Processor`: user prompt + params -> validated `EngineCoreRequest`."""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

import numpy as np
import torch

from vllm.config import LoRAConfig, ModelConfig
from vllm.inputs.audio import audio_to_features, load_feature_extractor
from vllm.inputs.encoder_decoder import (
    default_decoder_prompt,
    split_encoder_decoder_prompt,
    with_decoder_start,
)
from vllm.inputs.parse import ParsedPrompt, parse_prompt, validate_prompt_embeds
from vllm.lora.request import LoRARequest
from vllm.multimodal.processing import media_prompt_processor
from vllm.sampling_params import MAX_LOGPROBS, SamplingParams
from vllm.v1.engine import EncoderInput, EngineCoreRequest
from vllm.v1.messages import MediaInput
from vllm.v1.request import EMBEDS_PLACEHOLDER_TOKEN_ID
from vllm.v1.structured_output.manager import GrammarCompiler

# Samples per prompt; each one is a request of its own in the engine core.
MAX_N = 128
MAX_CACHE_SALT_CHARS = 1024
# vLLM's wording: clients match on "not compatible with prompt embeds".
PROMPT_LOGPROBS_WITH_EMBEDS = "prompt_logprobs is not compatible with prompt embeds."


class Processor:
    """Tokenizes, validates and stamps requests; errors are `ValueError`s naming the field."""

    def __init__(self, model_config: ModelConfig, tokenizer: Any,
                 lora_config: LoRAConfig | None = None) -> None:
        self.model_config = model_config
        self.lora_config = lora_config
        # Adapters already checked, (id, path): each is read once, not per request.
        self._checked_loras: dict[tuple[int, str], None] = {}
        self.tokenizer = tokenizer
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        if self.eos_token_id is None:
            self.eos_token_id = getattr(model_config.hf_config, "eos_token_id", None)
        if isinstance(self.eos_token_id, list):
            self.eos_token_id = self.eos_token_id[0] if self.eos_token_id else None
        self.generation_stop_ids = _generation_config_eos_ids(model_config.model)
        self.is_audio_model = model_config.is_audio_model
        # Every structured-output constraint is compiled here before it is submitted, so a
        # bad one is refused (a 400) before it reaches the engine core.
        self.grammar_compiler = (None if tokenizer is None
                                 else GrammarCompiler(lambda: tokenizer, model_config.vocab_size))
        self.feature_extractor = (
            load_feature_extractor(model_config.model, model_config.hf_config.num_mel_bins)
            if self.is_audio_model else None)
        # Images or audio in prompts (LLaVA, Qwen2-Audio): placeholder runs and encoder inputs.
        self.media_processor = media_prompt_processor(model_config, tokenizer)

    def process_inputs(self, request_id: str, prompt: Any, params: SamplingParams,
                       arrival_time: float | None = None,
                       lora_request: LoRARequest | None = None
                       ) -> tuple[EngineCoreRequest, ParsedPrompt]:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"Expected SamplingParams, got {type(params).__name__}.")
        self.check_lora(lora_request)
        encoder_input = None
        if self.model_config.is_encoder_decoder:
            parsed, encoder_input = self._process_encoder_decoder(prompt)
        else:
            _reject_encoder_inputs(prompt, self.model_config, self.media_processor is not None)
            parsed = parse_prompt(prompt)
        cache_salt = _cache_salt(prompt)
        if cache_salt is not None and encoder_input is not None:
            # Cross blocks are cached under the encoder input's hash: salt it too.
            encoder_input.content_hash = _content_hash(b"S", np.frombuffer(
                cache_salt.encode() + encoder_input.content_hash, dtype=np.uint8))
        if params.prompt_logprobs is not None:
            if parsed.prompt_embeds is not None or parsed.prompt_segments is not None:
                raise ValueError(PROMPT_LOGPROBS_WITH_EMBEDS)
            raise ValueError("prompt_logprobs is not supported by this engine yet.")
        self._validate_params(params)
        if params.return_hidden_states and not self.model_config.enable_return_hidden_states:
            raise ValueError("return_hidden_states is set, but this engine does not keep "
                             "hidden states: create it with enable_return_hidden_states=True "
                             "(server: --enable-return-hidden-states).")
        embeds = token_ids = is_token = media = mrope_positions = None
        mm_data = (prompt.get("multi_modal_data")
                   if self.media_processor is not None and isinstance(prompt, dict) else None)
        if mm_data is not None:
            token_ids, is_token, media, mrope_positions = self._media_prompt(parsed, mm_data)
        elif parsed.prompt_segments is not None:
            token_ids, embeds, is_token = self._segments(parsed.prompt_segments,
                                                         parsed.add_special_tokens)
        elif parsed.prompt_embeds is not None:
            embeds = self._validate_embeds(parsed.prompt_embeds)
        else:
            token_ids = self._tokenize(parsed)
            self._validate_token_ids(token_ids)
        params = params.clone()
        params.eos_token_id = self.eos_token_id
        params.all_stop_token_ids = [t for t in self.generation_stop_ids
                                     if t != self.eos_token_id]
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            prompt_embeds=embeds,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            encoder_input=encoder_input,
            cache_salt=cache_salt,
            prompt_is_token_ids=is_token,
            lora_request=lora_request,
            mm_inputs=media,
            mrope_positions=mrope_positions,
            bidirectional_spans=([(item.offset, item.offset + item.num_tokens)
                                  for item in media]
                                 if media and self.model_config.bidirectional_media else None),
        )
        if media is not None:  # the text, and the ids with each item's run
            return request, parsed._replace(prompt_token_ids=token_ids)
        if is_token is not None:  # a mixed prompt has no text nor ids to show
            return request, parsed._replace(prompt_segments=None)
        return request, parsed._replace(prompt_token_ids=token_ids, prompt_embeds=embeds)

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """A request's adapter: LoRA must be on, and the adapter fit the base model (rank,
        targets, shapes; see `vllm.lora.peft.check_adapter`)."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(lora_request).__name__}.")
        if self.lora_config is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} requested, but LoRA is "
                             "not enabled: create the engine with enable_lora=True "
                             "(server: --enable-lora).")
        key = (lora_request.lora_int_id, lora_request.lora_path)
        if key in self._checked_loras:
            return
        from vllm.lora.peft import check_adapter

        check_adapter(lora_request.lora_path, self.model_config.hf_config,
                      self.lora_config.max_lora_rank)
        if len(self._checked_loras) >= 1024:
            self._checked_loras.pop(next(iter(self._checked_loras)))
        self._checked_loras[key] = None

    def _segments(self, segments: list, add_special_tokens: bool
                  ) -> tuple[list[int] | None, torch.Tensor | None, torch.Tensor | None]:
        """A `prompt_segments` prompt as (ids with placeholders, rows, is_token mask); a
        prompt of one kind only comes back as that kind (no mask).

        Example: [[1], "ab", E (2 rows), "c"] with "ab" -> [7, 8], "c" -> [9] gives ids
        [1, 7, 8, 0, 0, 9], rows E, is_token [T, T, T, F, F, T].
        """
        ids: list[int] = self._leading_special_ids() if add_special_tokens else []
        is_token = [True] * len(ids)
        rows: list[torch.Tensor] = []
        for i, segment in enumerate(segments):
            if isinstance(segment, str):
                piece = self._encode_text(segment, add_special_tokens=False)
            elif isinstance(segment, torch.Tensor):
                rows.append(self._validate_embeds(segment, what=f"prompt_segments[{i}]"))
                ids += [EMBEDS_PLACEHOLDER_TOKEN_ID] * rows[-1].shape[0]
                is_token += [False] * rows[-1].shape[0]
                continue
            elif isinstance(segment, (list, tuple)):
                piece = list(segment)
            else:
                raise ValueError(f"prompt_segments[{i}] must be a str, a list of token ids "
                                 f"or a tensor, got {type(segment).__name__}.")
            ids += piece
            is_token += [True] * len(piece)
        if not rows:
            self._validate_token_ids(ids)
            return ids, None, None
        embeds = torch.cat(rows)
        if not any(is_token):
            self._validate_embeds(embeds)
            return None, embeds, None
        mask = torch.tensor(is_token, dtype=torch.bool)
        real = [t for t, keep in zip(ids, is_token, strict=True) if keep]
        self._validate_token_ids(real, what="prompt's text")
        if len(ids) > self.model_config.max_model_len:
            raise ValueError(f"The prompt (length {len(ids)}: {len(real)} token ids and "
                             f"{embeds.shape[0]} embeds rows) is longer than the maximum "
                             f"model length of {self.model_config.max_model_len}.")
        return ids, embeds, mask

    def _media_prompt(self, parsed: ParsedPrompt, mm_data: Any
                      ) -> tuple[list[int], torch.Tensor, list[MediaInput],
                                 torch.Tensor | None]:
        """A prompt with media: its ids with each placeholder expanded to the item's run,
        the is_token mask (False on media positions), the preprocessed items, and an M-RoPE
        model's rotary positions."""
        assert self.media_processor is not None  # only multimodal models take this path
        if parsed.prompt_embeds is not None or parsed.prompt_segments is not None:
            raise ValueError("multi_modal_data goes with a text prompt or prompt_token_ids, "
                             "not with prompt_embeds or prompt_segments.")
        if parsed.prompt_token_ids is None and parsed.prompt is not None:
            # Gemma 3 expands its images as text, as transformers' processor does
            parsed = parsed._replace(prompt=self.media_processor.expand_text(parsed.prompt))
        token_ids = self._tokenize(parsed)
        self._validate_token_ids(token_ids)
        prompt = self.media_processor.process(token_ids, mm_data)
        return prompt.token_ids, prompt.is_token, prompt.items, prompt.mrope_positions

    def _leading_special_ids(self) -> list[int]:
        """The special tokens the tokenizer puts before a text prompt (BOS for Llama)."""
        if self.tokenizer is None:
            return []
        plain = list(self.tokenizer.encode("a", add_special_tokens=False))
        full = list(self.tokenizer.encode("a", add_special_tokens=True))
        at = len(full) - len(plain)
        return full[:at] if at > 0 and full[at:] == plain else []

    # ---- encoder/decoder models ------------------------------------------------------

    def _process_encoder_decoder(self, prompt: Any) -> tuple[ParsedPrompt, EncoderInput]:
        """Splits the prompt (see `vllm.inputs.encoder_decoder`); returns the decoder side
        as a token prompt (with <DEC> in front) and the validated, hashed encoder input."""
        split = split_encoder_decoder_prompt(prompt)
        encoder_input, encoder_text = self._encoder_input(split.encoder)
        config = self.model_config.hf_config
        if split.decoder is None:
            decoder_text = None
            decoder_ids = default_decoder_prompt(config, self.tokenizer, self.is_audio_model)
        else:
            decoder = parse_prompt(split.decoder)
            if decoder.prompt_segments is not None:
                raise ValueError("prompt_segments are for decoder-only models.")
            if decoder.prompt_embeds is not None:
                raise ValueError("The decoder prompt of an encoder/decoder model cannot be "
                                 "prompt_embeds; pass embeds as the encoder prompt.")
            decoder_text = decoder.prompt
            decoder_ids = with_decoder_start(self._tokenize(decoder, add_special_tokens=False),
                                             config.decoder_start_token_id)
        parsed = ParsedPrompt(decoder_text, decoder_ids, None, encoder_text,
                              encoder_input.token_ids)
        return parsed, encoder_input

    def _encoder_input(self, prompt: Any) -> tuple[EncoderInput, str | None]:
        model_config = self.model_config
        audio = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if audio is not None:
            return self._audio_encoder_input(prompt), None
        if self.is_audio_model:
            raise ValueError(f"{model_config.architecture}'s encoder input is audio: pass "
                             "{'prompt': '', 'multi_modal_data': {'audio': (waveform, "
                             "sample_rate)}} as the (encoder) prompt.")
        parsed = parse_prompt(prompt)
        if parsed.prompt_segments is not None:
            raise ValueError("prompt_segments are for decoder-only models.")
        if parsed.prompt_embeds is not None:
            embeds = self._validate_embeds(parsed.prompt_embeds, model_config.max_encoder_len,
                                           "encoder prompt")
            return EncoderInput(None, embeds, embeds.shape[0],
                                _content_hash(b"E", embeds.view(-1).view(torch.uint8)
                                              .numpy())), None
        token_ids = self._tokenize(parsed)
        self._validate_token_ids(token_ids, model_config.max_encoder_len, "encoder prompt")
        ids_bytes = np.asarray(token_ids, dtype=np.int64)
        return EncoderInput(token_ids, None, len(token_ids),
                            _content_hash(b"T", ids_bytes)), parsed.prompt

    def _audio_encoder_input(self, prompt: dict) -> EncoderInput:
        model_config = self.model_config
        if self.feature_extractor is None:
            raise ValueError(f"{model_config.architecture} does not take audio (multi_modal_data); "
                             "its encoder input is text or prompt_embeds.")
        if prompt.get("prompt") or prompt.get("prompt_token_ids"):
            raise ValueError("The encoder prompt of an audio model is the audio alone: "
                             "put the text in decoder_prompt.")
        data = prompt["multi_modal_data"]
        if not isinstance(data, dict) or set(data) != {"audio"}:
            raise ValueError("multi_modal_data must be {'audio': (waveform, sample_rate)}, "
                             f"got {sorted(data) if isinstance(data, dict) else data!r}.")
        features = audio_to_features(data["audio"], self.feature_extractor)
        frames = model_config.max_encoder_len * (model_config.audio_frames_per_encoder_token or 1)
        if features.shape[1] != frames:
            raise ValueError(f"The feature extractor gave {features.shape[1]} frames, but "
                             f"{model_config.architecture} takes {frames}.")
        return EncoderInput(None, features, model_config.max_encoder_len,
                            _content_hash(b"A", features.numpy()))

    # ---- checks ----------------------------------------------------------------------

    def _validate_params(self, params: SamplingParams) -> None:
        """Checks of the params against this model (SamplingParams checks the rest), so that
        no value can fail later inside the engine core."""
        vocab = self.model_config.vocab_size
        max_len = self.model_config.max_model_len
        if params.top_k > vocab:
            raise ValueError(f"top_k must be at most the vocabulary size {vocab}, "
                             f"got {params.top_k}.")
        bad = [t for t in params.stop_token_ids or [] if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are out of the vocabulary (size {vocab}).")
        bad = [t for t in params.allowed_token_ids or [] if t >= vocab]
        if bad:
            raise ValueError(f"allowed_token_ids {bad} are out of the vocabulary "
                             f"(size {vocab}).")
        if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
            raise ValueError(f"logprobs must be at most {MAX_LOGPROBS}, got {params.logprobs}.")
        if params.min_tokens > max_len:
            raise ValueError(f"min_tokens must be at most max_model_len={max_len}, "
                             f"got {params.min_tokens}.")
        if params.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {params.n}.")
        if params.seed is not None and not 0 <= params.seed <= 2**63 - 1 - params.n:
            raise ValueError(f"seed must be in [0, 2**63 - 1 - n], got {params.seed}.")
        if params.structured_outputs is not None:
            if self.grammar_compiler is None:
                raise ValueError("structured_outputs needs a tokenizer (skip_tokenizer_init "
                                 "is set).")
            if params.min_tokens:
                raise ValueError("min_tokens cannot be combined with structured_outputs: the "
                                 "grammar decides where the output may end.")
            self.grammar_compiler.compile(params.structured_outputs)  # GrammarError if bad

    def _tokenize(self, parsed: ParsedPrompt, add_special_tokens: bool = True) -> list[int]:
        """The ids of a prompt without embeds: its own, or its text's."""
        if parsed.prompt_token_ids is not None:
            return parsed.prompt_token_ids
        assert parsed.prompt is not None  # parse_prompt: no embeds and no ids -> a text
        return self._encode_text(parsed.prompt, add_special_tokens)

    def _encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("A text prompt needs a tokenizer (skip_tokenizer_init is set).")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _validate_token_ids(self, token_ids: list[int], max_len: int | None = None,
                            what: str = "prompt") -> None:
        max_len = max_len or self.model_config.max_model_len
        if not token_ids:
            raise ValueError(f"The {what} is empty: it has 0 tokens.")
        if len(token_ids) > max_len:
            limit = "encoder length" if what == "encoder prompt" else "model length"
            raise ValueError(f"The {what} (length {len(token_ids)}) is longer than the "
                             f"maximum {limit} of {max_len}.")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"Token id {bad[0]!r} in the {what} is out of the "
                             f"vocabulary (size {vocab}).")

    def _validate_embeds(self, embeds: Any, max_len: int | None = None,
                         what: str = "prompt"):
        model_config = self.model_config
        if not model_config.enable_prompt_embeds:
            raise ValueError("prompt_embeds given, but prompt embeds are disabled: create the "
                             "engine with enable_prompt_embeds=True (server: "
                             "--enable-prompt-embeds).")
        return validate_prompt_embeds(embeds, model_config.hidden_size, model_config.dtype,
                                      max_len or model_config.max_model_len, what)


def _content_hash(tag: bytes, data: np.ndarray) -> bytes:
    """Names an encoder input by its content (tag: T token ids, E embeds, A audio)."""
    return hashlib.sha256(tag + np.ascontiguousarray(data).tobytes()).digest()


def _reject_encoder_inputs(prompt: Any, model_config: ModelConfig, takes_media: bool) -> None:
    if isinstance(prompt, dict):
        keys = ("encoder_prompt", "decoder_prompt") + (() if takes_media
                                                        else ("multi_modal_data",))
        for key in keys:
            if prompt.get(key) is not None:
                media = " and no media" if key == "multi_modal_data" else ""
                raise ValueError(f"{key!r} given, but {model_config.architecture} is a "
                                 f"decoder-only model: it takes one prompt{media}.")


def _generation_config_eos_ids(model: str) -> list[int]:
    path = os.path.join(model, "generation_config.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [eos]


def _cache_salt(prompt: Any) -> str | None:
    """The prompt's `cache_salt` (a non-empty string), or None."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ValueError("cache_salt must be a non-empty string.")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt is {len(salt)} characters long, over the limit of "
                         f"{MAX_CACHE_SALT_CHARS}.")
    return salt
