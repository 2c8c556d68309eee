"""Gemma 3's prompts without an engine (`vllm/multimodal/gemma3.py`): boi expanded to the
image's sequence as transformers' Gemma3Processor does, images preprocessed equal to its
image processor, refusals; and the step's key ends of bidirectional spans
(`step_inputs.bidirectional_key_ends`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
import torch

from tests.model_factory import GEMMA3_TOKENS, make_tiny_tokenizer
from vllm.config import ModelConfig
from vllm.multimodal.gemma3 import Gemma3PromptProcessor
from vllm.v1.worker.step_inputs import bidirectional_key_ends, compute_step_indices

RUN = 4  # image positions of the configs below
SIDE = 28


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    from transformers import AutoTokenizer
    from transformers.models.gemma3.image_processing_pil_gemma3 import (
        Gemma3ImageProcessorPil,
    )

    path = str(tmp_path_factory.mktemp("gemma3_prompts"))
    make_tiny_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": list(GEMMA3_TOKENS.values())})
    tokenizer.save_pretrained(path)
    Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE}).save_pretrained(path)
    return path


def _processor(path: str, max_model_len: int = 64) -> Gemma3PromptProcessor:
    from transformers import AutoTokenizer, Gemma3Config, SiglipVisionConfig

    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in GEMMA3_TOKENS.items()}
    config = Gemma3Config(vision_config=SiglipVisionConfig(image_size=SIDE, patch_size=7)
                          .to_dict(), mm_tokens_per_image=RUN,
                          boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
                          image_token_index=ids["image_token"],
                          architectures=["Gemma3ForConditionalGeneration"])
    model_config = ModelConfig(model=path, tokenizer=path, hf_config=config,
                               dtype=torch.float32, max_model_len=max_model_len)
    return Gemma3PromptProcessor(model_config, tokenizer)


def _image(seed: int, shape: tuple[int, ...] = (20, 30, 3)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def test_a_bare_boi_becomes_the_image_sequence(tokenizer_dir) -> None:
    p = _processor(tokenizer_dir)
    boi, soft, eoi, nl = p.boi_token_id, p.image_token_id, p.eoi_token_id, p.newline_ids
    prompt = p.process([1, 7, boi, 9], {"image": _image(0)})
    assert prompt.token_ids == [1, 7, *nl, boi, *[soft] * RUN, eoi, *nl, 9]
    start = 3 + len(nl)
    assert [item.offset for item in prompt.items] == [start]
    assert prompt.is_token.tolist() == [i not in range(start, start + RUN)
                                        for i in range(len(prompt.token_ids))]
    # an expanded sequence (a text prompt's, after `expand_text`) is taken as it is
    assert p.process(prompt.token_ids, {"image": _image(0)}).token_ids == prompt.token_ids


def test_text_expands_as_transformers_processor(tokenizer_dir) -> None:
    from transformers import AutoTokenizer, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import (
        Gemma3ImageProcessorPil,
    )

    p = _processor(tokenizer_dir)
    hf = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil.from_pretrained(tokenizer_dir),
        tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir,
                                                extra_special_tokens=GEMMA3_TOKENS),
        image_seq_length=RUN)
    text = "Look:\n<start_of_image>\nand <start_of_image>."
    images = [_image(1), _image(2, (33, 17, 4))]
    expected = hf(text=text, images=images, return_tensors="np")  # type: ignore[call-arg]
    ids = list(hf.tokenizer.encode(p.expand_text(text)))
    prompt = p.process(ids, {"image": images})
    assert prompt.token_ids == expected["input_ids"][0].tolist()
    assert (~prompt.is_token).int().tolist() == expected["token_type_ids"][0].tolist()
    for item, pixels in zip(prompt.items, expected["pixel_values"], strict=True):
        assert item.data is not None and torch.equal(item.data, torch.from_numpy(pixels))


def test_refusals(tokenizer_dir, tmp_path) -> None:
    p = _processor(tokenizer_dir)
    boi, soft = p.boi_token_id, p.image_token_id
    with pytest.raises(ValueError, match=r"has 1 image placeholder\(s\).*but 2 image"):
        p.process([1, boi], {"image": [_image(0), _image(1)]})
    with pytest.raises(ValueError, match="is 2 long; Gemma 3 takes 4 per image"):
        p.process([1, boi, soft, soft, 9], {"image": _image(0)})
    with pytest.raises(ValueError, match="longer than the maximum model length of 8"):
        _processor(tokenizer_dir, max_model_len=8).process([1, boi], {"image": _image(0)})
    import shutil

    shutil.copytree(tokenizer_dir, tmp_path / "pan", dirs_exist_ok=True)
    config_file = tmp_path / "pan" / "preprocessor_config.json"
    config_file.write_text(config_file.read_text().replace(
        '"do_convert_rgb"', '"do_pan_and_scan": true, "do_convert_rgb"'))
    with pytest.raises(ValueError, match="pan-and-scan"):
        _processor(str(tmp_path / "pan"))


def test_key_ends_widen_queries_in_spans_only() -> None:
    """Two requests: the first holds the span [2, 6), positions 0..7 scheduled; the
    second (no span) positions 3..4 -> [1, 2, 6, 6, 6, 6, 7, 8, 4, 5]. A step whose
    positions miss every span has none."""
    states = [SimpleNamespace(bidirectional_spans=[(2, 6)]),
              SimpleNamespace(bidirectional_spans=[])]
    batch = cast(Any, SimpleNamespace(num_reqs=2, state=lambda row: states[row]))
    idx = compute_step_indices(np.array([8, 2], dtype=np.int32),
                               np.array([0, 3], dtype=np.int32), 64)
    key_ends = bidirectional_key_ends(batch, idx)
    assert key_ends is not None and key_ends.tolist() == [1, 2, 6, 6, 6, 6, 7, 8, 4, 5]
    later = compute_step_indices(np.array([1, 1], dtype=np.int32),
                                 np.array([8, 5], dtype=np.int32), 64)
    assert bidirectional_key_ends(batch, later) is None
