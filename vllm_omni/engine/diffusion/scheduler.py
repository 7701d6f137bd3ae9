"""DiffusionScheduler: step-level continuous batching for diffusion requests.

Each engine step the scheduler picks one batch of requests to advance by one denoising step.
Requests join the running set between steps and leave it when denoised, so a new request
never waits for a whole batch to finish. Only requests with the same batch key (resolution,
guidance mode) can share a transformer call; the batch is always the group of the oldest
running request, so every request makes progress in arrival order (no starvation).
"""

from __future__ import annotations

from collections import deque

from vllm_omni.engine.diffusion.batch_sizer import BatchSizer
from vllm_omni.engine.diffusion.request import DiffusionRequest


class DiffusionScheduler:
    """
    Args:
        max_batch_size: most images in one transformer call (a request counts its images).
        max_batch_cost: most latent tokens (x images) in one call: the memory budget of a
            step's activations.
        max_running: most requests holding latents at once (their memory stays allocated).
        sizer: lowers the batch limit where bigger batches stop paying (see BatchSizer).
    """

    def __init__(
        self,
        max_batch_size: int,
        max_batch_cost: int,
        max_running: int,
        sizer: BatchSizer | None = None,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.sizer = sizer
        self.max_batch_cost = max_batch_cost
        self.max_running = max_running
        self.waiting: deque[DiffusionRequest] = deque()
        self.running: dict[str, DiffusionRequest] = {}

    def add(self, req: DiffusionRequest) -> None:
        self.waiting.append(req)

    def abort(self, request_id: str) -> DiffusionRequest | None:
        """Drop a request wherever it is; its latents are freed with it."""
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
        """Move waiting requests into the running set, oldest first, while there is room."""
        admitted = []
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting.popleft()
            self.running[req.request_id] = req
            admitted.append(req)
        return admitted

    def pick_batch(self) -> list[DiffusionRequest]:
        """The batch to denoise now: the oldest running request's group, in arrival order."""
        todo = sorted(
            (r for r in self.running.values() if not r.denoised), key=lambda r: r.arrival
        )
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
        """Requests ready to decode, grouped so each group is one batched VAE call."""
        groups: dict[tuple, list[DiffusionRequest]] = {}
        for r in sorted(self.running.values(), key=lambda r: r.arrival):
            if r.denoised:
                group = groups.setdefault(r.key, [])
                if sum(g.params.num_images for g in group) + r.params.num_images > max(
                    self.max_batch_size, r.params.num_images
                ):
                    continue  # decoded next step
                group.append(r)
        return list(groups.values())
