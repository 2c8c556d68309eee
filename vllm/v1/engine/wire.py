"""The engine-core process's wire protocol: message kinds and small message types.

    API process (AsyncMPClient)                      engine-core process (EngineCoreProc)
    PUSH  input  ── [ADD | ABORT | STOP | UTILITY, body, *tensor frames] ──►  PULL
    PULL  output ◄── [OUTPUTS | UTILITY_RESULT | ENGINE_DEAD, body] ──  PUSH

Both sides import this module; it imports nothing of the engine, so the API process does
not load the scheduler, the runner or the models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# First frame of every input message.
REQ_ADD = b"\x00"
REQ_ABORT = b"\x01"
REQ_UTILITY = b"\x02"
REQ_STOP = b"\x03"  # a stop string ended these requests in the API process
# First frame of every output message.
OUT_OUTPUTS = b"\x00"
OUT_UTILITY_RESULT = b"\x01"
OUT_ENGINE_DEAD = b"\x02"


@dataclass(slots=True)
class UtilityCall:
    call_id: int
    method: str
    args: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class UtilityResult:
    call_id: int
    result: Any = None
    error: str | None = None  # set when the call raised


@dataclass(slots=True)
class EngineDead:
    message: str
