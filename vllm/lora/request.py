"""`LoRARequest`: the adapter a request runs with (vLLM's public names and fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class LoRARequest:
    """One LoRA adapter in PEFT's format (`adapter_config.json` +
    `adapter_model.safetensors` in `lora_path`).

    `lora_int_id` (>= 1) is the adapter's identity in the engine: requests with the same id
    share its slot and its prefix-cache blocks; `lora_name` is what the server lists and
    what a request's `model` field names. `base_model_name`: the model it was trained on
    (the server's `/v1/models` shows it as the adapter's parent).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}.")
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or self.lora_int_id < 1):
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}.")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must name the adapter's directory, got "
                             f"{self.lora_path!r}.")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
