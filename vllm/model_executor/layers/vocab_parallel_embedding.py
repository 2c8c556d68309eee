"""The vocabulary embedding and the LM head, split by vocabulary across ranks.

The vocabulary is padded to a multiple of the rank count (padding rows are zeros); rank r
keeps token ids [r * V/tp, (r+1) * V/tp). The embedding looks up the ids it holds, zeros
the others and all-reduces (each id is found on exactly one rank); the LM head multiplies
by its rows and all-gathers the logits, cut back to the real vocabulary, so every rank
samples from the same full logits.

Example: vocabulary 10, 4 ranks -> padded 12, 3 ids a rank; rank 1 holds ids 3, 4, 5.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from vllm.model_executor.layers.linear import LinearBase, set_weight_loader
from vllm.utils import cdiv

if TYPE_CHECKING:
    from vllm.model_executor.models.interfaces import FusedLookups


class VocabShard:
    """Which rows of a vocabulary of `num_embeddings` this rank keeps."""

    def __init__(self, num_embeddings: int) -> None:
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings = num_embeddings
        self.per_rank = cdiv(num_embeddings, self.tp_size)
        self.start = self.tp_rank * self.per_rank
        # Rows of this rank in the real vocabulary (the last rank's may not all be).
        self.num_real = max(0, min(self.per_rank, num_embeddings - self.start))

    def rows(self, loaded, shard_id: int | str | None = None):
        """This rank's rows of a full [vocab, ...] tensor (or block codes)."""
        if shard_id is not None:
            raise ValueError(f"a fused part ({shard_id!r}) for a vocabulary table")
        if loaded.shape[0] != self.num_embeddings:
            raise ValueError(f"vocabulary of {loaded.shape[0]} rows, expected "
                             f"{self.num_embeddings}")
        return loaded.narrow(0, self.start, self.num_real)

    def load(self, param: torch.Tensor, loaded: torch.Tensor,
             shard_id: int | str | None = None) -> None:
        """Copies this rank's rows in; padding rows are zeros."""
        piece = self.rows(loaded, shard_id)
        if tuple(piece.shape[1:]) != tuple(param.shape[1:]):
            raise ValueError(f"shape {tuple(loaded.shape)}, expected "
                             f"{(self.num_embeddings, *param.shape[1:])}")
        with torch.no_grad():
            param[:self.num_real].copy_(piece)
            param[self.num_real:].zero_()


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.vocab = VocabShard(num_embeddings)
        self.tp_size = self.vocab.tp_size
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight: nn.Parameter | None = set_weight_loader(
            nn.Parameter(torch.zeros(self.vocab.per_rank, embedding_dim), requires_grad=False),
            self.vocab.load)
        # A tied GGUF LM head's blocks (`read_blocks`): rows dequantized as they are looked
        # up, the dense table dropped.
        self.blocks: torch.Tensor | None = None
        self.block_type = 0
        self.dtype = self.weight.dtype
        self._codes: list = []  # GGUF blocks of the table (`add_block_codes`)

    def add_block_codes(self, codes, shard_id) -> None:
        """The table's GGUF blocks, this rank's rows (padding rows zeros)."""
        piece = self.vocab.rows(codes, shard_id)
        if self.vocab.num_real < self.vocab.per_rank:
            piece = piece.pad_rows(self.vocab.per_rank)
        self._codes.append(piece)

    def process_weights_after_loading(self, quantization: str | None) -> str:
        """Looks rows up in the file's blocks with `quantization="gguf"` where `gguf_mm`
        reads them (a tied LM head then shares them, `read_blocks`); returns how ("gguf
        TYPE" or "dense")."""
        from vllm.model_executor.layers.quantization.gguf_blocks import (
            GGUFBlocks,
            gguf_mm_available,
        )

        codes, self._codes = self._codes, []
        if self.blocks is not None:  # a tied head processed first shares its blocks
            return "gguf, the LM head's blocks"
        if (quantization != "gguf" or len(codes) != 1 or not isinstance(codes[0], GGUFBlocks)
                or not gguf_mm_available()):
            return "dense"
        self.read_blocks(torch.from_numpy(codes[0].data.copy()), codes[0].type_id)
        return f"gguf {codes[0].type_name}"

    def read_blocks(self, blocks: torch.Tensor, block_type: int) -> None:
        """Looks rows up in GGUF `blocks` (uint8 [rows of this rank, bytes a row], ggml type
        `block_type`, shared with the tied LM head's kernel) instead of the dense table."""
        self.blocks, self.block_type = blocks, block_type
        self.weight = None

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.blocks is None:
            assert self.weight is not None
            return F.embedding(ids, self.weight)
        flat = torch.ops.vllm_cpu.gguf_dequantize(self.blocks[ids.reshape(-1)], self.block_type)
        return flat.to(self.dtype).view(*ids.shape, self.embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._rows(input_ids)
        local = input_ids - self.vocab.start
        outside = (local < 0) | (local >= self.vocab.per_rank)
        rows = self._rows(local.masked_fill(outside, 0))
        return tensor_model_parallel_all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0))

    def extra_repr(self) -> str:
        v = self.vocab
        return (f"{self.num_embeddings}, {self.embedding_dim}, ids {v.start}.."
                f"{v.start + v.per_rank} on rank {v.tp_rank}/{v.tp_size}")


