"""What travels on the pipe between an engine client and its core: typed messages, one
class each, so both ends read fields by name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class AddRequest:
    request_id: str
    prompt: Any
    params: dict[str, Any]
    images: list[Any] = field(default_factory=list)


@dataclass
class ExtendRequest:
    """More input for a running request (a core that takes streamed input)."""

    request_id: str
    payload: dict[str, Any]


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class Shutdown:
    pass


@dataclass
class Ping:
    """Answered by the core's loop between steps with a CoreOutput for `request_id`: proof
    that the loop still runs (a watchdog's probe)."""

    request_id: str


@dataclass
class Control:
    """A call on the core itself, not on a request (`method` with `args`), answered between
    steps with a ControlOutput for `request_id`."""

    request_id: str
    method: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class Ready:
    """The core is built; `info` describes what it serves."""

    info: dict[str, Any]


@dataclass
class StartFailed:
    traceback: str


ErrorKind = Literal["invalid", "internal"]


@dataclass
class CoreOutput:
    """One output of one request. Cores send subclasses with their own payload fields."""

    request_id: str
    finished: bool = False
    seed: int | None = None
    error: str | None = None
    # "invalid": the request's parameters (a caller error); "internal": the engine failed.
    error_kind: ErrorKind | None = None
    # A shared-memory handle the core left for the request's consumer; the client frees it
    # when nobody waits for the request any more.
    handle: Any = None


@dataclass
class ControlOutput(CoreOutput):
    """A Control call's answer (or its error, as a request's)."""

    result: dict[str, Any] = field(default_factory=dict)
