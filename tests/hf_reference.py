"""Reference generations from Hugging Face transformers, for parity tests."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch


class Reference(NamedTuple):
    token_ids: list[int]
    logprobs: torch.Tensor  # [num_steps, vocab] float32, raw model log-softmax


@functools.lru_cache(maxsize=4)
def load_hf_model(path: str, dtype: torch.dtype = torch.float32):
    """A transformers model for a local directory or a GGUF file (via our own loader)."""
    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        from transformers import AutoConfig

        from vllm.model_executor.model_loader.gguf_loader import (
            load_gguf_config,
            load_gguf_state_dict,
        )

        config_dict = dict(load_gguf_config(path))
        config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.load_state_dict(load_gguf_state_dict(path, dtype), strict=False)
        model.tie_weights()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int] | None, max_tokens: int,
              inputs_embeds: torch.Tensor | None = None) -> Reference:
    """Greedy decoding of exactly `max_tokens` tokens with the KV cache; nothing is
    suppressed (unlike `generate(min_new_tokens=...)`, which masks EOS)."""
    if inputs_embeds is not None:
        out = model(inputs_embeds=inputs_embeds[None].to(model.dtype), use_cache=True)
    else:
        out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    tokens, logprobs = [], []
    for _ in range(max_tokens):
        step_logprobs = torch.log_softmax(out.logits[0, -1].float(), -1)
        token = int(step_logprobs.argmax())
        tokens.append(token)
        logprobs.append(step_logprobs)
        out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values,
                    use_cache=True)
    return Reference(tokens, torch.stack(logprobs))


def assert_close_greedy(ours_tokens: list[int], ours_logprobs: list[dict] | None,
                        ref: Reference, k: int = 5) -> None:
    """Same tokens up to a first divergence; there each side's token is in the other's
    top-k. (bfloat16 rounding can flip a near-tie; after a divergence sequences differ.)"""
    for i, (a, b) in enumerate(zip(ours_tokens, ref.token_ids)):
        if a == b:
            continue
        ref_top = ref.logprobs[i].topk(k).indices.tolist()
        assert a in ref_top, f"step {i}: our token {a} not in reference top-{k} {ref_top}"
        assert ours_logprobs is not None
        assert b in ours_logprobs[i], (f"step {i}: reference token {b} not in our top-{k} "
                                       f"{list(ours_logprobs[i])}")
        return
    assert len(ours_tokens) == len(ref.token_ids)


def assert_identical_greedy(outputs, refs: list[Reference], atol: float = 1e-4) -> None:
    """Float32 parity: each output's first completion has the reference's tokens exactly,
    and its chosen tokens' logprobs within `atol` of the reference's."""
    for out, ref in zip(outputs, refs, strict=True):
        completion = out.outputs[0]
        assert completion.token_ids == ref.token_ids, out.prompt
        ours = torch.tensor([lp[t].logprob for lp, t in
                             zip(completion.logprobs, completion.token_ids)])
        theirs = ref.logprobs.gather(1, torch.tensor(ref.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(ours, theirs, atol=atol, rtol=0)
