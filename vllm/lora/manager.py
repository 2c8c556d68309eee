"""`LoRAModelManager`: a model's LoRA layers, the CPU cache of loaded adapters and the
assignment of adapters to the layers' fixed slots (one per model runner, on every rank)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import cast

import numpy as np
import torch
from torch import nn

from vllm.config import LoRAConfig
from vllm.lora.layers import LoRALinear, LoRAState
from vllm.lora.peft import SUPPORTED_MODULES, PeftAdapter, load_adapter
from vllm.lora.request import LoRARequest
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.models.interfaces import VllmModel

logger = logging.getLogger(__name__)


class LoRAModelManager:
    """Wraps every supported projection of `model` in a `LoRALinear`, keeps up to
    `max_cpu_loras` loaded adapters on the CPU (least recently used evicted) and puts the
    adapters of each step into the `max_loras` slots (an adapter keeps its slot while it
    is used; a new one takes a free slot, else the least recently used slot no row of the
    step needs).

    The scheduler never schedules more distinct adapters in a step than there are slots;
    `set_step` raises if it does.
    """

    def __init__(self, model: VllmModel, lora_config: LoRAConfig, hf_config,
                 max_num_tokens: int, device: torch.device, dtype: torch.dtype) -> None:
        self.config = lora_config
        self.hf_config = hf_config
        self.state = LoRAState(max_num_tokens, lora_config.max_loras,
                               lora_config.max_lora_rank, device)
        # Hugging Face module name -> (LoRA layer, part index in it)
        self.targets: dict[str, tuple[LoRALinear, int]] = {}
        self.layers: list[LoRALinear] = []
        mapping = model.packed_modules_mapping
        module_tree = cast(nn.Module, model)  # every model is an nn.Module
        for path, module in list(module_tree.named_modules()):
            if not isinstance(module, LinearBase) or "." not in path:
                continue
            parent_path, leaf = path.rsplit(".", 1)
            parts = list(mapping.get(leaf, [(leaf, None)]))
            if not all(name in SUPPORTED_MODULES for name, _ in parts):
                continue
            layer = LoRALinear(module, [shard for _, shard in parts], lora_config.max_loras,
                               lora_config.max_lora_rank, self.state, dtype)
            setattr(module_tree.get_submodule(parent_path), leaf, layer)
            self.layers.append(layer)
            for index, (name, _) in enumerate(parts):
                self.targets[f"model.{parent_path}.{name}"] = (layer, index)
        self.cpu_cache: OrderedDict[int, PeftAdapter] = OrderedDict()
        self.slots: list[int | None] = [None] * lora_config.max_loras  # adapter id per slot
        self._slot_used: list[int] = [0] * lora_config.max_loras  # step of last use
        self._step = 0
        logger.info("LoRA: %d layers with %d slots of rank <= %d.", len(self.layers),
                    lora_config.max_loras, lora_config.max_lora_rank)

    # ---- the CPU cache ---------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads an adapter into the CPU cache (a no-op if it is there: it becomes the most
        recently used); returns whether it was loaded now. A bad adapter is a ValueError."""
        lora_id = lora_request.lora_int_id
        if lora_id in self.cpu_cache:
            self.cpu_cache.move_to_end(lora_id)
            return False
        adapter = load_adapter(lora_request.lora_path, self.hf_config,
                               self.config.max_lora_rank)
        missing = [m for m in adapter.modules if m not in self.targets]
        if missing:
            raise ValueError(f"LoRA adapter {lora_request.lora_path!r} targets "
                             f"{missing[0]!r}, which this model has no LoRA layer for.")
        while len(self.cpu_cache) >= self.config.max_cpu_loras:
            evicted = next((i for i in self.cpu_cache if i not in self.slots), None)
            if evicted is None:
                break  # every cached adapter sits in a slot (max_cpu_loras == max_loras)
            del self.cpu_cache[evicted]
        self.cpu_cache[lora_id] = adapter
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forgets an adapter (its slot too); returns whether it was known."""
        known = self.cpu_cache.pop(lora_int_id, None) is not None
        if lora_int_id in self.slots:
            self.slots[self.slots.index(lora_int_id)] = None
            known = True
        return known

    def list_loras(self) -> list[int]:
        return list(self.cpu_cache)

    # ---- slots ------------------------------------------------------------------------

    def set_step(self, row_loras: list[LoRARequest | None], num_scheduled: np.ndarray
                 ) -> None:
        """Puts the step's adapters in slots and writes every token's slot (rows in batch
        order, `num_scheduled` tokens each) into `state.indices`.

        Example: rows [A, None, B], num_scheduled [2, 1, 3], A in slot 1, B in slot 0 ->
        indices [1, 1, -1, 0, 0, 0, -1, -1, ...].
        """
        self._step += 1
        ids = list(dict.fromkeys(r.lora_int_id for r in row_loras if r is not None))
        if len(ids) > len(self.slots):
            raise RuntimeError(f"A step with {len(ids)} adapters, over max_loras="
                               f"{len(self.slots)} (the scheduler's limit).")
        slot_of: dict[int, int] = {}
        for request in row_loras:
            if request is not None and request.lora_int_id not in slot_of:
                slot_of[request.lora_int_id] = self._slot_for(request, ids)
        row_slots = np.array([-1 if r is None else slot_of[r.lora_int_id] for r in row_loras],
                             dtype=np.int64)
        token_slots = np.repeat(row_slots, num_scheduled)
        indices = self.state.indices
        indices.fill_(-1)
        indices[:len(token_slots)].copy_(torch.from_numpy(token_slots))
        self.state.active = bool(slot_of)

    def _slot_for(self, request: LoRARequest, step_ids: list[int]) -> int:
        lora_id = request.lora_int_id
        if lora_id in self.slots:
            slot = self.slots.index(lora_id)
        else:
            free = [s for s, i in enumerate(self.slots) if i is None]
            if free:
                slot = free[0]
            else:  # the least recently used slot this step does not need
                slot = min((s for s, i in enumerate(self.slots) if i not in step_ids),
                           key=lambda s: self._slot_used[s])
            self._load_slot(slot, request)
        self._slot_used[slot] = self._step
        return slot

    def _load_slot(self, slot: int, request: LoRARequest) -> None:
        self.add_lora(request)
        adapter = self.cpu_cache[request.lora_int_id]
        assert adapter.weights is not None
        per_layer: dict[int, list] = {id(layer): [None] * len(layer.parts)
                                      for layer in self.layers}
        for module, pair in adapter.weights.items():
            layer, index = self.targets[module]
            per_layer[id(layer)][index] = pair
        for layer in self.layers:
            layer.set_slot(slot, per_layer[id(layer)])
        self.slots[slot] = request.lora_int_id
