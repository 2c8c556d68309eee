"""The CLIP and SigLIP vision towers (`vllm/model_executor/models/clip.py`) equal to
transformers' on the same random weights: every hidden state transformers returns, and
SigLIP's `last_hidden_state` (after `post_layernorm`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vllm.model_executor.models.clip import (
    CLIPVisionModel,
    SiglipVisionModel,
    vision_tower,
)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            norm = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            param.copy_(norm + 0.2 * torch.randn(param.shape, generator=generator))


def _pair(kind: str, seed: int = 0):
    """(transformers' tower, ours with its weights) of a tiny config of `kind`."""
    import transformers

    sizes: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=4, image_size=28, patch_size=7)
    if kind == "clip":
        config = transformers.CLIPVisionConfig(**sizes)
        hf = transformers.CLIPVisionModel(config).eval()
    else:
        config = transformers.SiglipVisionConfig(**sizes)
        hf = transformers.SiglipVisionModel(config).eval()
    _randomize(hf, seed)
    ours = vision_tower(config)
    names = {name.removeprefix("vision_model."): t for name, t in hf.state_dict().items()}
    loaded = ours.load_weights(names.items())
    assert loaded == set(dict(ours.named_parameters()))  # every parameter from the checkpoint
    return hf, ours


@pytest.mark.parametrize("kind", ["clip", "siglip"])
@torch.inference_mode()
def test_hidden_states_equal_transformers(kind: str) -> None:
    hf, ours = _pair(kind)
    assert isinstance(ours, CLIPVisionModel if kind == "clip" else SiglipVisionModel)
    pixels = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    expected = hf(pixel_values=pixels, output_hidden_states=True).hidden_states
    got = ours.hidden_states(pixels, list(range(len(expected))))
    positions = 16 + (1 if kind == "clip" else 0)
    for e, g in zip(expected, got, strict=True):
        assert g.shape == (2, positions, 32)
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    # negative indices count from the end, as transformers' tuple does
    torch.testing.assert_close(ours.hidden_states(pixels, [-2])[0], expected[-2],
                               rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_siglip_last_hidden_state_equals_transformers() -> None:
    hf, ours = _pair("siglip", seed=3)
    pixels = torch.randn(3, 3, 28, 28, generator=torch.Generator().manual_seed(2))
    expected = hf(pixel_values=pixels).last_hidden_state
    got = ours(pixels)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # the post-layernorm matters: the last layer's raw output differs
    assert not torch.allclose(ours.hidden_states(pixels, [-1])[0], expected, atol=1e-3)


def test_unknown_tower_is_refused() -> None:
    from transformers import Dinov2Config

    with pytest.raises(ValueError, match="'dinov2' vision tower is not supported"):
        vision_tower(Dinov2Config())
