"""`LoRASlots`: which waiting requests a step may admit without needing one LoRA slot more."""

from __future__ import annotations

from vllm.v1.request import Request


class LoRASlots:
    """The LoRA adapters of the running requests, against the slots a step has
    (`max_loras`; None: LoRA is off). A waiting request whose adapter is new is admitted
    only while a slot is free; once one waits for a slot, every later request with an
    adapter waits too (the running adapters drain and the first in line gets the slot:
    no request starves behind a stream of others using the running adapters).

    Built afresh by each step's admission pass; it decides, the scheduler admits.

    Example: max_loras 2, running adapters [1, 2], waiting [A3, A1, base] -> A3 waits (no
    slot), A1 waits behind it, the base-model request is admitted.
    """

    def __init__(self, max_loras: int | None, running: list[Request]) -> None:
        self.max_loras = max_loras
        self.active: list[int] = []  # adapter ids holding slots, in first-use order
        self.blocked = False
        for request in running:
            self.add(request)

    def admits(self, request: Request) -> bool:
        lora = request.lora_request
        if lora is None or self.max_loras is None:
            return True
        if not self.blocked and (lora.lora_int_id in self.active
                                 or len(self.active) < self.max_loras):
            return True
        self.blocked = True
        return False

    def add(self, request: Request) -> None:
        lora = request.lora_request
        if lora is not None and lora.lora_int_id not in self.active:
            self.active.append(lora.lora_int_id)
