"""The state of one diffusion request inside the engine core."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_omni.engine.diffusion.params import DiffusionParams

_arrivals = itertools.count()


@dataclass
class DiffusionRequest:
    request_id: str
    prompt: str
    # Resolved: the model's defaults filled in, so every field but negative_prompt is set.
    params: DiffusionParams
    # Input images (PIL) for pipelines that edit or transform an image.
    input_images: list[Any] = field(default_factory=list)
    arrival: int = field(default_factory=lambda: next(_arrivals))
    arrival_time: float = field(default_factory=time.monotonic)
    # Requests with the same key can be denoised in one batched transformer call.
    key: tuple = ()
    # Latent tokens x images: the unit of the scheduler's memory budget.
    cost: int = 0
    # Conditioning an upstream stage computed (the prompt's, then the negative prompt's):
    # used instead of encoding the prompt here.
    given: list[dict[str, torch.Tensor]] = field(default_factory=list)
    cond: dict[str, torch.Tensor] = field(default_factory=dict)
    uncond: dict[str, torch.Tensor] | None = None
    latents: torch.Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    # A private copy of the pipeline's scheduler: it keeps per-request step state.
    scheduler: Any = None
    timesteps: torch.Tensor | None = None
    step: int = 0
    images: list[np.ndarray] | None = None
    # A video pipeline's result: frames x height x width x 3, float in [0, 1].
    video: np.ndarray | None = None
    # Step-cache state, one slot per image and guidance branch (cond rows first).
    cache_slots: list[Any] = field(default_factory=list)

    def cache_stats(self) -> dict[str, Any] | None:
        """Steps computed / reused, summed over the request's images and guidance branches."""
        if not self.cache_slots:
            return None
        return {
            "method": self.cache_slots[0].config.method,
            "computed_steps": sum(s.computed for s in self.cache_slots),
            "cached_steps": sum(s.cached for s in self.cache_slots),
        }

    @property
    def num_steps(self) -> int:
        return 0 if self.timesteps is None else len(self.timesteps)

    @property
    def denoised(self) -> bool:
        return self.timesteps is not None and self.step >= self.num_steps
