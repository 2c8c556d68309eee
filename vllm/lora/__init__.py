"""LoRA adapters: `LoRARequest` (which adapter a request uses), PEFT adapter checking and
loading (`peft`), the per-layer slots and their batched low-rank product (`layers`), and
the worker's slot / CPU-cache manager (`manager`)."""

from vllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
