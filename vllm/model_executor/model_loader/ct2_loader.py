"""Load CTranslate2 Whisper directories (faster-whisper's format) as a Hugging Face checkpoint.

A CTranslate2 directory holds ``model.bin`` (one binary file: a spec name, then named tensors
with fused attention projections, then aliases), a small ``config.json`` of generation lists
and a ``tokenizer.json``. This module turns it into what a Hugging Face Whisper checkpoint
gives: ``WhisperConfig`` kwargs, a state dict with ``WhisperForConditionalGeneration``'s names
and shapes, a Whisper tokenizer and a feature extractor.

``model.bin`` layout (little-endian; a string is ``u16`` length counting a trailing NUL, then
the bytes and the NUL)::

    u32 format version | string spec name | u32 spec revision | u32 number of variables
    per variable: string name | u8 rank | rank x u32 shape | u8 dtype code | u32 byte count | data
    u32 number of aliases | per alias: string alias name | string target name
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_SUPPORTED_FORMAT_VERSIONS = range(4, 7)  # dtype code + byte count per variable, then aliases
_WHISPER_SPEC = "WhisperSpec"
_MULTILINGUAL_VOCAB_SIZE = 51865  # English-only Whisper models have 51864 tokens

# dtype code -> (numpy dtype the bytes are read as, torch dtype of the tensor)
_DTYPES: dict[int, tuple[str, torch.dtype]] = {
    0: ("<f4", torch.float32),
    1: ("i1", torch.int8),
    2: ("<i2", torch.int16),
    3: ("<i4", torch.int32),
    4: ("<f2", torch.float16),
    5: ("<u2", torch.bfloat16),  # numpy has no bfloat16: read the raw 16 bits, then reinterpret
}

# CTranslate2's ``decoder/activation`` scalar -> Hugging Face activation name.
_ACTIVATIONS: dict[int, str] = {0: "relu", 1: "gelu_new", 2: "silu", 3: "gelu"}

# Per-layer CTranslate2 scopes -> HF modules; a fused projection lists its parts in row order.
_LAYER_MODULES: dict[str, tuple[str, ...]] = {
    "self_attention/linear_0": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attention/linear_1": ("self_attn.out_proj",),
    "self_attention/layer_norm": ("self_attn_layer_norm",),
    "attention/linear_0": ("encoder_attn.q_proj",),
    "attention/linear_1": ("encoder_attn.k_proj", "encoder_attn.v_proj"),
    "attention/linear_2": ("encoder_attn.out_proj",),
    "attention/layer_norm": ("encoder_attn_layer_norm",),
    "ffn/linear_0": ("fc1",),
    "ffn/linear_1": ("fc2",),
    "ffn/layer_norm": ("final_layer_norm",),
}

_TOP_MODULES: dict[str, str] = {
    "encoder/conv1": "model.encoder.conv1",
    "encoder/conv2": "model.encoder.conv2",
    "encoder/position_encodings": "model.encoder.embed_positions",
    "encoder/layer_norm": "model.encoder.layer_norm",
    "decoder/embeddings": "model.decoder.embed_tokens",
    "decoder/position_encodings": "model.decoder.embed_positions",
    "decoder/layer_norm": "model.decoder.layer_norm",
    "decoder/projection": "proj_out",
}

_LEAF_NAMES: dict[str, str] = {
    "weight": "weight",
    "bias": "bias",
    "gamma": "weight",
    "beta": "bias",
    "encodings": "weight",
}

_LAYER_VARIABLE = re.compile(r"^(encoder|decoder)/layer_(\d+)/(.+)$")


@dataclass(slots=True)
class Ct2Model:
    """The parsed contents of a CTranslate2 ``model.bin``, tensors exactly as stored."""

    spec: str
    revision: int
    format_version: int
    variables: dict[str, torch.Tensor]  # name -> tensor; rank-0 tensors are spec attributes
    aliases: dict[str, str]  # alias name -> name of the variable it stands for

    def resolve(self, name: str) -> str:
        """The variable name behind ``name`` (itself unless it is an alias)."""
        return self.aliases.get(name, name)

    def float_tensor(self, name: str) -> torch.Tensor:
        """Variable ``name`` (alias resolved) as float32, dequantized when it has a scale.

        Quantized weights come with ``<name>_scale``: one scale per output row for int8
        (``[out]`` against ``[out, in, ...]``), a single scale for int16; ``w = q / scale``.
        """
        name = self.resolve(name)
        value = self.variables[name].to(torch.float32)
        scale = self.variables.get(f"{name}_scale")
        if scale is None:
            return value
        scale = scale.to(torch.float32)
        if scale.dim() > 0:
            scale = scale.reshape(-1, *([1] * (value.dim() - 1)))
        return value / scale

    def scalar(self, name: str, default: int | float | None = None) -> int | float:
        """The value of a rank-0 variable, or ``default`` when the file lacks it (an error
        when there is no default)."""
        value = self.variables.get(name)
        if value is not None:
            return value.item()
        if default is None:
            raise ValueError(f"CTranslate2 Whisper file lacks variable {name!r}.")
        return default


class _ByteReader:
    """Sequential little-endian reads over the file bytes; every read checks the file's end."""

    def __init__(self, data: Any, path: str) -> None:
        self.data = data
        self.path = path
        self.offset = 0

    def take(self, size: int, what: str) -> int:
        """Reserve the next ``size`` bytes for ``what``; return their offset."""
        start = self.offset
        if start + size > len(self.data):
            raise ValueError(
                f"Truncated CTranslate2 file {self.path}: {what} needs bytes "
                f"{start}..{start + size} but the file has {len(self.data)} bytes."
            )
        self.offset = start + size
        return start

    def unpack(self, fmt: str, what: str) -> tuple:
        return struct.unpack_from("<" + fmt, self.data, self.take(struct.calcsize(fmt), what))

    def uint(self, fmt: str, what: str) -> int:
        return self.unpack(fmt, what)[0]

    def string(self, what: str) -> str:
        size = self.uint("H", f"the length of {what}")
        start = self.take(size, what)
        raw = bytes(self.data[start : start + size])
        if not raw.endswith(b"\0"):
            raise ValueError(f"Corrupt CTranslate2 file {self.path}: {what} lacks its NUL.")
        return raw[:-1].decode("utf-8", errors="replace")


