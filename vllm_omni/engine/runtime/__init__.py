"""The process runtime of vllm-omni's own (non-autoregressive) engines.

An engine core (a `CoreBase` subclass) lives in its own process and is driven by one loop;
its `EngineClient` in the API process sends it typed messages and hands each output to the
request waiting for it. Diffusion and code2wav are two cores over this one runtime.
"""

from vllm_omni.engine.runtime.client import EngineClient, EngineStartError
from vllm_omni.engine.runtime.core import CoreBase
from vllm_omni.engine.runtime.messages import (
    AbortRequest,
    AddRequest,
    CoreOutput,
    ExtendRequest,
    Ping,
    Shutdown,
)

__all__ = [
    "AbortRequest",
    "AddRequest",
    "CoreBase",
    "CoreOutput",
    "EngineClient",
    "EngineStartError",
    "ExtendRequest",
    "Ping",
    "Shutdown",
]
