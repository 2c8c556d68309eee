"""`ServedLoRAs`: the LoRA adapters a server serves beside its base model, by name.

A request's `model` field picks one (`resolve`); `/v1/models` lists them with their parent
(the base model); `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (only with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING`) add and remove them at run time, with vLLM's request
bodies, replies and errors. Adapter ids are handed out here, one per name ever loaded.
"""

from __future__ import annotations

import itertools
import json
import os

from vllm.entrypoints.errors import OpenAIError
from vllm.entrypoints.openai.protocol import ModelCard
from vllm.lora.request import LoRARequest

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATING_ENV, "").lower() in ("1", "true")


def parse_lora_module(text: str) -> tuple[str, str, str | None]:
    """`--lora-modules` entries: `name=path`, or vLLM's JSON form
    `{"name": ..., "path": ..., "base_model_name": ...}`; (name, path, base model name)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: not JSON: {e}") from None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) \
                or not isinstance(value.get("path"), str):
            raise ValueError(f"--lora-modules: a JSON entry needs string 'name' and 'path', "
                             f"got {text!r}.")
        unknown = sorted(set(value) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"--lora-modules: unknown key(s) {unknown} in {text!r}.")
        base = value.get("base_model_name")
        return value["name"], value["path"], base if isinstance(base, str) else None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules entries are name=path or JSON, got {text!r}.")
    return name, path, None


class ServedLoRAs:
    """The served adapters, name -> `LoRARequest` (ids from 1, never reused)."""

    def __init__(self, base_model_name: str) -> None:
        self.base_model_name = base_model_name
        self.loras: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def resolve(self, name: str) -> LoRARequest | None:
        return self.loras.get(name)

    def make_request(self, name: str, path: str, base_model_name: str | None = None
                     ) -> LoRARequest:
        """A new adapter's request (not yet served: `add` it once the engine took it)."""
        if not name or not path:
            raise OpenAIError("Both 'lora_name' and 'lora_path' must be provided.",
                            "InvalidUserInput", 400)
        if name in self.loras or name == self.base_model_name:
            raise OpenAIError(f"The lora adapter '{name}' has already been loaded.",
                            "InvalidUserInput", 400)
        return LoRARequest(name, next(self._ids), path, base_model_name)

    def add(self, lora: LoRARequest) -> None:
        self.loras[lora.lora_name] = lora

    def remove(self, name: str) -> LoRARequest:
        if not name:
            raise OpenAIError("'lora_name' needs to be provided to unload a LoRA adapter.",
                            "InvalidUserInput", 400)
        lora = self.loras.pop(name, None)
        if lora is None:
            raise OpenAIError(f"The lora adapter '{name}' cannot be found.", "NotFoundError",
                            404)
        return lora

    def cards(self, max_model_len: int) -> list[ModelCard]:
        return [ModelCard(id=lora.lora_name, root=lora.lora_path,
                          parent=lora.base_model_name or self.base_model_name,
                          max_model_len=max_model_len)
                for lora in self.loras.values()]