def _read_header(reader: _ByteReader) -> tuple[int, str, int]:
    """Read (format version, spec name, spec revision), rejecting anything but Whisper."""
    version = reader.uint("I", "the format version")
    if version not in _SUPPORTED_FORMAT_VERSIONS:
        raise ValueError(
            f"{reader.path} is not a CTranslate2 model file or has an unsupported format "
            f"version ({version}; supported: {_SUPPORTED_FORMAT_VERSIONS.start}-"
            f"{_SUPPORTED_FORMAT_VERSIONS.stop - 1})."
        )
    spec = reader.string("the spec name")
    revision = reader.uint("I", "the spec revision")
    if spec != _WHISPER_SPEC:
        raise ValueError(
            f"{reader.path} is a CTranslate2 {spec or 'unnamed-spec'} model; "
            "only Whisper is supported."
        )
    return version, spec, revision


def _read_variable(reader: _ByteReader) -> tuple[str, torch.Tensor]:
    """Read one variable record into a tensor that owns its (aligned) memory."""
    name = reader.string("a variable name")
    rank = reader.uint("B", f"the rank of {name!r}")
    shape = reader.unpack(f"{rank}I", f"the shape of {name!r}")
    code = reader.uint("B", f"the dtype of {name!r}")
    if code not in _DTYPES:
        raise ValueError(
            f"Variable {name!r} in {reader.path} has unknown dtype code {code} "
            f"(known: {sorted(_DTYPES)})."
        )
    num_bytes = reader.uint("I", f"the byte count of {name!r}")
    np_dtype, torch_dtype = _DTYPES[code]
    count = int(np.prod(shape, dtype=np.int64))
    if num_bytes != count * np.dtype(np_dtype).itemsize:
        raise ValueError(
            f"Variable {name!r} in {reader.path} declares {num_bytes} bytes for shape "
            f"{list(shape)} of dtype code {code}."
        )
    start = reader.take(num_bytes, f"the data of variable {name!r}")
    # Records start at arbitrary offsets, so copy out of the file to get aligned memory.
    array = np.frombuffer(reader.data, dtype=np_dtype, count=count, offset=start).copy()
    tensor = torch.from_numpy(array.reshape(shape))
    if torch_dtype is torch.bfloat16:
        tensor = tensor.view(torch.int16).view(torch.bfloat16)
    return name, tensor


