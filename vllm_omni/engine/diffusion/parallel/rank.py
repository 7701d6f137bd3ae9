"""What every rank of a parallel diffusion stage runs: its share of one transformer call.

The engine core (rank 0) decides everything: which requests, which rows, their cache slots.
It sends each other rank a `Call` (the call's arguments with tensors left out, then the
tensors by broadcast), and every rank, rank 0 included, runs `RankRuntime.execute`:

- rows: with CFG parallel, a guidance batch's rows (conditional first, then unconditional)
  are split in two halves, one per branch group; other batches run on group 0 alone, so a
  row's cache slot always lives on the same ranks;
- sequence: inside a group each rank takes its slice of the text and image tokens, and the
  attention processor exchanges them (attention.py);
- results: every rank sends its output slice to rank 0, which puts the batch together.

Step caching: each rank keeps the cache slots of its rows (by key), since the residuals it
stores are its own slices. The reuse decision is taken from one signal, the change over the
whole sequence (its sums all-reduced over the group), so every rank of a group decides alike
and the decision equals the one-process engine's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from vllm_omni.engine.diffusion.cache import CacheConfig, CacheSlot, DiTCacheManager
from vllm_omni.engine.diffusion.parallel.attention import (
    FluxSequenceParallelProcessor,
    SequenceGroup,
)
from vllm_omni.engine.diffusion.parallel.clock import COMM
from vllm_omni.engine.diffusion.parallel.layout import Layout


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor argument was: filled from the broadcast that follows the Call."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Call:
    """One transformer call of the engine core, for every rank."""

    kwargs: dict[str, Any]  # tensors replaced by TensorRef
    # Per row: (slot key, its config) or None for a row without caching.
    slots: list[tuple[tuple, CacheConfig] | None]
    timesteps: list[float]
    cfg: bool  # a guidance batch: conditional rows, then as many unconditional ones
    release: list[str] = field(default_factory=list)  # requests whose slots to forget


@dataclass(frozen=True)
class TransformerSpec:
    """How a family's transformer arguments split: by row and by sequence."""

    batched: tuple[str, ...]  # one row per image (tensors, or lists such as Qwen's shapes)
    sequence: dict[str, int]  # sequence-split arguments and their token dim
    output_sequence_dim: int | None  # the output's token dim (None: not sequence parallel)


class RankRuntime:
    """This rank's transformer, groups and cache slots."""

    def __init__(self, layout: Layout, rank: int, transformer, spec: TransformerSpec,
                 modulated_input, device: torch.device) -> None:
        self.layout, self.rank, self.spec, self.device = layout, rank, spec, device
        self.transformer = transformer
        self.cfg_index, ring_index, ulysses_index = layout.coords(rank)
        self.sequence_index = rank - layout.sequence_ranks(self.cfg_index)[0]
        self.sequence_group = self._groups(ring_index, ulysses_index)
        self.cache = DiTCacheManager(transformer, modulated_input)
        if layout.sequence > 1:
            self.cache.reduce = self._sum_over_sequence
        self.slots: dict[tuple, CacheSlot] = {}

    def _groups(self, ring_index: int, ulysses_index: int) -> dist.ProcessGroup | None:
        """Every rank creates every group, in the same order (torch.distributed's rule);
        this rank keeps its own."""
        lay, mine = self.layout, None
        ulysses = ring = None
        for c in range(lay.cfg):
            if lay.sequence > 1:
                g = dist.new_group(lay.sequence_ranks(c))
                mine = g if c == self.cfg_index else mine
            if lay.ulysses > 1:
                for i in range(lay.ring):
                    g = dist.new_group(lay.ulysses_ranks(c, i))
                    if (c, i) == (self.cfg_index, ring_index):
                        ulysses = g
            if lay.ring > 1:
                for j in range(lay.ulysses):
                    g = dist.new_group(lay.ring_ranks(c, j))
                    if (c, j) == (self.cfg_index, ulysses_index):
                        ring = g
        if lay.sequence > 1:
            group = SequenceGroup(lay.ulysses_ranks(self.cfg_index, ring_index), ulysses,
                                  lay.ring_ranks(self.cfg_index, ulysses_index), ring)
            self.transformer.set_attn_processor(FluxSequenceParallelProcessor(group))
        return mine

    def _sum_over_sequence(self, stats: torch.Tensor) -> torch.Tensor:
        stats = stats.to(self.device)
        with COMM.timing():
            dist.all_reduce(stats, group=self.sequence_group)
        return stats

    # -- one call ------------------------------------------------------------------------

    def rows(self, call: Call, total: int) -> range:
        """The batch rows this rank's group runs."""
        if call.cfg and self.layout.cfg > 1:
            half = total // 2
            return range(self.cfg_index * half, (self.cfg_index + 1) * half)
        return range(total) if self.cfg_index == 0 else range(0)

    def execute(self, call: Call, tensors: list[torch.Tensor] | None,
                slots: list[CacheSlot | None] | None = None) -> torch.Tensor | None:
        """Receive the call's tensors (rank 0 sends them), run this rank's share, send it to
        rank 0 (other ranks) or return it (rank 0: its own share)."""
        for request_id in call.release:
            for key in [k for k in self.slots if k[0] == request_id]:
                del self.slots[key]
        kwargs = self._receive(call, tensors)
        total = len(call.timesteps)
        rows = self.rows(call, total)
        if not rows:
            return None
        if slots is None:  # a worker: its own slots, by key
            slots = [None if s is None else self._slot(*s) for s in call.slots]
        kwargs = {k: self._split(k, v, rows, total) for k, v in kwargs.items()}
        mine = [slots[r] for r in rows]
        before = [s.cached if s else 0 for s in mine]
        with self.cache.step(mine, [call.timesteps[r] for r in rows]):
            out = self.transformer(**kwargs, return_dict=False)[0].contiguous()
        if self.rank != 0:
            with COMM.timing():
                dist.send(out, 0)
            if self.sequence_index == 0 and any(mine):
                # rank 0 counts the steps its group cached (a request's cache stats)
                flags = [int(s.cached > b) if s else 0 for s, b in zip(mine, before, strict=True)]
                dist.send(torch.tensor(flags, device=self.device), 0)
        return out

    def _slot(self, key: tuple, config: CacheConfig) -> CacheSlot:
        slot = self.slots.get(key)
        if slot is None:
            slot = self.slots[key] = CacheSlot(config, key)
        return slot

    def _receive(self, call: Call, tensors: list[torch.Tensor] | None) -> dict[str, Any]:
        refs = [v for v in call.kwargs.values() if isinstance(v, TensorRef)]
        if tensors is None:
            tensors = [torch.empty(r.shape, dtype=r.dtype, device=self.device) for r in refs]
        with COMM.timing():
            for t in tensors:
                dist.broadcast(t, 0)
        return {k: tensors[v.index] if isinstance(v, TensorRef) else v
                for k, v in call.kwargs.items()}

    def _split(self, name: str, value: Any, rows: range, total: int) -> Any:
        if name in self.spec.batched and value is not None and len(rows) != total:
            value = value[rows.start:rows.stop]
        dim = self.spec.sequence.get(name)
        if dim is not None and self.layout.sequence > 1 and value is not None:
            n = value.shape[dim] // self.layout.sequence
            value = value.narrow(dim, self.sequence_index * n, n)
        return value


def strip_tensors(kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The arguments with tensors replaced by references, and the tensors in order."""
    meta, tensors = {}, []
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            value = value.contiguous()
            meta[name] = TensorRef(len(tensors), tuple(value.shape), value.dtype)
            tensors.append(value)
        else:
            meta[name] = value
    return meta, tensors
