"""What the engine core asks of any adapter, step-level or whole-request.

An adapter turns a diffusers pipeline into the calls the core's loop makes: resolve a
request's settings, then encode / prepare / denoise / decode batches of requests the
scheduler picked. `StepAdapter` (step.py) makes each denoising step one call;
`WholeRequestAdapter` (whole.py) runs the pipeline's own loop as a single step.
"""

from __future__ import annotations

from typing import Any

from vllm_omni.engine.diffusion.cache import CacheConfig
from vllm_omni.engine.diffusion.params import DiffusionParams
from vllm_omni.engine.diffusion.request import DiffusionRequest


class DiffusionAdapter:
    """The base of both kinds; subclasses implement the abstract part."""

    family: str = ""
    step_level: bool = True  # the scheduler may batch requests step by step
    makes_video = False
    # What the API checks before a video job queues (None: the engine checks alone).
    size_multiple: int | None = None
    frame_step: int | None = None

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.defaults: dict[str, Any] = {}  # settings a request gets where it gives none

    @property
    def name(self) -> str:
        return type(self.pipe).__name__

    @property
    def takes_images(self) -> bool:
        return False

    def info(self) -> dict[str, Any]:
        """What the stage tells its callers about the model."""
        return {
            "pipeline": self.name, "family": self.family, "step_level": self.step_level,
            "takes_images": self.takes_images, "makes_video": self.makes_video,
            "size_multiple": self.size_multiple, "frame_step": self.frame_step,
            "defaults": self.defaults,
        }

    # -- checks, before a request queues (ValueError: the request's fault) -------------

    def resolve(self, params: DiffusionParams) -> DiffusionParams:
        """Fill the model's defaults and check what only the model can check."""
        raise NotImplementedError

    def default_area(self) -> int | None:
        """Pixels of one image at the model's default size (None: unknown)."""
        raise NotImplementedError

    def check_cache(self, config: CacheConfig) -> None:
        raise NotImplementedError

    def load_lora(self, name: str, path: str) -> None:
        """Serve the LoRA adapter at `path` as `name` (ValueError: it does not fit)."""
        raise ValueError(f"{self.name} runs as whole requests here: it serves no LoRA "
                         "adapters")

    def unload_lora(self, name: str) -> None:
        raise ValueError(f"no adapter named {name!r} is loaded")

    def lora_names(self) -> list[str]:
        return []

    def check_lora(self, params: DiffusionParams) -> None:
        """The request's adapter is loaded (ValueError naming the ones that are)."""
        if params.lora is not None:
            raise ValueError(f"no LoRA adapter named {params.lora!r} is loaded")

    def check_inputs(self, images: list) -> None:
        if images and not self.takes_images:
            raise ValueError(f"{self.name} takes no input image")

    def input_defaults(self, images: list) -> dict[str, Any]:
        """Settings a request's input images imply where it gives none (an edit's size)."""
        return {}

    def conditioning_from_states(self, tensors: dict[str, Any], length: int) -> dict[str, Any]:
        """Conditioning from an upstream text encoder's hidden states (`length` prompt
        rows), for families whose encoder can run as its own stage."""
        raise ValueError(f"{self.name} takes no prompt encoded upstream")

    def check_conditioning(self, given: list[dict], params: DiffusionParams) -> None:
        """A request's upstream conditioning fits it."""

    # -- the loop ------------------------------------------------------------------------

    def encode(self, reqs: list[DiffusionRequest]) -> None:
        """Conditioning for newly admitted requests, batched."""

    def prepare(self, req: DiffusionRequest) -> None:
        """A request's initial state, its batch key and its cost."""
        raise NotImplementedError

    def denoise(self, reqs: list[DiffusionRequest]) -> None:
        """One step for every request in `reqs` (all with the same batch key)."""
        raise NotImplementedError

    def decode(self, reqs: list[DiffusionRequest]) -> None:
        """Finished requests' images or videos, float in [0, 1]."""

    def release(self, request_id: str) -> None:
        """A request left the engine: what is kept of it can go."""
