"""Payloads through Ray's object store: the connector of edges that cross nodes.

The producer's actor `put`s the tensors into its node's object store and hands back an
`ObjectStoreHandle` (an ObjectRef and the producer's node): that reference is all that goes
through the orchestrator. The consumer's actor `get`s the tensors, which Ray pulls from the
producer's node. Ray frees the object once no process holds the reference any more, so
`discard` only drops this handle's.

Ray is imported only when a payload is put or read: this module is importable without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ObjectStoreHandle:
    """An object-store payload: its reference, the node that put it, and its size."""

    ref: Any  # ray.ObjectRef of a dict[str, torch.Tensor]
    node: str  # Ray node id of the producer
    nbytes: int


class ObjectStoreConnector:
    def put(self, tensors: dict[str, torch.Tensor]) -> ObjectStoreHandle:
        import ray

        # Raw bytes as numpy arrays: Ray stores those as one buffer each, without pickling
        # the tensors, and a reader on the node maps them from its store instead of copying.
        plain = {}
        for name, t in tensors.items():
            t = t.detach().contiguous().cpu()
            raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else None
            plain[name] = (str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)
        nbytes = sum(raw.nbytes for _, _, raw in plain.values() if raw is not None)
        node = ray.get_runtime_context().get_node_id()
        return ObjectStoreHandle(ray.put(plain), node, nbytes)

    def get(self, handle: ObjectStoreHandle) -> dict[str, torch.Tensor]:
        import ray

        stored = ray.get(handle.ref)
        handle.ref = None  # read once, as every connector's payload
        return _tensors(stored)

    async def get_async(self, handle: ObjectStoreHandle) -> dict[str, torch.Tensor]:
        """`get` for an async actor: awaiting the reference lets the actor's event loop
        serve its other requests (streamed outputs, inputs) while Ray pulls the object
        from the producer's node; a blocking `ray.get` there would stall them all."""
        stored = await handle.ref
        handle.ref = None
        return _tensors(stored)

    def discard(self, handle: ObjectStoreHandle) -> None:
        handle.ref = None


def _tensors(stored: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of a stored payload, copied out of the object store."""
    out = {}
    for name, (dtype, shape, raw) in stored.items():
        if raw is None:
            out[name] = torch.empty(shape, dtype=getattr(torch, dtype))
            continue
        # The array maps the object store (read-only, freed with the reference): copy.
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        out[name] = flat.view(getattr(torch, dtype)).reshape(shape)
    return out
