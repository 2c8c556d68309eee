"""Captured forward graphs: one set fed `input_ids`, and a second fed `inputs_embeds` only
when prompt embeds are enabled (the prompt-embeds RFC's dual graphs).

A step of `n` tokens is padded up to the smallest captured size `>= n` and replays the set
that matches its inputs: a step whose tokens are all real ids replays the ids set (the
embedding lookup is inside the graph) even when prompt embeds are enabled, so token-only
traffic never pays for embeds; a step with any embeds rows replays the embeds set. Steps
larger than the largest size run eagerly on CUDA; on CPU they run one more graph of each
set, compiled once for any token count past `ANY_MIN_TOKENS` and the largest size (size
`ANY`), unpadded; it is not compiled when the token budget allows no such step.

    sizes [1, 2, 4, 8]:  n=3 -> replay size 4 (one padded token), n=8 -> size 8,
                         n=9 -> size ANY on CPU (9 rows), eager on CUDA
    sizes [1]:           n=2..8 -> eager, n=9 -> size ANY on CPU

The inputs live in persistent buffers sized for the largest capture; the runner fills the
first `n` rows each step and the rest stay as padding (id 0, position 0, zero embeds).

CPU (`CompiledGraphs`): each (set, size) is a static-shape `torch.compile` (inductor) graph
of the model's forward, compiled piecewise; paged attention is the registered op
`vllm::attention`, one node of the graph rather than a break, which computes the real
tokens only (padded tokens write no KV and get zero rows), and inductor fuses the
elementwise work around it (residual add + RMSNorm, rotary, SiLU x up). Any batch layout
fits, prefill chunks included. The ANY graphs (same pieces, the token count symbolic) take
the steps past the largest static size, so large prefills and wide decode steps get the
same fusion; the static sizes save small steps the symbolic shapes' overhead and keep
their shape checks cheap.

CPU graphs need no attention buffers: the attention op reads the step's metadata from the
forward context when it runs, so each step's `build_metadata` output (any layout, its own
tensors) serves, and capture's dummy steps are ordinary steps (`padding_decodes`).

CUDA (`CudaGraphs`): CUDA graphs of the same forward for decode-only steps. A CUDA graph
bakes in the addresses of everything it reads, attention metadata included, so that
metadata lives in persistent buffers the backend owns, behind three hooks (see
`AttentionBackend`): `init_graph_buffers` once, `capture_metadata` per captured size,
`prepare_replay` per replayed step. This module never builds a backend's metadata.
"""

from __future__ import annotations

import bisect
import collections
import functools
import logging
import time
import types
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from vllm.config import InputKind
from vllm.model_executor.models.interfaces import GraphModel
from vllm.v1.attention.backends.abstract import AttentionBackend, CommonAttentionMetadata

if TYPE_CHECKING:
    from vllm.lora.layers import LoRAState

logger = logging.getLogger(__name__)

# The size of the CPU graphs compiled for any step larger than the largest static size.
ANY = 0
# ANY graphs take only steps of more than this many tokens, more than the largest static
# size, and more than the model's row switch (`GraphModel.row_switch_tokens`): up to that,
# layers may pick their kernel by row count, a branch that a graph with a symbolic size
# would have to guard on. Steps between the largest static size and that run eagerly.
ANY_MIN_TOKENS = 8


# Largest default static capture size on CPU: past it, steps run the graphs compiled for
# any size (`ANY`), whose fused elementwise work is as good; a static size only saves the
# padding and the shape checks of small steps.
CPU_MAX_DEFAULT_CAPTURE_SIZE = 16

# Inductor's fused elementwise kernels split their loop over the OpenMP team only past this
# many elements per thread (inductor's own default: 512). A one-token step's SiLU-and-mul
# (1,536 elements on the default model) is ~1 us of work on one core, less than forking and
# joining the team, where the other thread may be parked or preempted; 30 layers did it
# every step. Steps of many tokens still split every kernel.
CPU_MIN_PARALLEL_CHUNK = 4096


def default_capture_sizes(max_num_batched_tokens: int, max_num_seqs: int,
                          device: str) -> list[int]:
    """Decode-shaped sizes: 1, 2, 4, 8, then multiples of 8 (CUDA) or powers of two (CPU, up
    to `CPU_MAX_DEFAULT_CAPTURE_SIZE`) up to the number of sequences a step may hold,
    capped by the token budget.

    Example: max_num_seqs 64, budget 2048 -> CPU [1, 2, 4, 8, 16];
    CUDA [1, 2, 4, 8, 16, 24, ..., 64]. max_num_seqs 12 -> CPU [1, 2, 4, 8, 12].
    """
    limit = min(max_num_seqs, max_num_batched_tokens)
    if device == "cpu":
        limit = min(limit, CPU_MAX_DEFAULT_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s <= limit]
    size = 8
    while size <= limit:
        sizes.append(size)
        size = size * 2 if device == "cpu" else size + 8
    if sizes[-1] != limit and device == "cpu":
        sizes.append(limit)
    return sizes


