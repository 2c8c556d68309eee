"""Connectors: how one stage's finished output becomes the next stage's prompt.

A connector is any callable `RequestOutput -> prompt` (a prompt as `LLM.generate` takes
it). Two ship here, also reachable by name from a pipeline's YAML file:

    hidden_states_to_embeds   stage k's hidden states (prompt and generated rows),
                              optionally projected, become stage k+1's `prompt_embeds`
    text_to_prompt            stage k's generated text becomes stage k+1's text prompt

A connector may say what it needs through two attributes, read by `Pipeline`:
`needs_hidden_states` (stage k must return them) and `makes_embeds` (stage k+1 must accept
prompt embeds). Plain callables have neither; their stages are configured by hand.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from vllm.outputs import RequestOutput

Connector = Callable[[RequestOutput], Any]


class HiddenStatesToEmbeds:
    """Stage k's last hidden states, `[num_prompt + num_output - 1, hidden_size]`, as stage
    k+1's prompt embeds.

    Args:
        projection: a module or callable `[num_rows, hidden_k] -> [num_rows, hidden_k+1]`,
            for stages whose hidden sizes differ; a module gets the rows in its own dtype.
    """

    needs_hidden_states = True
    makes_embeds = True

    def __init__(self, projection: Callable[[torch.Tensor], torch.Tensor] | None = None
                 ) -> None:
        self.projection = projection

    def __call__(self, output: RequestOutput) -> dict[str, torch.Tensor]:
        rows = output.hidden_states
        if rows is None:
            raise ValueError(f"Request {output.request_id} has no hidden states to pass on: "
                             "its stage must run with return_hidden_states=True.")
        if self.projection is not None:
            if isinstance(self.projection, torch.nn.Module):
                param = next(self.projection.parameters(), None)
                if param is not None:
                    rows = rows.to(param.dtype)
            with torch.inference_mode():
                rows = self.projection(rows)
        return {"prompt_embeds": rows}


class TextToPrompt:
    """Stage k's generated text (its first sequence) as stage k+1's text prompt."""

    needs_hidden_states = False
    makes_embeds = False

    def __call__(self, output: RequestOutput) -> dict[str, str]:
        return {"prompt": output.outputs[0].text}


CONNECTORS: dict[str, type] = {
    "hidden_states_to_embeds": HiddenStatesToEmbeds,
    "text_to_prompt": TextToPrompt,
}


def make_connector(spec: str | dict[str, Any] | Connector) -> Connector:
    """A connector from a callable, a name, or `{"name": ..., "projection": "module:attr"}`
    (the projection is imported: a module instance, or a callable)."""
    if callable(spec):
        return spec
    options = dict(spec) if isinstance(spec, dict) else {"name": spec}
    name = options.pop("name", None)
    if name not in CONNECTORS:
        raise ValueError(f"Unknown connector {name!r}; choose one of "
                         f"{', '.join(CONNECTORS)}, or pass a callable.")
    if "projection" in options:
        options["projection"] = _import_object(options["projection"])
    try:
        return CONNECTORS[name](**options)
    except TypeError as e:
        raise ValueError(f"Bad options for connector {name!r}: {e}") from None


def _import_object(path: str) -> Any:
    """`package.module:attribute`, imported."""
    module_name, _, attr = str(path).partition(":")
    if not module_name or not attr:
        raise ValueError(f"Expected 'module:attribute', got {path!r}.")
    return getattr(importlib.import_module(module_name), attr)
