"""Connectors: how a stage hands tensors to the next stage without the API process
touching them.

A producer `put`s named tensors and gets back a small, picklable handle; the handle is what
travels through the orchestrator; the consumer `get`s the tensors with it. Each payload is
read once: `get` releases it (a payload is one request's data for one downstream stage).

- SharedMemoryConnector: POSIX shared memory, on one host: a segment per payload, or, for
  long-lived producers (engine cores, workers), a pool of segments reused payload after
  payload. The consumer copies out of it, or reads in place; no bytes go through pipes or
  pickle.
- InProcessConnector: a dict, for stages in the same process and for tests.

Across nodes of a Ray cluster, transfer/object_store.py's ObjectStoreConnector does the same
through Ray's object store; `connector_for` picks the one that reads a given handle.
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Protocol

import numpy as np
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
    """Where a payload lives: the segment name and the tensors' layout in it. A `pooled`
    segment belongs to its producer's pool: the reader marks it free instead of unlinking
    it."""

    segment: str
    size: int
    tensors: tuple[TensorLayout, ...]
    pooled: bool = False

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
            "pooled": self.pooled,
        }

    @classmethod
    def from_data(cls, data: dict) -> ShmHandle:
        return cls(
            data["segment"],
            data["size"],
            tuple(TensorLayout(n, d, tuple(s), o, b) for n, d, s, o, b in data["tensors"]),
            data.get("pooled", False),
        )


class Connector(Protocol):
    def put(self, tensors: dict[str, torch.Tensor]) -> object: ...

    def get(self, handle: object) -> dict[str, torch.Tensor]: ...

    def discard(self, handle: object) -> None: ...


def _layouts(tensors: dict[str, torch.Tensor], start: int) -> tuple[list[TensorLayout], int]:
    layouts, offset = [], start
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        layouts.append(TensorLayout(name, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                                    offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return layouts, offset


def _write(buf: memoryview, layouts: list[TensorLayout], tensors: dict[str, torch.Tensor]) -> None:
    for layout, t in zip(layouts, tensors.values(), strict=True):
        if layout.nbytes:
            dst = torch.frombuffer(buf, dtype=torch.uint8, count=layout.nbytes,
                                   offset=layout.offset)
            dst.copy_(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8))


def _attach(name: str) -> shared_memory.SharedMemory:
    """Map a segment another process owns, without this process' resource tracker taking
    it over (it would unlink it when this process exits)."""
    seg = shared_memory.SharedMemory(name=name)
    resource_tracker.unregister(seg._name, "shared_memory")  # noqa: SLF001
    return seg


class _Attached:
    """Pooled segments this process has mapped, kept mapped: a segment is reused payload
    after payload, and mapping it anew costs a page fault per page. Bounded in bytes; the
    least recently used are unmapped first (their owner unlinks them)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.segments: OrderedDict[str, shared_memory.SharedMemory] = OrderedDict()

    def get(self, name: str) -> shared_memory.SharedMemory:
        seg = self.segments.pop(name, None) or _attach(name)
        self.segments[name] = seg
        total = sum(s.size for s in self.segments.values())
        while total > self.limit and len(self.segments) > 1:
            _, old = self.segments.popitem(last=False)
            total -= old.size
            try:
                old.close()
            except BufferError:  # a tensor read in place still uses it: kept mapped
                self.segments[old.name] = old
                self.segments.move_to_end(old.name, last=False)
                break
        return seg


_ATTACHED = _Attached(limit=512 << 20)
# The first byte of a pooled segment: free, its payload waiting to be read, or read in
# place and still viewed by the reader's tensors.
_FREE, _IN_USE, _VIEWED = 0, 1, 2
_HEADER = _ALIGN


def _set_state(seg: shared_memory.SharedMemory, state: int) -> None:
    seg.buf[0] = state


