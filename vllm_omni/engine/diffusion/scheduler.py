"""The diffusion engine's scheduler: step-level continuous batching, and the interface a
scheduler of one's own implements (engine arg `scheduler_cls: "package.module:Class"`).

Each engine step the core asks the scheduler which waiting requests start (`admit`), which
running ones advance one denoising step in one transformer call (`pick_batch`), and which
are denoised and decode together (`denoised`). Requests join the running set between steps
and leave it when denoised, so a new request never waits for a whole batch to finish. Only
requests with the same batch key (resolution, guidance mode) can share a transformer call.

The built-in `DiffusionScheduler` serves the most urgent request first, by `rank`: the
oldest under the "fcfs" policy (every request makes progress in arrival order, no
starvation), or the lowest `priority` value, then the oldest, under "priority" (as vLLM's
priority scheduling: a stream of urgent requests can hold back the others). A subclass that
only changes the order overrides `rank`.
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

from vllm_omni.engine.diffusion.batch_sizer import BatchSizer
from vllm_omni.engine.diffusion.request import DiffusionRequest

POLICIES = ("fcfs", "priority")
Policy = Literal["fcfs", "priority"]


@runtime_checkable
class SchedulerInterface(Protocol):
    """A diffusion scheduler. The core builds it with the keyword arguments of
    `DiffusionScheduler` (max_batch_size, max_batch_cost, max_running, sizer, policy) and
    calls, per engine step, `admit`, then `pick_batch`, then `denoised`. A batch must share
    one batch key and stay within max_batch_size images (or the sizer's lower limit) and
    max_batch_cost; a request picked advances one step; a denoised group shares one key."""

    max_running: int

    def add(self, req: DiffusionRequest) -> None:
        """A new request, waiting."""

    def abort(self, request_id: str) -> DiffusionRequest | None:
        """Drop a request wherever it is (its latents are freed with it)."""

    def finish(self, req: DiffusionRequest) -> None:
        """A request decoded and answered: it leaves the running set."""

    @property
    def has_work(self) -> bool: ...

    def admit(self) -> list[DiffusionRequest]:
        """Waiting requests that start now (the core encodes and prepares them)."""

    def pick_batch(self) -> list[DiffusionRequest]:
        """Running requests to advance by one step in one transformer call."""

    def denoised(self) -> list[list[DiffusionRequest]]:
        """Denoised requests, grouped so each group is one batched VAE call."""


class DiffusionScheduler:
    """
    Args:
        max_batch_size: most images in one transformer call (a request counts its images).
        max_batch_cost: most latent tokens (x images) in one call: the memory budget of a
            step's activations.
        max_running: most requests holding latents at once (their memory stays allocated).
        sizer: lowers the batch limit where bigger batches stop paying (see BatchSizer).
        policy: "fcfs" (arrival order) or "priority" (the request's `priority`, lower
            first, then arrival).
    """

    def __init__(
        self,
        max_batch_size: int,
        max_batch_cost: int,
        max_running: int,
        sizer: BatchSizer | None = None,
        policy: Policy = "fcfs",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {list(POLICIES)}, got {policy!r}")
        self.max_batch_size = max_batch_size
        self.sizer = sizer
        self.max_batch_cost = max_batch_cost
        self.max_running = max_running
        self.policy = policy
        self.waiting: list[DiffusionRequest] = []
        self.running: dict[str, DiffusionRequest] = {}

    def rank(self, req: DiffusionRequest) -> tuple:
        """The order requests are served in: the smallest first."""
        if self.policy == "priority":
            return (req.params.priority, req.arrival)
        return (req.arrival,)

    def add(self, req: DiffusionRequest) -> None:
        self.waiting.append(req)

    def abort(self, request_id: str) -> DiffusionRequest | None:
        req = self.running.pop(request_id, None)
        if req is not None:
            return req
        for r in self.waiting:
            if r.request_id == request_id:
                self.waiting.remove(r)
                return r
        return None

    def finish(self, req: DiffusionRequest) -> None:
        self.running.pop(req.request_id, None)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[DiffusionRequest]:
        """Move waiting requests into the running set, most urgent first, while there is
        room."""
        room = self.max_running - len(self.running)
        if room <= 0 or not self.waiting:
            return []
        self.waiting.sort(key=self.rank)
        admitted, self.waiting = self.waiting[:room], self.waiting[room:]
        for req in admitted:
            self.running[req.request_id] = req
        return admitted

    def pick_batch(self) -> list[DiffusionRequest]:
        """The most urgent running request's group, in rank order, up to the limits."""
        todo = sorted((r for r in self.running.values() if not r.denoised), key=self.rank)
        if not todo:
            return []
        key = todo[0].key
        limit = self.max_batch_size
        if self.sizer is not None:
            limit = min(limit, self.sizer.limit(key))
        batch, size, cost = [], 0, 0
        for r in todo:
            if r.key != key:
                continue
            n = r.params.num_images
            if batch and (size + n > limit or cost + r.cost > self.max_batch_cost):
                break
            batch.append(r)
            size += n
            cost += r.cost
        return batch

    def denoised(self) -> list[list[DiffusionRequest]]:
        groups: dict[tuple, list[DiffusionRequest]] = {}
        for r in sorted(self.running.values(), key=self.rank):
            if r.denoised:
                group = groups.setdefault(r.key, [])
                if sum(g.params.num_images for g in group) + r.params.num_images > max(
                    self.max_batch_size, r.params.num_images
                ):
                    continue  # decoded next step
                group.append(r)
        return list(groups.values())
