"""K-quant encoders written from the GGUF layouts (gguf-py decodes these types but cannot
encode them), for test files in the types llama.cpp's `Q4_K_M` files carry.

Simple round-to-nearest encoders (no search for the best scales as llama.cpp's have): the
tests need valid blocks near the weights, not llama.cpp's exact bytes.
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def _as_f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def encode_q4_k(w: np.ndarray) -> np.ndarray:
    """[N, K] float (K % 256 == 0) -> Q4_K blocks, uint8 [N, K / 256 * 144].

    Block: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
    (group 2p's values in the low nibbles of bytes 32p.., group 2p + 1's in the high ones);
    w = d * sc * q - dmin * m."""
    n, k = w.shape
    x = w.reshape(n, k // QK_K, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(-1), 0)  # [n, b, 8]
    scale = (x.max(-1) - lo) / 15
    d = scale.max(-1) / 63
    dmin = (-lo).max(-1) / 63
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(
        np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.round(scale / d16[..., None])), 0, 63).astype(np.uint8)
        mn = np.clip(np.nan_to_num(np.round(-lo / dmin16[..., None])), 0, 63).astype(np.uint8)
        step = (d16[..., None] * sc)[..., None]
        q = np.nan_to_num(np.round((x + (dmin16[..., None] * mn)[..., None]) / step))
    q = np.clip(q, 0, 15).astype(np.uint8)
    scales = np.zeros((n, k // QK_K, 12), np.uint8)
    scales[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    scales[..., 4:8] = (mn[..., 0:4] & 63) | ((mn[..., 4:8] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:8] & 0xF) | ((mn[..., 4:8] & 0xF) << 4)
    qs = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(n, k // QK_K, 128)
    blocks = np.concatenate([_as_f16(d), _as_f16(dmin), scales, qs], axis=-1)
    return blocks.reshape(n, -1)


def encode_q6_k(w: np.ndarray) -> np.ndarray:
    """[N, K] float (K % 256 == 0) -> Q6_K blocks, uint8 [N, K / 256 * 210].

    Block: 128 bytes of low nibbles, 64 bytes of high bit pairs, 16 int8 scales (one per 16
    values), fp16 d; w = d * sc * (q - 32). In each half of 128 values, group g (of 32)
    takes the low (g < 2) or high nibbles of bytes 32 (g % 2).. of the half's 64, and bits
    2g, 2g + 1 of the half's 32 high bytes."""
    n, k = w.shape
    x = w.reshape(n, k // QK_K, 16, 16).astype(np.float32)
    scale = np.abs(x).max(-1) / 31  # [n, b, 16]
    d = scale.max(-1) / 127
    d16 = d.astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.round(scale / d16[..., None])), -128, 127).astype(np.int8)
        step = (d16[..., None] * sc)[..., None]
        q = np.nan_to_num(np.round(x / step))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, k // QK_K, 2, 4, 32)
    low, high = q & 0xF, q >> 4
    ql = np.concatenate([low[:, :, :, 0] | (low[:, :, :, 2] << 4),
                         low[:, :, :, 1] | (low[:, :, :, 3] << 4)], axis=-1)  # [n, b, 2, 64]
    qh = high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4) | (
        high[:, :, :, 3] << 6)  # [n, b, 2, 32]
    blocks = np.concatenate([ql.reshape(n, k // QK_K, 128), qh.reshape(n, k // QK_K, 64),
                             sc.view(np.uint8), _as_f16(d)], axis=-1)
    return blocks.reshape(n, -1)
