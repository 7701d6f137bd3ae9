"""The diffusion engine core: a busy loop in its own process, like vLLM's EngineCore.

Each iteration takes new messages (add / abort / shutdown), admits waiting requests (batched
text encoding, noise, schedules), runs ONE denoising step for one batch, decodes what is
done, and sends the outputs back. The worker here is the adapter over the loaded pipeline;
the process has one device, so there is no separate executor layer yet.
"""

from __future__ import annotations

import logging
import secrets
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from vllm_omni.engine.core_process import serve_core
from vllm_omni.engine.diffusion.batch_sizer import BatchSizer
from vllm_omni.engine.diffusion.cache import CacheConfig
from vllm_omni.engine.diffusion.params import DiffusionParams
from vllm_omni.engine.diffusion.request import DiffusionRequest
from vllm_omni.engine.diffusion.scheduler import DiffusionScheduler
from vllm_omni.orchestrator.connectors import SharedMemoryConnector

logger = logging.getLogger(__name__)

OFFLOAD_MODES = ("model", "group", "sequential")


@dataclass
class EngineOptions:
    """Engine settings, given once at start (the diffusion counterpart of engine args)."""

    dtype: str = "float32"
    device: str = "cpu"
    # On CPU a batch above ~8 images is slower per image than 8 (measured: flux-tiny 2.5 ms
    # per image-step at 8, 3.2 at 16); GPUs gain from larger batches: raise it there.
    max_batch_size: int = 8
    # Latent tokens x images per transformer call; default: no limit beyond batch size.
    max_batch_cost: int = 1 << 62
    max_running: int = 64
    # Learn per shape the batch size past which batching stops paying (see BatchSizer).
    adaptive_batch: bool = True
    num_threads: int | None = None
    # Least seconds between two progress outputs of one request: each output wakes the
    # client, which on a small CPU takes time from the denoising threads.
    progress_interval: float = 0.25
    # Weights kept on the CPU and moved to the GPU as they are needed (diffusers' own
    # offloading): "model" (one component at a time), "group" (groups of blocks, streamed),
    # "sequential" (one layer at a time; least memory, slowest). GPU devices only.
    offload: str | None = None
    defaults: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.offload is not None:
            if self.offload not in OFFLOAD_MODES:
                raise ValueError(f"offload must be one of {list(OFFLOAD_MODES)}, "
                                 f"got {self.offload!r}")
            if not self.device.startswith("cuda"):
                raise ValueError(f"offload {self.offload!r} needs a CUDA device; this "
                                 f"engine runs on {self.device}")


@dataclass
class DiffusionOutput:
    """Progress (`step` of `num_steps`) or the result of one request, sent to the client."""

    request_id: str
    step: int = 0
    num_steps: int = 0
    finished: bool = False
    images: list[np.ndarray] | None = None
    # A shared-memory handle ({"latents": tensor}): latents go to the next stage without
    # passing through the API process's pipe.
    latents: Any = None
    seed: int | None = None
    # Step-cache stats of a finished request: method, computed_steps, cached_steps.
    cache: dict[str, Any] | None = None
    error: str | None = None
    # "invalid": the request's parameters (a caller error); "internal": the engine failed.
    error_kind: str | None = None


