"""The mixture-of-experts feed-forward block the MoE families share: a router, the experts
(`FusedMoE`) and, where the family has one, a shared expert behind a sigmoid gate.

    out = sum over the token's top-k experts of weight * expert(x)
          (+ sigmoid(shared_expert_gate(x)) * shared_expert(x))
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.layers.fused_moe import FusedMoE, NativeExpertKernel
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.models.interfaces import FusedExperts
from vllm.model_executor.models.llama import ACTIVATIONS, LlamaMLP


class SparseMoeBlock(nn.Module):
    """Checkpoint names: `gate` (the router, [E, H]), `experts.{e}.*` (stacked into
    `experts`), `shared_expert.*` and `shared_expert_gate` ([1, H])."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int,
                 intermediate_size: int, renormalize: bool,
                 shared_intermediate_size: int | None = None) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        # The router stays in the model dtype under int8: a rounded logit could change
        # which experts a token goes to.
        self.gate.quantizable = False
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size,
                                renormalize)
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if shared_intermediate_size:
            self.shared_expert = LlamaMLP(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, bias=False)
            self.shared_expert_gate.quantizable = False

    def fused_decode_experts(self) -> FusedExperts | str:
        """This block as the fused CPU decoder computes it, or why it cannot: a router (or
        shared expert gate) that is not a dense bias-free weight, experts that are not GGUF
        (or int8 Q8_0) blocks of one rank, a shared expert that is not bias-free SiLU on
        GGUF weights."""
        shared = None
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            mlp, shared_gate = self.shared_expert, self.shared_expert_gate
            gate_up = mlp.gate_up_proj.fused_decode_weights()
            down = mlp.down_proj.fused_decode_weights()
            if (shared_gate.weight is None or shared_gate.bias is not None
                    or mlp.act is not ACTIVATIONS["silu"] or gate_up is None or down is None
                    or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None):
                return "the shared expert is not a bias-free SiLU MLP on GGUF weights"
            shared = (gate_up, down, shared_gate.weight.data)
        gate, experts = self.gate, self.experts
        if gate.weight is None or gate.bias is not None:
            return "the router is not a dense bias-free weight"
        kernel = experts.kernel
        if (experts.tp_size != 1 or not isinstance(kernel, NativeExpertKernel)
                or not kernel.reads_blocks):
            return "the experts are not GGUF blocks on one rank"
        w1, w3, w2 = kernel.weights
        return FusedExperts(router=gate.weight.data, w1=w1, w3=w3, w2=w2, types=kernel.types,
                            top_k=experts.top_k, renormalize=experts.renormalize,
                            shared=shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Qwen-MoE's rule: every `decoder_sparse_step`-th layer is sparse, except those in
    `mlp_only_layers` (dense, `intermediate_size` wide). Example: step 2, mlp_only [3]:
    layers 1 sparse, 0, 2 and 3 dense."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % step == 0)