class SharedMemoryConnector:
    """Tensors through /dev/shm, released by the reader.

    By default each payload gets a segment of its own, which the reader unlinks, so a
    payload outlives its producer. With `pool_bytes`, the producer keeps the segments it
    made (up to that many bytes) and reuses one whose payload was read: no create, page
    faults or unlink per payload, which dominate small hops. A pooled segment is the
    producer's: it is unlinked when the producer exits (close() at exit; after a kill,
    sweep_orphaned_pools), so a payload must be read while its producer lives, as a
    stage's outputs are."""

    def __init__(self, prefix: str = "omni", pool_bytes: int = 0) -> None:
        self.prefix = prefix
        self.pool_bytes = pool_bytes
        self._pool: list[shared_memory.SharedMemory] = []
        if pool_bytes:
            atexit.register(self.close)

    def _segment(self, size: int) -> tuple[shared_memory.SharedMemory, bool]:
        """A free pooled segment of at least `size` bytes (made if there is room), or a
        one-off segment, and whether it is pooled."""
        fits = [s for s in self._pool if s.size >= size and s.buf[0] == _FREE]
        if fits:
            return min(fits, key=lambda s: s.size), True
        # Sizes in powers of two, so a payload a little larger than the last reuses too.
        rounded = 1 << max(16, (size - 1).bit_length())
        pooled = sum(s.size for s in self._pool) + rounded <= self.pool_bytes
        # A pooled segment's name carries its owner's pid: what sweep_orphaned_pools reads.
        owner = f"p{os.getpid()}-" if pooled else ""
        seg = shared_memory.SharedMemory(name=f"{self.prefix}-{owner}{secrets.token_hex(8)}",
                                         create=True, size=rounded if pooled else size)
        # Not the resource tracker's: a one-off segment is the reader's to unlink, a pooled
        # one this connector's (close(), or the sweep once this process is gone). Readers
        # may share this process' tracker, so attach and release must leave it as it is.
        resource_tracker.unregister(seg._name, "shared_memory")  # noqa: SLF001
        if pooled:
            self._pool.append(seg)
        return seg, pooled

    def put(self, tensors: dict[str, torch.Tensor]) -> ShmHandle:
        layouts, end = _layouts(tensors, _HEADER)
        seg, pooled = self._segment(max(end, _HEADER + 1))
        try:
            _write(seg.buf, layouts, tensors)
            if pooled:
                _set_state(seg, _IN_USE)  # after the payload: a reader sees it whole
        except BaseException:
            if not pooled:
                seg.close()
                seg.unlink()
            raise
        if not pooled:
            seg.close()
        return ShmHandle(seg.name, seg.size, tuple(layouts), pooled)

    def get(self, handle: ShmHandle, release: bool = True,
            in_place: bool = False) -> dict[str, torch.Tensor]:
        """The payload's tensors; `release=False` leaves it for other readers (the ranks of
        one stage), and whoever handed it out discards it. `in_place` (pooled payloads):
        tensors that view the segment instead of copies, for readers that do not modify
        them; the segment is released once the last of them is garbage."""
        if handle.pooled:
            seg = _ATTACHED.get(handle.segment)
        else:
            # Attaching registers the segment with this process's resource tracker, and
            # unlink() below unregisters it: the reader owns the payload from here.
            seg = shared_memory.SharedMemory(name=handle.segment)
            if not release:  # not this process' to unlink, now or when it exits
                resource_tracker.unregister(seg._name, "shared_memory")  # noqa: SLF001
        in_place = in_place and handle.pooled and release
        try:
            out = {}
            views = []
            for layout in handle.tensors:
                dtype = getattr(torch, layout.dtype)
                if layout.nbytes == 0:
                    out[layout.name] = torch.empty(layout.shape, dtype=dtype)
                    continue
                array = np.frombuffer(seg.buf, dtype=np.uint8, count=layout.nbytes,
                                      offset=layout.offset)
                view = torch.from_numpy(array)
                if in_place:
                    views.append(array)
                    out[layout.name] = view.view(dtype).reshape(layout.shape)
                else:
                    out[layout.name] = view.clone().view(dtype).reshape(layout.shape)
                del view, array
            if in_place and views:
                _set_state(seg, _VIEWED)
                _release_when_collected(seg, views)
            return out
        finally:
            if not handle.pooled:
                seg.close()
                if release:
                    seg.unlink()
            elif release and not (in_place and views):
                _set_state(seg, _FREE)

    def discard(self, handle: ShmHandle) -> None:
        """Release a payload nobody will read (e.g. its request was aborted)."""
        try:
            seg = _ATTACHED.get(handle.segment) if handle.pooled else shared_memory.SharedMemory(
                name=handle.segment)
        except FileNotFoundError:
            return
        if handle.pooled:
            _set_state(seg, _FREE)
            return
        seg.close()
        seg.unlink()

    def close(self) -> None:
        """Unlink this producer's pool (payloads not yet read are lost)."""
        for seg in self._pool:
            try:
                seg.close()
            except BufferError:  # read in place in this process: unmapped at exit
                pass
            # Never the tracker's (see _segment); unlink() tells it it is gone all the same.
            resource_tracker.register(seg._name, "shared_memory")  # noqa: SLF001
            seg.unlink()
        self._pool.clear()


_POOLED_NAME = re.compile(r"^omni[\w-]*-p(\d+)-[0-9a-f]{16}$")


def sweep_orphaned_pools(shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink pooled segments whose owner process is gone (killed before it could close
    its pool); returns their names. Called once a stage's processes have stopped."""
    swept = []
    for name in os.listdir(shm_dir):
        match = _POOLED_NAME.match(name)
        if match is None:
            continue
        try:
            os.kill(int(match[1]), 0)
            continue  # alive (or another user's process): its pool
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
            swept.append(name)
        except FileNotFoundError:
            pass
    return swept


def unread_payloads(prefix: str = "omni", shm_dir: str = "/dev/shm") -> set[str]:
    """Segments holding a payload nobody has read or discarded yet: one-off segments, and
    pooled ones marked waiting (a free pooled segment is its pool's memory; one read in
    place is its reader's until its tensors are collected). What a finished or aborted
    request must not leave behind."""
    found = set()
    for name in os.listdir(shm_dir) if os.path.isdir(shm_dir) else ():
        if not name.startswith(prefix):
            continue
        if _POOLED_NAME.match(name):
            try:
                with open(os.path.join(shm_dir, name), "rb") as f:
                    if f.read(1) != bytes([_IN_USE]):
                        continue
            except FileNotFoundError:
                continue
        found.add(name)
    return found


def _release_when_collected(seg: shared_memory.SharedMemory, arrays: list[np.ndarray]) -> None:
    """Mark a pooled segment free once every array viewing it is collected (the tensors
    read in place hold them)."""
    left = [len(arrays)]

    def one_gone() -> None:
        left[0] -= 1
        if left[0] == 0:
            _set_state(seg, _FREE)

    for array in arrays:
        weakref.finalize(array, one_gone)


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