class ParallelLMHead(LinearBase):
    """The projection to the vocabulary, split by vocabulary rows like the embedding (and
    sharing its weight when tied). `compute_logits` returns the full logits on every rank;
    int8 never applies (see the README's drift table); GGUF codes and packing (in float32
    too) do."""

    quantizable = False
    # The file's layout: a tied embedding looks its rows up in the same blocks.
    repack_gguf_rows = False

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 tied_to: VocabParallelEmbedding | None = None) -> None:
        self.vocab = VocabShard(num_embeddings)
        super().__init__(embedding_dim, self.vocab.per_rank, bias)
        self.num_embeddings = num_embeddings
        # In a list: an attribute would register the embedding as this module's child.
        self._tied_to = [tied_to] if tied_to is not None else []
        if tied_to is not None:
            self.weight = tied_to.weight  # one parameter, two uses

    def _gguf_kernel(self, parts, view, pack, repack_for_fused_decode):
        # The fused decoder reads the decoder layers only: the head keeps the file's blocks.
        kernel = super()._gguf_kernel(parts, view, pack, repack_for_fused_decode=False)
        from vllm.model_executor.layers.quantization.gguf_blocks import GGUFBlockLinear

        if (self._tied_to and isinstance(self.kernel, GGUFBlockLinear)
                and len(self.kernel.types) == 1):
            # The embedding reads the same blocks: neither keeps the dense table.
            self._tied_to[0].read_blocks(self.kernel.weights[0], self.kernel.types[0])
        return kernel

    def process_weights_after_loading(self, quantization: str | None, pack: bool,
                                      repack_for_fused_decode: bool = False) -> str:
        """As every linear, and packed in oneDNN's layout in float32 too (`can_pack_float32`:
        MKL repacks this, the largest weight of a step, on every call). An untied head's
        packed copy replaces its weight; a tied one's table stays for the embedding."""
        from vllm.model_executor.layers.packed_linear import PackedLinear, can_pack_float32

        assert self.weight is not None
        if self.weight.dtype == torch.float32 and can_pack_float32(self.weight.device):
            pack = True
        name = super().process_weights_after_loading(quantization, pack,
                                                     repack_for_fused_decode)
        if isinstance(self.kernel, PackedLinear) and not self._tied_to:
            self.weight = None
        return name

    def shard(self, loaded, shard_id, is_bias):
        return 0, self.vocab.rows(loaded, shard_id)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        if param.dim() == 1:  # a bias [vocab]
            self.vocab.load(param.unsqueeze(1), loaded.unsqueeze(1), shard_id)
        else:
            self.vocab.load(param, loaded, shard_id)

    def add_block_codes(self, codes, shard_id) -> None:
        piece = self.vocab.rows(codes, shard_id)
        if self.vocab.num_real < self.vocab.per_rank:
            piece = piece.pad_rows(self.vocab.per_rank)
        self._codes.append((0, piece))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocabulary]: this rank's columns, gathered from every rank."""
        logits = self.linear(hidden_states, self.bias)
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[..., :self.num_embeddings]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(x)


def fused_lookups(embedding: VocabParallelEmbedding | None, lm_head: ParallelLMHead | None,
                  scale: float | None = None) -> FusedLookups:
    """What the fused decoder may run of a model's ends: `embedding` where the model's
    embedding is its rows (times `scale`), if they are this rank's whole GGUF blocks;
    `lm_head` where the model's `compute_logits` is its `compute_logits` and nothing more,
    if it is a one-rank quantized weight. None: the model computes that end otherwise."""
    from vllm.model_executor.models.interfaces import FusedLookups

    table = None
    if embedding is not None and embedding.blocks is not None and embedding.tp_size == 1:
        table = (embedding.blocks, embedding.block_type)
    if lm_head is None:
        return FusedLookups(table=table, scale=scale)
    return FusedLookups(table=table, scale=scale, head=lm_head.fused_decode_weights(),
                        head_bias=lm_head.bias, vocab_size=lm_head.num_embeddings)
