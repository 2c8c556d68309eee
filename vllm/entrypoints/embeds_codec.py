"""`prompt_embeds` on the wire: base64 of `torch.save(tensor)`, decoded from untrusted input
into a dense tensor (the server's completion prompts and chat parts, and `LLM.chat`'s).

Every step is bounded by one byte budget, checked before the work it guards:

    base64 text ──len──► bytes ──zip entries──► torch.load(weights_only) ──dense size──► tensor
     ≤ 4/3 budget          ≤ budget, stored        sparse invariants checked     ≤ budget

Shape, hidden size, dtype and finiteness are then checked by the same code as offline
(`vllm.inputs.parse.validate_prompt_embeds`, via the Processor).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import zipfile

import torch

_SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
                   torch.sparse_bsc)
# torch.save's zip framing and pickled metadata, on top of the tensor bytes.
_SERIALIZATION_OVERHEAD = 64 * 1024
_MAX_ERROR_DETAIL = 300


def encode_tensor(tensor: torch.Tensor) -> str:
    """base64 of `torch.save(tensor)`: what `prompt_embeds` takes (and hidden states return)."""
    buffer = io.BytesIO()
    torch.save(tensor.contiguous(), buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def prompt_embeds_byte_budget(max_model_len: int, hidden_size: int) -> int:
    """The largest payload worth decoding: max_model_len rows of float64, plus framing."""
    return max_model_len * hidden_size * 8 + _SERIALIZATION_OVERHEAD


def decode_prompt_embeds(data: object, max_bytes: int, name: str = "prompt_embeds"
                         ) -> torch.Tensor:
    """Returns the dense CPU tensor in `data`; raises ValueError saying what is wrong (the
    field by `name`)."""
    if not isinstance(data, str):
        raise ValueError(f"{name} must be a base64 string (of torch.save(tensor) bytes).")
    max_chars = 4 * math.ceil(max_bytes / 3)
    if len(data) > max_chars:
        raise ValueError(f"{name} payload is {len(data)} base64 characters, over the "
                         f"limit of {max_chars} ({max_bytes} bytes) for this model.")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{name} is not valid base64.") from None
    _check_zip_archive(raw, max_bytes, name)
    try:
        with torch.sparse.check_sparse_tensor_invariants():
            obj = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:
        detail = f"{type(e).__name__}: {e}"[:_MAX_ERROR_DETAIL]
        raise ValueError(f"{name} could not be loaded as a tensor ({detail}).") from None
    if not isinstance(obj, torch.Tensor):
        raise ValueError(f"{name} must decode to a torch.Tensor, got "
                         f"{type(obj).__name__}.")
    dense_bytes = math.prod(obj.shape) * obj.element_size()
    if dense_bytes > max_bytes:
        raise ValueError(f"{name} of shape {tuple(obj.shape)} would take {dense_bytes} "
                         f"bytes, over the limit of {max_bytes} bytes for this model.")
    if obj.layout in _SPARSE_LAYOUTS:
        return obj.to_dense()
    if obj.layout != torch.strided:
        raise ValueError(f"{name} has an unsupported layout {obj.layout}.")
    return obj


def _check_zip_archive(raw: bytes, max_bytes: int, name: str) -> None:
    """Accepts only torch.save's zip format with stored (uncompressed) entries, so what
    torch.load reads can never be larger than the payload itself."""
    if not zipfile.is_zipfile(io.BytesIO(raw)):
        raise ValueError(f"{name} must be the bytes of torch.save(tensor) (zip format).")
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        raise ValueError(f"{name} is not a valid torch.save archive ({e}).") from None
    total = 0
    for entry in entries:
        if entry.compress_type != zipfile.ZIP_STORED or entry.file_size != entry.compress_size:
            raise ValueError(f"{name} archive has compressed entries; save it with "
                             "torch.save.")
        total += entry.file_size
    if total > max_bytes:
        raise ValueError(f"{name} archive holds {total} bytes, over the limit of "
                         f"{max_bytes} bytes for this model.")