class EngineCore:
    def __init__(self, model: str, options: EngineOptions, conn: Connection) -> None:
        import torch
        from diffusers import DiffusionPipeline
        from diffusers.utils import logging as diffusers_logging

        from vllm_omni.engine.diffusion.adapters import adapter_for

        diffusers_logging.disable_progress_bar()
        if options.num_threads:
            torch.set_num_threads(options.num_threads)
        self.conn = conn
        pipe = DiffusionPipeline.from_pretrained(model, dtype=getattr(torch, options.dtype))
        if options.offload == "model":
            pipe.enable_model_cpu_offload(device=options.device)
        elif options.offload == "sequential":
            pipe.enable_sequential_cpu_offload(device=options.device)
        elif options.offload == "group":
            pipe.enable_group_offload(onload_device=torch.device(options.device),
                                      offload_type="leaf_level", use_stream=True)
        else:
            pipe.to(options.device)
        self.adapter = adapter_for(pipe, options.device)
        self.defaults = options.defaults
        if self.defaults.get("cache") is not None:
            # The server-wide cache setting must fit the model: fail at start, not per request.
            self.adapter.check_cache(CacheConfig(**self.defaults["cache"]))
        sizer = BatchSizer(options.max_batch_size) if options.adaptive_batch else None
        self.scheduler = DiffusionScheduler(
            options.max_batch_size, options.max_batch_cost, options.max_running, sizer
        )
        self.running = True
        self.connector = SharedMemoryConnector(prefix="omni-dit")
        self.progress_interval = options.progress_interval
        self._last_progress: dict[str, float] = {}

    def info(self) -> dict[str, Any]:
        a = self.adapter
        return {
            "pipeline": type(a.pipe).__name__,
            "family": a.family,
            "step_level": a.step_level,
            "takes_images": a.takes_images,
            "defaults": a.defaults,
        }

    # -- messages ------------------------------------------------------------------------

    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            self.add(*msg[1:])
        elif kind == "abort":
            self.scheduler.abort(msg[1])
            self._last_progress.pop(msg[1], None)
        elif kind == "shutdown":
            self.running = False

    def add(self, request_id: str, prompt: str, params: dict[str, Any], images: list) -> None:
        try:
            self.adapter.check_inputs(images)
            given = DiffusionParams.parse(params).merged(self.defaults)
            resolved = self.adapter.resolve(given)
            if resolved.seed is None:
                resolved.seed = secrets.randbits(63)
        except ValueError as e:
            self.send(DiffusionOutput(request_id, finished=True, error=str(e),
                                      error_kind="invalid"))
            return
        self.scheduler.add(DiffusionRequest(request_id, prompt, resolved, input_images=images))

    def send(self, out: DiffusionOutput) -> None:
        self.conn.send(out)

    def fail(self, reqs: list[DiffusionRequest], exc: BaseException) -> None:
        logger.error("diffusion requests %s failed:\n%s", [r.request_id for r in reqs],
                     "".join(traceback.format_exception(exc)))
        for r in reqs:
            self.scheduler.finish(r)
            self._last_progress.pop(r.request_id, None)
            self.send(DiffusionOutput(r.request_id, finished=True, error=repr(exc),
                                      error_kind="internal"))

    # -- the loop --------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> None:
        admitted = self.scheduler.admit()
        if admitted:
            try:
                self.adapter.encode(admitted)
            except Exception as e:
                self.fail(admitted, e)
                admitted = []
            for r in admitted:
                try:
                    self.adapter.prepare(r)
                except Exception as e:
                    self.fail([r], e)
        batch = self.scheduler.pick_batch()
        if batch:
            start = time.perf_counter()
            try:
                self.adapter.denoise(batch)
            except Exception as e:
                self.fail(batch, e)
            else:
                if self.scheduler.sizer is not None and self.adapter.step_level:
                    images = sum(r.params.num_images for r in batch)
                    self.scheduler.sizer.record(batch[0].key, images, time.perf_counter() - start)
                now = time.monotonic()
                for r in batch:
                    last = self._last_progress.get(r.request_id, r.arrival_time)
                    if not r.denoised and now - last >= self.progress_interval:
                        self._last_progress[r.request_id] = now
                        self.send(DiffusionOutput(r.request_id, r.step, r.num_steps))
        for group in self.scheduler.denoised():
            self.finish(group)

    def finish(self, group: list[DiffusionRequest]) -> None:
        latent_only = group[0].params.output == "latent"
        try:
            if not latent_only:
                self.adapter.decode(group)
        except Exception as e:
            self.fail(group, e)
            return
        for r in group:
            self.scheduler.finish(r)
            self._last_progress.pop(r.request_id, None)
            self.send(DiffusionOutput(
                r.request_id, r.num_steps, r.num_steps, finished=True, images=r.images,
                latents=self.connector.put({"latents": r.latents}) if latent_only else None,
                seed=r.params.seed, cache=r.cache_stats(),
            ))


def run_engine_core(model: str, options: EngineOptions, conn: Connection) -> None:
    serve_core(lambda: EngineCore(model, options, conn), conn, "DiffusionCore")
