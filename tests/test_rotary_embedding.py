"""Rope scalings against transformers' own rotary embedding: the cos/sin of every position
(for the length-dependent scalings, the row transformers uses for the newest token of a
sequence ending there)."""

from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.rotary_embedding import (
    RotaryEmbedding,
    apply_rotary,
    rope_parameters_of,
)

MAX_POSITIONS = 64
SCALINGS = {
    "default": {},
    "linear": {"factor": 2.5},
    "dynamic": {"factor": 3.0},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-mscale": {"factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.7,
                    "mscale_all_dim": 0.3, "beta_fast": 16, "beta_slow": 2},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "longrope": {"short_factor": [1.0, 1.1, 1.3, 1.7, 2.0, 2.5, 3.0, 3.5],
                 "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0],
                 "original_max_position_embeddings": 20},
}


def _config(name: str, **extra):
    from transformers import LlamaConfig

    params = {"rope_type": name.split("-")[0], "rope_theta": 500.0, **SCALINGS[name]}
    return LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                       max_position_embeddings=24, rope_parameters=params, **extra)


def _hf_rows(config, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos/sin of position p when p is the newest of p + 1 tokens."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cos, sin = [], []
    for p in positions:
        rope = LlamaRotaryEmbedding(config)
        c, s = rope(torch.zeros(1, dtype=torch.float32), torch.arange(p + 1)[None])
        cos.append(c[0, -1])
        sin.append(s[0, -1])
    return torch.stack(cos), torch.stack(sin)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_cos_sin_match_transformers(name):
    config = _config(name)
    ours = RotaryEmbedding(config, 16, MAX_POSITIONS, torch.float32)
    positions = list(range(MAX_POSITIONS))
    hf_cos, hf_sin = _hf_rows(config, positions)
    torch.testing.assert_close(ours.cos, hf_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.sin, hf_sin, atol=1e-6, rtol=0)
    if name not in ("default", "dynamic", "linear", "llama3"):  # these scale cos/sin
        assert ours.cos[0, 0] != 1.0


def test_length_dependent_scalings_change_past_the_original_length():
    dynamic = RotaryEmbedding(_config("dynamic"), 16, MAX_POSITIONS, torch.float32)
    plain = RotaryEmbedding(_config("default"), 16, MAX_POSITIONS, torch.float32)
    assert torch.equal(dynamic.cos[:24], plain.cos[:24])
    assert not torch.allclose(dynamic.cos[24:], plain.cos[24:])
    longrope = RotaryEmbedding(_config("longrope"), 16, MAX_POSITIONS, torch.float32)
    short = _config("longrope")
    short.rope_parameters["long_factor"] = SCALINGS["longrope"]["short_factor"]
    short_rope = RotaryEmbedding(short, 16, MAX_POSITIONS, torch.float32)
    assert torch.equal(longrope.cos[:20], short_rope.cos[:20])
    assert not torch.allclose(longrope.cos[20:], short_rope.cos[20:])


def test_partial_rotary_keeps_the_other_channels():
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    config = _config("default")
    config.rope_parameters["partial_rotary_factor"] = 0.5
    rope = RotaryEmbedding(config, 16, MAX_POSITIONS, torch.float32)
    assert rope.cos.shape == (MAX_POSITIONS, 8)
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    positions = torch.tensor([0, 3, 9, 2, 40])
    ours_q, ours_k = apply_rotary(rope.lookup(positions), q, k)
    cos, sin = rope.cos[positions][None], rope.sin[positions][None]
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                        cos, sin)
    torch.testing.assert_close(ours_q, ref_q[0].transpose(0, 1))
    torch.testing.assert_close(ours_k, ref_k[0].transpose(0, 1))
    assert torch.equal(ours_q[..., 8:], q[..., 8:])


def test_rope_parameters_of_old_configs_and_bad_types():
    from types import SimpleNamespace

    old = SimpleNamespace(rope_scaling={"type": "su", "short_factor": [1.0],
                                        "long_factor": [2.0]}, rope_theta=1e4)
    params = rope_parameters_of(old)
    assert params["rope_type"] == "longrope" and params["rope_theta"] == 1e4
    bad = SimpleNamespace(rope_parameters={"rope_type": "wavy", "rope_theta": 1e4},
                          max_position_embeddings=32)
    with pytest.raises(ValueError, match="'wavy'.*supported: default, linear, dynamic"):
        RotaryEmbedding(bad, 16, 32, torch.float32)
    missing = SimpleNamespace(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4,
                                               "factor": 8.0}, max_position_embeddings=32)
    with pytest.raises(ValueError, match="needs low_freq_factor, high_freq_factor"):
        RotaryEmbedding(missing, 16, 32, torch.float32)