def padded_size(sizes: list[int], num_tokens: int) -> int | None:
    """The smallest captured size >= num_tokens, None past the largest.

    Example: sizes [1, 2, 4, 8]: 3 -> 4, 8 -> 8, 9 -> None.
    """
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None


class CompiledGraphs:
    """The CPU graph sets, `(kind, size) -> captured`, and their persistent inputs.

    The forward is compiled piecewise along the model's own seams (`prepare` -> each layer
    -> `finish`): layers of one shape share one compiled graph per size (the attention
    op's layer id is a tensor input, not a constant), so a size compiles one layer rather
    than all of them, and the two sets differ only in their `prepare` piece (with or
    without the embedding lookup).
    """

    def __init__(self, model: GraphModel, sizes: list[int], with_embeds: bool,
                 hidden_size: int, dtype: torch.dtype, device: torch.device,
                 max_num_tokens: int, lora_state: LoRAState | None = None,
                 mrope: bool = False) -> None:
        self.model = model
        # With LoRA, every (set, size) is compiled twice: with the adapters' product (its
        # row indices a graph input: any mix of adapters) and without, for steps that have
        # no adapter rows (`LoRAState.active`).
        self.lora_state = lora_state
        self.lora_variants = (False, True) if lora_state is not None else (False,)
        self.sizes = sorted(set(sizes))
        self.kinds = _graph_kinds(with_embeds)
        self.max_size = self.sizes[-1]
        # ANY takes steps of more tokens
        self.any_min = max(self.max_size, ANY_MIN_TOKENS, model.row_switch_tokens())
        # A step holds at most `max_num_tokens` (the token budget): with a budget of 8 and
        # sizes [4], steps of 5-8 tokens run eagerly and no step would ever replay ANY.
        self.any_sizes = [ANY] if max_num_tokens > self.any_min else []
        # [max_size], or [3, max_size] for M-RoPE (three rotary positions per token).
        self.positions = torch.zeros(*((3,) if mrope else ()), self.max_size,
                                     dtype=torch.int64, device=device)
        # Each set's input buffer: ids, or embeds rows.
        self.inputs = {InputKind.TOKEN_IDS: torch.zeros(self.max_size, dtype=torch.int64,
                                                        device=device)}
        if with_embeds:
            self.inputs[InputKind.EMBEDS] = torch.zeros(self.max_size, hidden_size,
                                                        dtype=dtype, device=device)
        self.captured: set[tuple[InputKind, int]] = set()
        self.replays: collections.Counter[tuple[InputKind, int]] = collections.Counter()
        # Each (set, size) compiles its own copies of the pieces: dynamo keeps compiled
        # entries per code object, so every copy holds exactly one, which a replay calls
        # without evaluating guards (with the sizes sharing one function, each call had to
        # tell its size apart from the others': one request's step ran ~10% slower with
        # five sizes captured than with one). The ANY copies take a symbolic token count
        # (parameters and buffers keep their static shapes).
        self._pieces: dict[tuple[InputKind, int, bool], tuple[Callable, Callable, Callable]] = {}
        for kind in self.kinds:
            prepare = _prepare_ids if kind is InputKind.TOKEN_IDS else _prepare_embeds
            for size in self.sizes + self.any_sizes:
                compile_ = functools.partial(
                    torch.compile, dynamic=size == ANY, fullgraph=True,
                    options={"cpp.min_chunk_size": CPU_MIN_PARALLEL_CHUNK})
                for lora in self.lora_variants:
                    tag = f"{kind.value}_{size or 'any'}{'_lora' if lora else ''}"
                    self._pieces[(kind, size, lora)] = (compile_(_own_code(prepare, tag)),
                                                        compile_(_own_code(_layer, tag)),
                                                        compile_(_own_code(_finish, tag)))

    def padded_size(self, num_tokens: int) -> int | None:
        return padded_size(self.sizes, num_tokens)

    def capture(self, run_dummy_step: Callable[[int, Callable[[], torch.Tensor]], None]) -> None:
        """Compiles every (kind, size), each through one real forward: `run_dummy_step(size,
        fn)` must call `fn()` inside a forward context of `size` real decode tokens."""
        start = time.perf_counter()
        for lora in self.lora_variants:
            if self.lora_state is not None:
                self.lora_state.active = lora  # the dummy steps' rows have no adapter
            self._capture_variant(run_dummy_step)
        if self.lora_state is not None:
            self.lora_state.active = False
        logger.info("Captured %d graph sets (%s%s) for sizes %s%s in %.1f s.",
                    len(self.captured), " and ".join(k.value for k in self.kinds),
                    ", with and without LoRA" if self.lora_state is not None else "",
                    self.sizes, " and any larger size" if self.any_sizes else "",
                    time.perf_counter() - start)

    def _capture_variant(self, run_dummy_step: Callable) -> None:
        for kind in self.kinds:
            for size in reversed(self.sizes):
                run_dummy_step(size, functools.partial(self._forward, kind, size))
                self.captured.add((kind, size))
            if not self.any_sizes:
                continue
            # Any larger size: compiled through a step of any_min + 1 tokens (the inputs
            # are fresh tensors, not the padded buffers).
            n = self.any_min + 1
            buffer = self.inputs[kind]
            inputs = buffer.new_zeros(n, *buffer.shape[1:])
            positions = self.positions.new_zeros(*self.positions.shape[:-1], n)
            run_dummy_step(n, functools.partial(self._run_pieces, kind, ANY, inputs,
                                                positions))
            self.captured.add((kind, ANY))

    def _forward(self, kind: InputKind, size: int) -> torch.Tensor:
        return self._run_pieces(kind, size, self.inputs[kind][:size],
                                self.positions[..., :size])

    def _run_pieces(self, kind: InputKind, size: int, inputs: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor:
        lora = self.lora_state is not None and self.lora_state.active
        prepare, layer_fn, finish = self._pieces[(kind, size, lora)]
        h, cos, sin = prepare(self.model, inputs, positions)
        for layer in self.model.layers:
            h = layer_fn(layer, cos, sin, h)
        return finish(self.model, h)

    def run(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
            inputs_embeds: torch.Tensor | None,
            common: CommonAttentionMetadata | None = None) -> torch.Tensor | None:
        """The step's hidden states through a graph: the padded static size, or ANY past
        the largest; None when no graph fits (embeds without an embeds set). Any batch
        layout fits: attention is outside the compiled pieces."""
        n = positions.shape[-1]
        kind, inputs = _step_inputs(input_ids, inputs_embeds)
        size = self.padded_size(n)
        buffer = self.inputs.get(kind)
        if buffer is None:
            return None
        if size is None:
            if (kind, ANY) not in self.captured or n <= self.any_min:
                return None
            self.replays[(kind, ANY)] += 1
            # Unpadded, on the step's own tensors: their dtypes and layout must be the
            # capture's, since the guards that would check them are skipped (no-ops for
            # the runner's int64 ids/positions and contiguous model-dtype embeds).
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return self._run_pieces(kind, ANY, inputs.to(buffer.dtype).contiguous(),
                                        positions.to(torch.int64))
        if (kind, size) not in self.captured:
            return None
        self.positions[..., :n].copy_(positions)
        self.positions[..., n:size].zero_()
        buffer[:n].copy_(inputs)
        buffer[n:size].zero_()
        self.replays[(kind, size)] += 1
        # Every graph was compiled at capture for these very modules and buffers, alone in
        # its function's cache: no guard needs checking (~90 us a call otherwise, 32 calls
        # a step).
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return self._forward(kind, size)[:n]


def _graph_kinds(with_embeds: bool) -> tuple[InputKind, ...]:
    """The graph sets kept: ids always, embeds only with prompt embeds enabled."""
    return (InputKind.TOKEN_IDS, InputKind.EMBEDS) if with_embeds else (InputKind.TOKEN_IDS,)


def _step_inputs(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None
                 ) -> tuple[InputKind, torch.Tensor]:
    """The set a step replays, and its inputs: embeds rows if it has any, else ids."""
    if inputs_embeds is not None:
        return InputKind.EMBEDS, inputs_embeds
    assert input_ids is not None, "a step needs ids or embeds"
    return InputKind.TOKEN_IDS, input_ids


def _prepare_ids(model: GraphModel, input_ids: torch.Tensor, positions: torch.Tensor):
    h, (cos, sin) = model.prepare(input_ids, positions, None)
    return h, cos, sin


def _prepare_embeds(model: GraphModel, inputs_embeds: torch.Tensor,
                    positions: torch.Tensor):
    h, (cos, sin) = model.prepare(None, positions, inputs_embeds)
    return h, cos, sin


def _layer(layer: torch.nn.Module, cos: torch.Tensor, sin: torch.Tensor,
           h: torch.Tensor) -> torch.Tensor:
    return layer((cos, sin), h)


def _finish(model: GraphModel, h: torch.Tensor) -> torch.Tensor:
    return model.finish(h)


def _own_code(fn: Callable, tag: str) -> Callable:
    """A copy of `fn` with a code object of its own (dynamo's compiled entries hang off
    the code object)."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name)


class CudaGraphs:
    """CUDA graph sets for decode-only steps (every request one token), the shape a CUDA
    graph can hold: the paged attention of such a step has fixed-shape metadata.

    Persistent buffers, sized for the largest capture: ids, embeds (only with prompt
    embeds enabled) and positions here; the attention metadata in the backend's graph
    buffers (`AttentionBackend.init_graph_buffers`), which this class holds without
    reading. A replay copies the step's values into the first rows; padded rows are
    one-token sequences at the null block's first slot (they write and read only that
    slot, so their values stay finite and no real row ever reads them).
    """

    def __init__(self, model: GraphModel, sizes: list[int], with_embeds: bool,
                 hidden_size: int, dtype: torch.dtype, device: torch.device,
                 block_size: int, max_model_len: int,
                 attn_backend: type[AttentionBackend],
                 lora_state: LoRAState | None = None) -> None:
        self.model = model
        # With LoRA the graphs always compute the adapters' product (rows without an
        # adapter add zeros): a CUDA graph cannot branch on the step.
        self.lora_state = lora_state
        self.sizes = sorted(set(sizes))
        self.kinds = _graph_kinds(with_embeds)
        self.max_size = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.attn_backend = attn_backend
        n = self.max_size
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.inputs = {InputKind.TOKEN_IDS: torch.zeros(n, dtype=torch.int64, device=device)}
        if with_embeds:
            self.inputs[InputKind.EMBEDS] = torch.zeros(n, hidden_size, dtype=dtype,
                                                        device=device)
        self.attn_buffers = attn_backend.init_graph_buffers(n, self.max_blocks, block_size,
                                                            device)
        self.captured: dict[tuple[InputKind, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays: collections.Counter[tuple[InputKind, int]] = collections.Counter()
        self.pool = None

    def padded_size(self, num_tokens: int) -> int | None:
        return padded_size(self.sizes, num_tokens)

    def _metadata(self, size: int) -> object:
        """The attention metadata graphs of `size` rows read: views of the buffers."""
        return self.attn_backend.capture_metadata(self.attn_buffers, size)

    def _forward(self, kind: InputKind, size: int) -> torch.Tensor:
        inputs = self.inputs[kind][:size]
        if kind is InputKind.TOKEN_IDS:
            return self.model(inputs, self.positions[:size], None)
        return self.model(None, self.positions[:size], inputs)

    def capture(self, kv_caches: list[torch.Tensor], set_context) -> None:
        """Captures every (kind, size), largest first so that smaller graphs reuse its
        memory pool, under the backend's capture metadata; `set_context(metadata,
        kv_caches)` is `set_forward_context`. Every buffer row is padding (as
        `init_graph_buffers` left the attention's)."""
        start = time.perf_counter()
        if self.lora_state is not None:
            self.lora_state.active = True
        for kind in self.kinds:
            for size in reversed(self.sizes):
                with set_context(self._metadata(size), kv_caches):
                    self.captured[(kind, size)] = self._capture_graph(kind, size)
        if self.lora_state is not None:
            self.lora_state.active = False
        logger.info("Captured %d CUDA graphs (%s) for sizes %s in %.1f s.", len(self.captured),
                    " and ".join(k.value for k in self.kinds), self.sizes,
                    time.perf_counter() - start)

    def _capture_graph(self, kind: InputKind, size: int
                       ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """One CUDA graph of the forward under the forward context now set, and its output
        tensor: capture's only CUDA work (tests substitute an eager forward)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(kind, size)  # warm-up: lazy initialisations
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(kind, size)
        if self.pool is None:
            self.pool = graph.pool()
        torch.cuda.synchronize()
        return graph, out

    def run(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
            inputs_embeds: torch.Tensor | None,
            common: CommonAttentionMetadata) -> torch.Tensor | None:
        """Replays a graph for a decode-only step that fits, else None (eager)."""
        n = positions.shape[0]
        num_reqs = common.seq_lens.shape[0]
        kind, inputs = _step_inputs(input_ids, inputs_embeds)
        size = self.padded_size(n)
        if size is None or num_reqs != n or (kind, size) not in self.captured:
            return None
        if common.block_table.shape[1] > self.max_blocks:
            return None
        self.positions[:n].copy_(positions)
        self.positions[n:size].zero_()
        self.inputs[kind][:n].copy_(inputs)
        self.inputs[kind][n:size].zero_()
        self.attn_backend.prepare_replay(self.attn_buffers, common, size)
        self.replays[(kind, size)] += 1
        return self._replay(kind, size)[:n]

    def _replay(self, kind: InputKind, size: int) -> torch.Tensor:
        """The captured graph's output for the step now in the buffers (all `size` rows):
        a replay's only CUDA work (tests substitute the eager forward on the same buffers
        and capture metadata)."""
        graph, out = self.captured[(kind, size)]
        graph.replay()
        return out
