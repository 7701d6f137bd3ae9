"""Where a step adapter's transformer call runs: in this process, or over a stage's ranks.

The engine core picks the executor and hands it to the adapter (as vLLM's EngineCore hands
its Executor the workers), so an adapter says how a family steps and never where.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from vllm_omni.engine.diffusion.cache import CacheSlot, DiTCacheManager
from vllm_omni.engine.diffusion.cache.manager import ModulatedInput


class TransformerExecutor(Protocol):
    """Runs a stage's transformer on a batch of rows, with their step-cache slots."""

    cache: DiTCacheManager  # the hooks that skip blocks, on the transformer this process runs
    sequence_parallel: int  # ranks the image tokens are split between (1: none)

    def __call__(self, inputs: dict[str, Any], slots: list[CacheSlot | None],
                 timesteps: list[float], cfg: bool) -> torch.Tensor:
        """The transformer's output for `inputs` (both guidance branches when `cfg`)."""
        ...

    def release(self, request_id: str) -> None:
        """A request left the engine: forget what is kept of it (its cache slots)."""
        ...


class LocalTransformer:
    """The transformer in this process."""

    sequence_parallel = 1

    def __init__(self, transformer: nn.Module, modulated_input: ModulatedInput) -> None:
        self.transformer = transformer
        self.cache = DiTCacheManager(transformer, modulated_input)

    def __call__(self, inputs: dict[str, Any], slots: list[CacheSlot | None],
                 timesteps: list[float], cfg: bool) -> torch.Tensor:
        with self.cache.step(slots, timesteps):
            return self.transformer(**inputs, return_dict=False)[0]

    def release(self, request_id: str) -> None:
        """Slots live with their requests here: nothing to forget."""
