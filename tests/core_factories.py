"""Small factories for CPU tests of the engine core: requests, schedulers, runner outputs.

Requests get increasing arrival times in creation order (unless given one), so "oldest
first" is the order the test created them in, independent of the clock.
"""

from __future__ import annotations

import hashlib
import itertools
from types import SimpleNamespace

import torch

from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.attention.backends.abstract import CommonAttentionMetadata
from vllm.v1.core.kv_cache_groups import KVCacheGroupSpec
from vllm.v1.core.kv_cache_utils import make_block_hasher
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EncoderInput, EngineCoreRequest
from vllm.v1.engine.media_rows import MediaRows
from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output.manager import StructuredOutputManager
from vllm.v1.worker.model_runner import ModelRunner

EOS_TOKEN_ID = 2
HIDDEN = 8  # hidden size of the stub model and of test prompt embeds
_arrival = itertools.count(1)


def make_params(**kwargs) -> SamplingParams:
    """`SamplingParams` as the processor leaves them: `eos_token_id` filled in."""
    kwargs.setdefault("max_tokens", 16)
    params = SamplingParams(**kwargs)
    params.eos_token_id = EOS_TOKEN_ID
    return params


def make_encoder_input(name: str, num_tokens: int) -> EncoderInput:
    """A token-id encoder input of `num_tokens` rows whose content hash is named by `name`:
    two inputs made with the same name are the same input (they share cross blocks)."""
    return EncoderInput(token_ids=[3 + i for i in range(num_tokens)], features=None,
                        num_tokens=num_tokens,
                        content_hash=hashlib.sha256(f"encoder:{name}".encode()).digest())


def make_request(
    request_id: str,
    prompt_token_ids: list[int] | None = None,
    *,
    prompt_embeds: torch.Tensor | None = None,
    arrival_time: float | None = None,
    eos_token_id: int | None = EOS_TOKEN_ID,
    encoder_input: EncoderInput | None = None,
    prompt_is_token_ids: torch.Tensor | None = None,
    mrope_positions: torch.Tensor | None = None,
    **params,
) -> EngineCoreRequest:
    """An `EngineCoreRequest`; `params` are `SamplingParams` fields (max_tokens=16 default).

    Exactly one of `prompt_token_ids` and `prompt_embeds` must be given (for an
    encoder/decoder request, the decoder prompt; see `make_encoder_input`), or both with
    `prompt_is_token_ids` for a mixed prompt.
    """
    assert ((prompt_token_ids is None) != (prompt_embeds is None)
            or prompt_is_token_ids is not None)
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids) if prompt_token_ids is not None else None,
        prompt_embeds=prompt_embeds,
        sampling_params=make_params(**params),
        eos_token_id=eos_token_id,
        arrival_time=float(next(_arrival)) if arrival_time is None else arrival_time,
        encoder_input=encoder_input,
        prompt_is_token_ids=prompt_is_token_ids,
        mrope_positions=mrope_positions,
    )


def make_scheduler_request(
    request_id: str,
    prompt_token_ids: list[int] | None = None,
    *,
    block_size: int | None = 4,
    max_model_len: int = 64,
    **kwargs,
) -> Request:
    """A scheduler `Request`, block-hashed with `block_size` (None: no hashing)."""
    hasher = make_block_hasher(block_size) if block_size is not None else None
    return Request.from_engine_core_request(
        make_request(request_id, prompt_token_ids, **kwargs), max_model_len, hasher)


def make_scheduler(
    *,
    block_size: int = 4,
    num_blocks: int = 64,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 64,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    prompt_embeds_batching: str = "mixed",
    max_num_encoder_input_tokens: int = 2048,
    structured_output_manager: StructuredOutputManager | None = None,
    media: MediaRows | None = None,
    kv_cache_groups: list[KVCacheGroupSpec] | None = None,
) -> Scheduler:
    """A `Scheduler` on a `num_blocks`-block pool (block 0 is the null block); `media`:
    the media stage of a model that takes images or audio; `kv_cache_groups`: a
    sliding-window model's groups (one group of every layer by default)."""
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        prompt_embeds_batching=prompt_embeds_batching,
        max_num_encoder_input_tokens=max_num_encoder_input_tokens,
    )
    cache_config = CacheConfig(block_size=block_size, num_blocks=num_blocks,
                               enable_prefix_caching=enable_prefix_caching)
    return Scheduler(scheduler_config, cache_config, kv_cache_groups,
                     structured_output_manager=structured_output_manager, media=media)


