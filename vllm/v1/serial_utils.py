"""Msgpack encoding (msgspec) for the engine-core wire types, with tensors as raw buffers.

A message is a list of frames: frame 0 is the msgpack body; every tensor in the body is a
msgpack extension holding `(dtype, shape, frame index)`, and its bytes travel as their own
frame, so a large `prompt_embeds` is never copied into the body nor pickled.

    frames = MsgpackEncoder().encode(request)
    # [b"\\x87\\xaarequest_id...", <memoryview 2560 bytes>]     body, then tensor bytes
    MsgpackDecoder(EngineCoreRequest).decode(frames)  # -> EngineCoreRequest, same tensor
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import torch

_TENSOR_EXT = 1

# Only plain numeric dtypes may cross; the decoder never resolves an arbitrary name.
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
}

Frame = bytes | memoryview


class MsgpackEncoder:
    """Encodes dataclasses, NamedTuples, enums and CPU/GPU tensors into frames.

    Not thread-safe: the tensor buffers of the message being encoded are kept on the
    instance until `encode` returns.
    """

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._aux: list[Frame] = []

    def encode(self, obj: Any) -> list[Frame]:
        self._aux = []
        try:
            body = self._encoder.encode(obj)
            return [body, *self._aux]
        finally:
            self._aux = []

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._encode_tensor(obj)
        raise NotImplementedError(f"Cannot send a {type(obj).__name__} to the engine core.")

    def _encode_tensor(self, tensor: torch.Tensor) -> msgspec.msgpack.Ext:
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise NotImplementedError(f"Cannot send a tensor of dtype {tensor.dtype}.")
        if tensor.layout != torch.strided:
            raise NotImplementedError(f"Cannot send a tensor with layout {tensor.layout}.")
        # Viewing as bytes works for every dtype, bfloat16 included (numpy has no bfloat16).
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._aux.append(raw.data)
        header = (dtype, list(tensor.shape), len(self._aux))  # index of the frame
        return msgspec.msgpack.Ext(_TENSOR_EXT, msgspec.msgpack.encode(header))


class MsgpackDecoder:
    """Decodes frames made by `MsgpackEncoder` into `msg_type` (or plain objects if None).

    Tensors come back as CPU tensors that own their memory.
    """

    def __init__(self, msg_type: Any = None) -> None:
        kwargs: dict[str, Any] = {"ext_hook": self._ext_hook, "dec_hook": self._dec_hook}
        if msg_type is not None:
            kwargs["type"] = msg_type
        self._decoder = msgspec.msgpack.Decoder(**kwargs)
        self._frames: Sequence[Frame] = ()

    def decode(self, frames: Sequence[Frame]) -> Any:
        self._frames = frames
        try:
            return self._decoder.decode(frames[0])
        finally:
            self._frames = ()

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code != _TENSOR_EXT:
            raise msgspec.DecodeError(f"Unknown msgpack extension type {code}.")
        dtype_name, shape, index = msgspec.msgpack.decode(data)
        dtype = _DTYPES.get(dtype_name)
        if dtype is None or not 0 < index < len(self._frames):
            raise msgspec.DecodeError(f"Bad tensor header {(dtype_name, shape, index)!r}.")
        buffer = self._frames[index]
        if len(buffer) == 0:
            return torch.empty(shape, dtype=dtype)
        # bytearray copies the (read-only) frame once, so the tensor owns writable memory.
        flat = torch.frombuffer(bytearray(buffer), dtype=torch.uint8)
        return flat.view(dtype).reshape(shape)

    @staticmethod
    def _dec_hook(type_: Any, obj: Any) -> Any:
        if type_ is torch.Tensor and isinstance(obj, torch.Tensor):
            return obj
        raise NotImplementedError(f"Cannot decode {type_!r} from {type(obj).__name__}.")
