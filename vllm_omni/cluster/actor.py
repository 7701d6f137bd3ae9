"""The Ray actor that hosts a stage: the stage itself, with the cluster's duties mixed in.

The actor's class is the stage's kind (ARStage, DiffusionStage, Code2WavStage...) with
`StageHost` mixed in, so the actor *is* the stage: `abort`, `render`, `check_health`,
`ping`, `shutdown` are the kind's own methods, called by Ray. `StageHost` adds only what a
stage on a cluster needs beyond its kind:

- payload handles in its inputs that came from another node (`ObjectStoreHandle`) are
  fetched from Ray's object store into this node's shared memory, where the kind reads
  shared-memory handles as it always does;
- payloads it outputs go to the object store when a reader of its outputs is on another
  node (the proxy says so per request: `export_payloads`), else stay in shared memory;
- `facts()`: its node and its `StageInfo` (what the proxy answers locally: request
  defaults, the model's config, voices...);
- `lifeline()`: a call that returns only when its engine has died, and fails when the
  actor or its node has: how the proxy learns either without polling the actor.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from functools import cache
from typing import Any, ClassVar

import ray

from vllm_omni.outputs import OmniRequestOutput
from vllm_omni.transfer.connectors import SharedMemoryConnector, ShmHandle
from vllm_omni.transfer.object_store import ObjectStoreConnector, ObjectStoreHandle


class StageHost:
    kind: ClassVar[type]  # the stage kind this actor hosts

    def facts(self) -> dict[str, Any]:
        """Where the stage runs, and its `StageInfo` (plain data the proxy answers from)."""
        return {"node": ray.get_runtime_context().get_node_id(), "info": self.info}

    def received(self) -> list[dict[str, Any]]:
        """The payloads this stage fetched from other nodes: producer node, bytes."""
        return list(getattr(self, "_received", []))

    async def _localize(self, request_id: str, value: Any) -> Any:
        """`value` with object-store payloads moved into this node's shared memory (freed
        when the request ends here, whether or not the stage read them)."""
        if isinstance(value, ObjectStoreHandle):
            self.__dict__.setdefault("_received", []).append(
                {"from_node": value.node, "nbytes": value.nbytes})
            tensors = await ObjectStoreConnector().get_async(value)
            local = SharedMemoryConnector().put(tensors)
            self.__dict__.setdefault("_localized", {}).setdefault(request_id, []).append(local)
            return local
        if isinstance(value, dict):
            return {k: await self._localize(request_id, v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)([await self._localize(request_id, v) for v in value])
        return value

    async def generate(
        self,
        request_id: str,
        prompt: Any,
        params: Any,
        *,
        input_complete: bool = True,
        keep_hidden_states: bool = False,
        export_payloads: bool = False,
    ) -> AsyncIterator[OmniRequestOutput]:
        try:
            prompt = await self._localize(request_id, prompt)
            outputs = super().generate(request_id, prompt, params,
                                       input_complete=input_complete,
                                       keep_hidden_states=keep_hidden_states)
            async for out in outputs:
                if export_payloads and out.tensor_handles:
                    out.tensor_handles = {k: _export(h) for k, h in out.tensor_handles.items()}
                yield out
        finally:
            for handle in self.__dict__.get("_localized", {}).pop(request_id, []):
                SharedMemoryConnector().discard(handle)

    async def add_input(self, request_id: str, prompt: Any, complete: bool) -> None:
        await super().add_input(request_id, await self._localize(request_id, prompt), complete)

    async def lifeline(self) -> str:
        while not self.errored:
            await asyncio.sleep(0.5)
        return "its engine died"


def _export(handle: Any) -> Any:
    """A shared-memory payload moved to the object store (read, and so freed, here)."""
    if isinstance(handle, ShmHandle):
        return ObjectStoreConnector().put(SharedMemoryConnector().get(handle))
    return handle


@cache
def hosted_class(kind: type) -> type:
    """The actor class of a stage kind: the kind with StageHost mixed in."""
    return type(f"Ray{kind.__name__}", (StageHost, kind), {"kind": kind})