def make_runner_output(
    scheduler_output: SchedulerOutput,
    sampled: dict[str, list[int]] | None = None,
    logprobs: dict[str, tuple[list[int], list[float], int]] | None = None,
) -> ModelRunnerOutput:
    """A hand-made `ModelRunnerOutput` for `scheduler_output`.

    Rows follow the scheduling order (`num_scheduled_tokens`). A request named in `sampled`
    gets those tokens; every other scheduled request gets `[]` (a prefill chunk that did
    not reach the end of its prompt). `logprobs` maps a request to (token ids, logprobs,
    rank of the sampled token); rows without an entry get empty lists.
    """
    sampled = sampled or {}
    unknown = [r for r in sampled if r not in scheduler_output.num_scheduled_tokens]
    assert not unknown, f"requests {unknown} were not scheduled in this step"
    req_ids = list(scheduler_output.num_scheduled_tokens)
    lp = None
    if logprobs is not None:
        rows = [logprobs.get(r, ([], [], 0)) for r in req_ids]
        lp = LogprobsLists([list(r[0]) for r in rows], [list(r[1]) for r in rows],
                           [r[2] for r in rows])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[list(sampled.get(r, [])) for r in req_ids],
        logprobs=lp,
    )


def cached(scheduler_output: SchedulerOutput) -> list[tuple[str, list[int], int]]:
    """The `CachedRequestData` deltas as (req_id, new block ids, num_computed_tokens)."""
    c = scheduler_output.scheduled_cached_reqs
    return list(zip(c.req_ids, c.new_block_ids, c.num_computed_tokens, strict=True))


class StubModel(torch.nn.Module):
    """Stands in for the model where only `get_input_embeddings` is used: token id t
    embeds to a row of HIDDEN copies of float(t)."""

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids.to(torch.float32)[:, None].expand(-1, HIDDEN).clone()


class CommonMetadataBackend:
    """Stands in for the attention backend: its metadata is the runner's
    `CommonAttentionMetadata` itself, so tests read exactly what the runner built."""

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata, block_size: int,
                       device: torch.device) -> CommonAttentionMetadata:
        return common

    @staticmethod
    def build_decode_metadata(common: CommonAttentionMetadata, block_size: int,
                              device: torch.device) -> None:
        return None  # every step's metadata from `build_metadata`: the common itself


def make_model_runner(block_size: int, max_model_len: int, max_num_seqs: int = 4,
                      vocab_size: int = 100, windows: list[int | None] | None = None
                      ) -> ModelRunner:
    """A CPU `ModelRunner` with a `StubModel`, a `CommonMetadataBackend` and no KV
    cache: enough for `_update_states`, `_prepare_inputs`, `_sampling_metadata` and
    `_bookkeep`. `windows`: each layer's sliding window (None: full attention), for the
    KV cache groups of a sliding-window model (one layer of full attention by default)."""
    windows = windows or [None]
    window = next((w for w in windows if w is not None), None)
    layers = {} if window is None else dict(
        sliding_window=window,
        layer_types=["full_attention" if w is None else "sliding_attention" for w in windows])
    hf_config = SimpleNamespace(vocab_size=vocab_size, hidden_size=HIDDEN,
                                num_hidden_layers=len(windows), num_attention_heads=2,
                                num_key_value_heads=2, **layers)
    model_config = ModelConfig(model="unused", tokenizer="unused", hf_config=hf_config,
                               dtype=torch.float32, max_model_len=max_model_len)
    config = VllmConfig(model_config=model_config,
                        cache_config=CacheConfig(block_size=block_size),
                        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                         max_model_len=max_model_len))
    runner = ModelRunner(config, torch.device("cpu"))
    runner.model = StubModel()
    runner.attn_backend = CommonMetadataBackend
    return runner
