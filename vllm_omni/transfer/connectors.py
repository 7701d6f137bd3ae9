"""Connectors: how a stage hands tensors to the next stage without the API process
touching them.

A producer `put`s named tensors and gets back a small, picklable handle; the handle is what
travels through the orchestrator; the consumer `get`s the tensors with it. Each payload is
read once: `get` releases it (a payload is one request's data for one downstream stage).

- SharedMemoryConnector: one POSIX shared-memory segment per payload, on one host. The
  consumer maps the segment and copies out of it (one copy); no bytes go through pipes or
  pickle.
- InProcessConnector: a dict, for stages in the same process and for tests.

Across nodes of a Ray cluster, transfer/object_store.py's ObjectStoreConnector does the same
through Ray's object store; `connector_for` picks the one that reads a given handle.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Protocol

import torch

_ALIGN = 64


@dataclass(frozen=True)
class TensorLayout:
    name: str
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ShmHandle:
    """Where a payload lives: the segment name and the tensors' layout in it."""

    segment: str
    size: int
    tensors: tuple[TensorLayout, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    def as_data(self) -> dict:
        """Plain data, for channels that carry no dataclasses (vLLM's RPC, extra_args)."""
        return {
            "segment": self.segment,
            "size": self.size,
            "tensors": [[t.name, t.dtype, list(t.shape), t.offset, t.nbytes] for t in self.tensors],
        }

    @classmethod
    def from_data(cls, data: dict) -> ShmHandle:
        return cls(
            data["segment"],
            data["size"],
            tuple(TensorLayout(n, d, tuple(s), o, b) for n, d, s, o, b in data["tensors"]),
        )


class Connector(Protocol):
    def put(self, tensors: dict[str, torch.Tensor]) -> object: ...

    def get(self, handle: object) -> dict[str, torch.Tensor]: ...

    def discard(self, handle: object) -> None: ...


class SharedMemoryConnector:
    """Tensors through /dev/shm, one segment per payload, released by the reader."""

    def __init__(self, prefix: str = "omni") -> None:
        self.prefix = prefix

    def put(self, tensors: dict[str, torch.Tensor]) -> ShmHandle:
        layouts, offset = [], 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            layouts.append(
                TensorLayout(
                    name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes
                )
            )
            offset += -(-nbytes // _ALIGN) * _ALIGN
        size = max(offset, 1)
        seg = shared_memory.SharedMemory(
            name=f"{self.prefix}-{secrets.token_hex(8)}", create=True, size=size
        )
        try:
            for layout, t in zip(layouts, tensors.values(), strict=True):
                if layout.nbytes:
                    dst = torch.frombuffer(
                        seg.buf, dtype=torch.uint8, count=layout.nbytes, offset=layout.offset
                    )
                    dst.copy_(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8))
            # The reader unlinks it; this process must not unlink it when it exits.
            resource_tracker.unregister(seg._name, "shared_memory")  # noqa: SLF001
        except BaseException:
            seg.close()
            seg.unlink()
            raise
        seg.close()
        return ShmHandle(seg.name, size, tuple(layouts))

    def get(self, handle: ShmHandle, release: bool = True) -> dict[str, torch.Tensor]:
        """The payload's tensors; `release=False` leaves it for other readers (the ranks of
        one stage), and whoever handed it out discards it."""
        # Attaching registers the segment with this process's resource tracker, and
        # unlink() below unregisters it: the reader owns the payload from here.
        seg = shared_memory.SharedMemory(name=handle.segment)
        if not release:  # not this process' to unlink, now or when it exits
            resource_tracker.unregister(seg._name, "shared_memory")  # noqa: SLF001
        try:
            out = {}
            for layout in handle.tensors:
                dtype = getattr(torch, layout.dtype)
                if layout.nbytes == 0:
                    out[layout.name] = torch.empty(layout.shape, dtype=dtype)
                    continue
                view = torch.frombuffer(
                    seg.buf, dtype=torch.uint8, count=layout.nbytes, offset=layout.offset
                )
                out[layout.name] = view.clone().view(dtype).reshape(layout.shape)
                del view
            return out
        finally:
            seg.close()
            if release:
                seg.unlink()

    def discard(self, handle: ShmHandle) -> None:
        """Release a payload nobody will read (e.g. its request was aborted)."""
        try:
            seg = shared_memory.SharedMemory(name=handle.segment)
        except FileNotFoundError:
            return
        seg.close()
        seg.unlink()


class InProcessConnector:
    """Payloads kept in a dict; handles are keys."""

    def __init__(self) -> None:
        self._store: dict[str, dict[str, torch.Tensor]] = {}

    def put(self, tensors: dict[str, torch.Tensor]) -> str:
        key = secrets.token_hex(8)
        self._store[key] = dict(tensors)
        return key

    def get(self, handle: str) -> dict[str, torch.Tensor]:
        return self._store.pop(handle)

    def discard(self, handle: str) -> None:
        self._store.pop(handle, None)


def connector_for(handle: object) -> Connector:
    """The connector that reads `handle` (whichever kind of edge it crossed)."""
    from vllm_omni.transfer.object_store import ObjectStoreConnector, ObjectStoreHandle

    if isinstance(handle, ObjectStoreHandle):
        return ObjectStoreConnector()
    return SharedMemoryConnector()
