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

        # Contiguous CPU tensors pickle as one buffer each (Ray's zero-copy path for
        # numpy-backed data keeps them in shared memory on the reading node).
        plain = {k: t.detach().contiguous().cpu() for k, t in tensors.items()}
        nbytes = sum(t.numel() * t.element_size() for t in plain.values())
        node = ray.get_runtime_context().get_node_id()
        return ObjectStoreHandle(ray.put(plain), node, nbytes)

    def get(self, handle: ObjectStoreHandle) -> dict[str, torch.Tensor]:
        import ray

        tensors = ray.get(handle.ref)
        handle.ref = None  # read once, as every connector's payload
        return tensors

    def discard(self, handle: ObjectStoreHandle) -> None:
        handle.ref = None
