"""`EagerCudaGraphs`: the CUDA graph path on any device, for CPU tests of everything but
the kernel launches."""

from __future__ import annotations

import torch

from vllm.forward_context import get_forward_context
from vllm.v1.worker.graph_capture import CudaGraphs


class EagerCudaGraphs(CudaGraphs):
    """`CudaGraphs` with its two CUDA seams (`_capture_graph`, `_replay`) run eagerly:
    capture keeps each graph's attention metadata from the backend's `capture_metadata`
    hook, as a captured graph holds its addresses, and each replay runs the forward on the
    persistent buffers under that same object, which `prepare_replay` refilled in place.
    Buffers, hooks, padding and graph selection are the real class's."""

    def capture(self, kv_caches: list[torch.Tensor], set_context) -> None:
        self.kv_caches, self.set_context = kv_caches, set_context
        self.graph_metadata: dict[tuple[str, int], object] = {}
        super().capture(kv_caches, set_context)

    def _capture_graph(self, kind: str, size: int):
        self.graph_metadata[(kind, size)] = get_forward_context().attn_metadata
        return None, self._forward(kind, size)  # the warm-up forward a capture runs

    def _replay(self, kind: str, size: int) -> torch.Tensor:
        with self.set_context(self.graph_metadata[(kind, size)], self.kv_caches):
            return self._forward(kind, size)