def _model_file(path: str) -> str:
    """``path`` itself when it is a file, else the ``model.bin`` inside the directory."""
    return os.path.join(path, "model.bin") if os.path.isdir(path) else path


def read_ct2_model(path: str) -> Ct2Model:
    """Parse a CTranslate2 Whisper ``model.bin`` (or the directory holding it)."""
    file_path = _model_file(path)
    with open(file_path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            raise ValueError(f"{file_path} is empty, not a CTranslate2 model file.")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            reader = _ByteReader(data, file_path)
            version, spec, revision = _read_header(reader)
            variables = dict(
                _read_variable(reader) for _ in range(reader.uint("I", "the number of variables"))
            )
            aliases = {}
            for _ in range(reader.uint("I", "the number of aliases")):
                alias = reader.string("an alias name")
                aliases[alias] = reader.string(f"the target of alias {alias!r}")
    for alias, target in aliases.items():
        if target not in variables:
            raise ValueError(f"Alias {alias!r} in {file_path} names missing variable {target!r}.")
    return Ct2Model(spec, revision, version, variables, aliases)


def is_ct2_model_dir(path: str) -> bool:
    """True for a directory with ``model.bin`` whose ``config.json`` (if any) is not HF's.

    A Hugging Face ``config.json`` always has ``model_type`` or ``architectures``; the
    CTranslate2 one only holds generation lists (``suppress_ids``, ``lang_ids``, ...).
    """
    if not os.path.isfile(os.path.join(path, "model.bin")):
        return False
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        return True
    try:
        with open(config_path, encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError):  # unreadable or not JSON: not a directory we know how to load
        return False
    return isinstance(config, dict) and not ({"model_type", "architectures"} & config.keys())


def _read_json(path: str, name: str) -> dict:
    """A JSON file of the model directory, or {} when the directory has none."""
    file_path = os.path.join(path, name)
    if not os.path.isfile(file_path):
        return {}
    with open(file_path, encoding="utf-8") as file:
        return json.load(file)


def _added_token_ids(path: str) -> dict[str, int]:
    """Special-token text -> id, from ``tokenizer.json``'s added tokens."""
    tokenizer = _read_json(path, "tokenizer.json")
    if not tokenizer:
        raise ValueError(f"CTranslate2 Whisper directory {path} has no tokenizer.json.")
    return {token["content"]: int(token["id"]) for token in tokenizer.get("added_tokens", [])}


def _token_config(path: str, is_multilingual: bool) -> dict[str, Any]:
    """Special token ids for ``WhisperConfig`` and Whisper's generation config fields."""
    ids = _added_token_ids(path)
    missing = [t for t in ("<|endoftext|>", "<|startoftranscript|>") if t not in ids]
    if missing:
        raise ValueError(f"tokenizer.json in {path} lacks the special tokens {missing}.")
    eot = ids["<|endoftext|>"]
    config: dict[str, Any] = {
        "decoder_start_token_id": ids["<|startoftranscript|>"],
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "no_timestamps_token_id": ids.get("<|notimestamps|>"),
        "prev_sot_token_id": ids.get("<|startofprev|>"),
    }
    if is_multilingual:
        ct2_config = _read_json(path, "config.json")
        id_to_token = {token_id: token for token, token_id in ids.items()}
        lang_ids = ct2_config.get("lang_ids", [])
        config["lang_to_id"] = {id_to_token[i]: i for i in lang_ids if i in id_to_token}
        config["task_to_id"] = {
            task: ids[f"<|{task}|>"] for task in ("translate", "transcribe") if f"<|{task}|>" in ids
        }
    return config


def _generation_lists(path: str) -> dict[str, Any]:
    """The generation lists of the CTranslate2 ``config.json`` under their HF names."""
    ct2_config = _read_json(path, "config.json")
    config: dict[str, Any] = {}
    for ct2_key, hf_key in (
        ("suppress_ids", "suppress_tokens"),
        ("suppress_ids_begin", "begin_suppress_tokens"),
        ("alignment_heads", "alignment_heads"),
    ):
        if ct2_key in ct2_config:
            config[hf_key] = ct2_config[ct2_key]
    return config


def _num_layers(model: Ct2Model, stack: str) -> int:
    """Number of ``<stack>/layer_<i>`` blocks in the file."""
    indices = {
        int(match.group(2))
        for match in map(_LAYER_VARIABLE.match, model.variables)
        if match and match.group(1) == stack
    }
    if indices != set(range(len(indices))) or not indices:
        raise ValueError(f"CTranslate2 Whisper file has {stack} layers {sorted(indices)}.")
    return len(indices)


def _storage_dtype_name(model: Ct2Model) -> str:
    """The float dtype the weights are stored in; quantized weights dequantize to float32."""
    dtype = model.variables["decoder/embeddings/weight"].dtype
    return str(dtype).removeprefix("torch.") if dtype.is_floating_point else "float32"


def _activation(model: Ct2Model) -> str:
    code = int(model.scalar("decoder/activation", 3))
    if code not in _ACTIVATIONS:
        raise ValueError(f"Unsupported CTranslate2 activation code {code} in a Whisper model.")
    return _ACTIVATIONS[code]


def _shape(model: Ct2Model, name: str) -> tuple[int, ...]:
    if name not in model.variables:
        raise ValueError(f"CTranslate2 Whisper file lacks variable {name!r}.")
    return tuple(model.variables[name].shape)


def load_ct2_config(path: str) -> dict:
    """``transformers.WhisperConfig`` kwargs for the CTranslate2 Whisper directory ``path``.

    Sizes come from tensor shapes and the ``num_heads`` attributes; token ids from the
    tokenizer; generation lists from the CTranslate2 ``config.json``. ``is_multilingual`` is
    False for the English-only (``.en``) models, whose vocabulary has 51864 tokens.
    """
    model = read_ct2_model(path)
    vocab_size, d_model = _shape(model, "decoder/embeddings/weight")
    is_multilingual = vocab_size >= _MULTILINGUAL_VOCAB_SIZE
    config: dict[str, Any] = {
        "model_type": "whisper",
        "architectures": ["WhisperForConditionalGeneration"],
        "vocab_size": vocab_size,
        "d_model": d_model,
        "num_mel_bins": _shape(model, "encoder/conv1/weight")[1],
        "encoder_layers": _num_layers(model, "encoder"),
        "decoder_layers": _num_layers(model, "decoder"),
        "encoder_attention_heads": int(model.scalar("encoder/num_heads")),
        "decoder_attention_heads": int(model.scalar("decoder/num_heads")),
        "encoder_ffn_dim": _shape(model, "encoder/layer_0/ffn/linear_0/weight")[0],
        "decoder_ffn_dim": _shape(model, "decoder/layer_0/ffn/linear_0/weight")[0],
        "max_source_positions": _shape(model, "encoder/position_encodings/encodings")[0],
        "max_target_positions": _shape(model, "decoder/position_encodings/encodings")[0],
        "activation_function": _activation(model),
        "scale_embedding": bool(model.scalar("decoder/scale_embeddings", 0)),
        "tie_word_embeddings": model.resolve("decoder/projection/weight")
        == "decoder/embeddings/weight",
        "dtype": _storage_dtype_name(model),
        "is_multilingual": is_multilingual,
    }
    config.update(_token_config(path, is_multilingual))
    config.update(_generation_lists(path))
    return config


def _hf_names(ct2_name: str) -> tuple[str, ...]:
    """HF names of the rows of ``ct2_name`` in order (several for a fused projection).

    Example: ``decoder/layer_1/attention/linear_1/bias`` ->
    ``(model.decoder.layers.1.encoder_attn.k_proj.bias, ...encoder_attn.v_proj.bias)``.
    """
    scope, leaf = ct2_name.rsplit("/", 1)
    layer = _LAYER_VARIABLE.match(scope)
    if layer is not None and layer.group(3) in _LAYER_MODULES:
        stack, index, part = layer.groups()
        modules = tuple(f"model.{stack}.layers.{index}.{module}" for module in _LAYER_MODULES[part])
    elif scope in _TOP_MODULES:
        modules = (_TOP_MODULES[scope],)
    else:
        modules = ()
    if not modules or leaf not in _LEAF_NAMES:
        raise ValueError(f"Unknown CTranslate2 Whisper variable {ct2_name!r}.")
    return tuple(f"{module}.{_LEAF_NAMES[leaf]}" for module in modules)


def _is_weight(model: Ct2Model, name: str) -> bool:
    """True for model weights; False for rank-0 attributes and quantization scales."""
    if name.endswith("_scale") and name.removesuffix("_scale") in model.variables:
        return False
    return model.variables[model.resolve(name)].dim() > 0


def load_ct2_state_dict(path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-named ``WhisperForConditionalGeneration`` tensors in ``dtype`` from ``path``.

    Fused projections are split by rows (q, k, v for self-attention; k, v for the
    cross-attention's memory projection). The k-projection biases are dropped: HF's Whisper
    has none, and a bias on keys adds ``q . b_k`` to every score of a query alike, which the
    softmax cancels. The tied output projection is emitted as ``proj_out.weight`` too, so a
    strict ``load_state_dict`` succeeds.
    """
    model = read_ct2_model(path)
    state_dict: dict[str, torch.Tensor] = {}
    for ct2_name in [*model.variables, *model.aliases]:
        if not _is_weight(model, ct2_name):
            continue
        names = _hf_names(ct2_name)
        tensor = model.float_tensor(ct2_name)
        if tensor.shape[0] % len(names):
            raise ValueError(
                f"Cannot split {ct2_name!r} of shape {list(tensor.shape)} "
                f"into {len(names)} projections."
            )
        for name, part in zip(names, tensor.chunk(len(names), dim=0)):
            if name.endswith("k_proj.bias"):
                continue
            state_dict[name] = part.to(dtype).contiguous()
    return state_dict


def _timestamp_tokens(path: str, tokenizer_size: int) -> list[str]:
    """``vocabulary.txt`` entries past the tokenizer's end (Whisper's ``<|0.00|>``...)."""
    vocab_path = os.path.join(path, "vocabulary.txt")
    if not os.path.isfile(vocab_path):
        return []
    with open(vocab_path, encoding="utf-8") as file:
        tokens = file.read().splitlines()
    return tokens[tokenizer_size:]


def load_ct2_tokenizer(path: str) -> Any:
    """A ``transformers`` Whisper tokenizer from the directory's ``tokenizer.json``.

    Converted tokenizers often stop before the timestamp tokens that the model's vocabulary
    ends with; those are added from ``vocabulary.txt`` so every model id decodes (Whisper's
    ``decode`` strips timestamp text unless asked for it).
    """
    # transformers 5 maps the Fast name to `WhisperTokenizer` at run time (4.x defines it);
    # its stubs do not list it.
    from transformers import (
        AddedToken,
        WhisperTokenizerFast,  # pyright: ignore[reportAttributeAccessIssue]
    )

    tokenizer_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
        raise ValueError(f"CTranslate2 Whisper directory {path} has no tokenizer.json.")
    tokenizer = WhisperTokenizerFast(tokenizer_file=tokenizer_file)
    extra = _timestamp_tokens(path, len(tokenizer))
    if extra:
        tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in extra])
        if tokenizer.convert_tokens_to_ids(extra[-1]) != len(tokenizer) - 1:
            raise ValueError(f"vocabulary.txt in {path} does not extend tokenizer.json.")
    return tokenizer


def load_ct2_feature_extractor(path: str) -> Any:
    """The log-mel feature extractor for the model (16 kHz audio, 30 s windows)."""
    from transformers import WhisperFeatureExtractor

    if os.path.isfile(os.path.join(path, "preprocessor_config.json")):
        return WhisperFeatureExtractor.from_pretrained(path, local_files_only=True)
    num_mel_bins = _shape(read_ct2_model(path), "encoder/conv1/weight")[1]
    return WhisperFeatureExtractor(feature_size=num_mel_bins)
