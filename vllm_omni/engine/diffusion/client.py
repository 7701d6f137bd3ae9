"""AsyncDiffusionEngine: the runtime's EngineClient bound to the diffusion core."""

from __future__ import annotations

from vllm_omni.engine.diffusion.core import DiffusionCore, EngineOptions
from vllm_omni.engine.runtime import EngineClient


class AsyncDiffusionEngine(EngineClient):
    """A diffusion engine core in its own process. `generate(request_id, prompt, params,
    images)` yields progress outputs (step / num_steps), then the finished one with images,
    or with latents as a shared-memory handle (`SharedMemoryConnector().get(out.handle)`)."""

    def __init__(self, model: str, options: EngineOptions | None = None) -> None:
        super().__init__(DiffusionCore, model, options or EngineOptions())
