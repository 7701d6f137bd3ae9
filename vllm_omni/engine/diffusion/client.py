"""AsyncDiffusionEngine: the runtime's EngineClient bound to the diffusion core."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from vllm_omni.engine.diffusion.core import DiffusionCore, DiffusionOutput, EngineOptions
from vllm_omni.engine.runtime import EngineClient
from vllm_omni.transfer.connectors import SharedMemoryConnector


class AsyncDiffusionEngine(EngineClient):
    """A diffusion engine core in its own process. `generate(request_id, prompt, params,
    images)` yields progress outputs (step / num_steps), then the finished one with its
    8-bit images or frames (read here out of the shared memory the core left them in), or
    with latents as a shared-memory handle (`SharedMemoryConnector().get(out.handle)`),
    which travel on to the next stage unread."""

    def __init__(self, model: str, options: EngineOptions | None = None) -> None:
        super().__init__(DiffusionCore, model, options or EngineOptions())

    async def generate(self, request_id: str, prompt: Any, params: dict[str, Any] | None = None,
                       images: list[Any] | None = None) -> AsyncIterator[DiffusionOutput]:
        async for out in super().generate(request_id, prompt, params, images):
            if out.handle is not None and "latents" not in out.handle.names:
                # Images are encoded, never written to: read where the core left them.
                # A video may be kept for an hour (a job): copied, not holding the pool.
                in_place = "video" not in out.handle.names
                tensors = SharedMemoryConnector().get(out.handle, in_place=in_place)
                out.handle = None
                if "video" in tensors:
                    out.video = tensors["video"].numpy()
                else:
                    out.images = list(tensors["images"].numpy())
                if "float_video" in tensors:
                    out.float_video = tensors["float_video"].numpy()
                if "float_images" in tensors:
                    out.float_images = tensors["float_images"].numpy()
            yield out
