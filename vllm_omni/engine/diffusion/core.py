"""The diffusion engine core: a diffusers pipeline driven step by step in its own process,
like vLLM's EngineCore (the loop and the messages are the runtime's, engine/runtime/).

Each step admits waiting requests (batched text encoding, noise, schedules), runs ONE
denoising step for one batch, decodes what is done, and sends the outputs back. The worker
here is the adapter over the loaded pipeline; the process has one device, so there is no
separate executor layer yet.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from vllm_omni.config.loader import load_function
from vllm_omni.engine.diffusion.batch_sizer import BatchSizer
from vllm_omni.engine.diffusion.cache import CacheConfig
from vllm_omni.engine.diffusion.parallel.clock import COMM
from vllm_omni.engine.diffusion.params import DiffusionParams
from vllm_omni.engine.diffusion.quantize import check_quantization, quantize_weights
from vllm_omni.engine.diffusion.request import DiffusionRequest
from vllm_omni.engine.diffusion.scheduler import (
    POLICIES,
    DiffusionScheduler,
    SchedulerInterface,
)
from vllm_omni.engine.runtime import AddRequest, CoreBase, CoreOutput
from vllm_omni.transfer.connectors import SharedMemoryConnector

logger = logging.getLogger(__name__)

OFFLOAD_MODES = ("model", "group", "sequential")


@dataclass
class EngineOptions:
    """Engine settings, given once at start (the diffusion counterpart of engine args)."""

    dtype: str = "float32"
    device: str = "cpu"
    # On a CPU, larger batches stop paying per image past a few (benchmarks/RESULTS.md);
    # GPUs gain from larger batches: raise it there.
    max_batch_size: int = 8
    # Latent tokens x images per transformer call; default: no limit beyond batch size.
    max_batch_cost: int = 1 << 62
    max_running: int = 64
    # The order requests are served in: "fcfs", or "priority" (the request's `priority`,
    # lower first), as vLLM's scheduling_policy; `scheduler_cls` ("package.module:Class",
    # see engine/diffusion/scheduler.py) replaces the built-in scheduler.
    scheduling_policy: str = "fcfs"
    # Shared memory the core keeps for its outputs' hops, reused payload after payload.
    pool_mb: int = 256
    scheduler_cls: str | None = None
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
    # Largest width x height one image may have. The memory plan reserves activations for a
    # full batch at the model's default size, so by default one image may fill that batch
    # (max_batch_size times the default area); a larger one is refused (a 400) instead of
    # exhausting memory.
    max_image_pixels: int | None = None
    # Ranks (one process each; engine/diffusion/parallel/): the image tokens split between
    # `ulysses_degree x ring_degree` ranks, the two guidance branches between
    # `cfg_parallel_size` groups of them. The stage's world is their product.
    ulysses_degree: int = 1
    ring_degree: int = 1
    cfg_parallel_size: int = 1
    # CPU cores the ranks split evenly (from the stage's placement); default: this
    # process' cores.
    cores: list[int] | None = None
    # Pipeline components not loaded (diffusers' `from_pretrained(name=None)`): the text
    # encoder of a pipeline whose prompts an upstream stage encodes.
    skip_components: list[str] = field(default_factory=list)
    # LoRA adapters served from the start, name -> diffusers / PEFT LoRA file or folder
    # (requests choose one by name; more are loaded at run time).
    lora_modules: dict[str, str] = field(default_factory=dict)
    # The transformer's linear weights in 8 bits: "int8" (any device) or "fp8" (GPUs of
    # compute capability 8.9+); engine/diffusion/quantize.py.
    quantization: str | None = None
    defaults: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from vllm_omni.engine.diffusion.parallel.layout import check_degrees

        check_degrees(self)
        check_quantization(self.quantization, self.device)
        if self.quantization is not None and self.offload is not None:
            raise ValueError("quantization and offload cannot be combined: torchao's "
                             "weights do not move between devices on demand")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {list(POLICIES)}, got "
                             f"{self.scheduling_policy!r}")
        if self.scheduler_cls is not None:
            try:  # here, so a wrong path fails the stage's start naming it
                load_function(self.scheduler_cls)
            except (ImportError, AttributeError, ValueError) as e:
                raise ValueError(f"scheduler_cls {self.scheduler_cls!r} cannot be imported: "
                                 f"{e}") from None
        if self.offload is not None:
            if self.offload not in OFFLOAD_MODES:
                raise ValueError(f"offload must be one of {list(OFFLOAD_MODES)}, "
                                 f"got {self.offload!r}")
            if not self.device.startswith("cuda"):
                raise ValueError(f"offload {self.offload!r} needs a CUDA device; this "
                                 f"engine runs on {self.device}")


def make_scheduler(options: EngineOptions, sizer: BatchSizer | None) -> SchedulerInterface:
    """The built-in scheduler, or the `scheduler_cls` the options name, built with the same
    limits; one that lacks the interface's methods fails the engine's start."""
    cls = load_function(options.scheduler_cls) if options.scheduler_cls else DiffusionScheduler
    scheduler = cls(max_batch_size=options.max_batch_size,
                    max_batch_cost=options.max_batch_cost, max_running=options.max_running,
                    sizer=sizer, policy=options.scheduling_policy)
    if not isinstance(scheduler, SchedulerInterface):
        missing = [m for m in ("add", "abort", "finish", "has_work", "admit", "pick_batch",
                               "denoised", "max_running") if not hasattr(scheduler, m)]
        raise TypeError(f"scheduler_cls {options.scheduler_cls!r} lacks {missing} of the "
                        "diffusion scheduler interface (engine/diffusion/scheduler.py)")
    return scheduler


def to_pixels(floats: np.ndarray) -> np.ndarray:
    """Images in [0, 1] as 8-bit pixels, rounded as diffusers' `numpy_to_pil` does."""
    return (floats * 255).round().astype(np.uint8)


def result_tensors(r: DiffusionRequest) -> dict[str, torch.Tensor]:
    """What a finished request hands back through shared memory: its latents (for the next
    stage), or its images or frames as 8-bit pixels, with their floats where asked."""
    if r.params.output == "latent":
        return {"latents": r.latents}
    if r.video is None and not r.images:
        return {}
    name, floats = ("video", r.video) if r.video is not None else ("images", np.stack(r.images))
    tensors = {name: torch.from_numpy(to_pixels(floats))}
    if r.params.float_output:
        tensors[f"float_{name}"] = torch.from_numpy(np.ascontiguousarray(floats))
    return tensors


@dataclass
class DiffusionOutput(CoreOutput):
    """Progress (`step` of `num_steps`) or the result of one request. A latent-only request's
    latents are in shared memory (`handle`, {"latents": tensor}): they go to the next stage
    without passing through the API process's pipe."""

    step: int = 0
    num_steps: int = 0
    # The finished images, 8-bit (height x width x 3). They leave the core in shared memory
    # (`handle`); the client reads them into these fields.
    images: list[np.ndarray] | None = None
    # A video pipeline's result instead: frames x height x width x 3, 8-bit, and its rate.
    video: np.ndarray | None = None
    fps: int | None = None
    # What they were rounded from (in [0, 1]), for requests with `float_output`.
    float_images: np.ndarray | None = None
    float_video: np.ndarray | None = None
    # Step-cache stats of a finished request: method, computed_steps, cached_steps.
    cache: dict[str, Any] | None = None
    # A parallel stage: seconds rank 0 spent in collectives during the request's steps
    # (shared with the requests batched with it), for benchmarks.
    comm_seconds: float | None = None


class DiffusionCore(CoreBase):
    """Loads the pipeline, picks its adapter, and batches requests step by step."""

    def __init__(self, model: str, options: EngineOptions, conn: Connection) -> None:
        import torch
        from diffusers import DiffusionPipeline
        from diffusers.utils import logging as diffusers_logging

        from vllm_omni.engine.diffusion.adapters import adapter_for
        from vllm_omni.engine.diffusion.parallel.layout import Layout

        super().__init__(conn, options.num_threads)
        diffusers_logging.disable_progress_bar()
        ranks = None
        if Layout.of(options).world > 1:
            from vllm_omni.engine.diffusion.parallel.driver import RankGroup

            # Started first: they load their transformers while this process loads its own.
            ranks = RankGroup(model, options)
        pipe = DiffusionPipeline.from_pretrained(
            model, dtype=getattr(torch, options.dtype),
            **dict.fromkeys(options.skip_components))
        if options.offload == "model":
            pipe.enable_model_cpu_offload(device=options.device)
        elif options.offload == "sequential":
            pipe.enable_sequential_cpu_offload(device=options.device)
        elif options.offload == "group":
            pipe.enable_group_offload(onload_device=torch.device(options.device),
                                      offload_type="leaf_level", use_stream=True)
        else:
            pipe.to(options.device)
        if options.quantization is not None:
            quantize_weights(pipe.transformer, options.quantization, options.device)
        self.adapter = adapter_for(pipe, options.device, ranks)
        for name, path in options.lora_modules.items():
            try:
                self.adapter.load_lora(name, path)
            except ValueError as e:
                raise ValueError(f"LoRA adapter {name!r}: {e}") from None
        self.parallel = ranks is not None
        self.defaults = options.defaults
        area = self.adapter.default_area()
        self.max_image_pixels = options.max_image_pixels or (
            options.max_batch_size * area if area else None)
        if self.defaults.get("cache") is not None:
            # The server-wide cache setting must fit the model: fail at start, not per request.
            self.adapter.check_cache(CacheConfig(**self.defaults["cache"]))
        self.sizer = BatchSizer(options.max_batch_size) if options.adaptive_batch else None
        self.scheduler = make_scheduler(options, self.sizer)
        # Reused segments: a default image or a short video fits, and no hop pays for a new
        # segment's creation and page faults.
        self.connector = SharedMemoryConnector(prefix="omni-dit", pool_bytes=options.pool_mb << 20)
        self.progress_interval = options.progress_interval
        self._last_progress: dict[str, float] = {}
        self._lora_of: dict[str, str] = {}  # request id -> its adapter, while it is here

    def info(self) -> dict[str, Any]:
        return {**self.adapter.info(), "max_image_pixels": self.max_image_pixels,
                "max_running": self.scheduler.max_running,
                "loras": self.adapter.lora_names()}

    def control(self, method: str, args: dict[str, Any]) -> dict[str, Any]:
        """Adapters loaded and unloaded between steps: a request admitted after the call
        may use (or no longer use) the adapter."""
        if method == "load_lora":
            self.adapter.load_lora(args["name"], args["path"])
        elif method == "unload_lora":
            using = [r for r, name in self._lora_of.items() if name == args["name"]]
            if using:
                raise ValueError(f"adapter {args['name']!r} is in use by {len(using)} "
                                 "running requests")
            self.adapter.unload_lora(args["name"])
        else:
            return super().control(method, args)
        return {"loras": self.adapter.lora_names()}

    # -- requests ------------------------------------------------------------------------

    def add(self, msg: AddRequest) -> None:
        prompt, conditioning = msg.prompt, []
        try:
            if isinstance(prompt, dict):  # encoded upstream: read (and so free) its states
                prompt, given_states = prompt["prompt"], prompt["conditioning"]
                conditioning = [self.adapter.conditioning_from_states(
                    self.connector.get(c["states"]), c["length"]) for c in given_states]
            self.adapter.check_inputs(msg.images)
            # The request's, then the stage's settings, then what its input image implies.
            given = DiffusionParams.parse(msg.params).merged(self.defaults).merged(
                self.adapter.input_defaults(msg.images))
            resolved = self.adapter.resolve(given)
            self.adapter.check_lora(resolved)
            self.adapter.check_conditioning(conditioning, resolved)
            if (self.max_image_pixels and resolved.height and resolved.width
                    and resolved.height * resolved.width > self.max_image_pixels):
                raise ValueError(
                    f"size {resolved.width}x{resolved.height} is over this model's limit of "
                    f"{self.max_image_pixels} pixels per image (engine option max_image_pixels)")
            if resolved.seed is None:
                resolved.seed = self.new_seed()
        except ValueError as e:
            self.fail([msg.request_id], e, "invalid")
            return
        except Exception as e:  # a bug fails its request, not the engine
            self.fail([msg.request_id], e, "internal")
            return
        if resolved.lora is not None:
            self._lora_of[msg.request_id] = resolved.lora
        self.scheduler.add(DiffusionRequest(msg.request_id, prompt, resolved,
                                            input_images=msg.images, given=conditioning))

    def drop(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.adapter.release(request_id)
        self._last_progress.pop(request_id, None)
        self._lora_of.pop(request_id, None)

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
                self.fail([r.request_id for r in admitted], e, "internal")
                admitted = []
            for r in admitted:
                try:
                    self.adapter.prepare(r)
                except Exception as e:
                    self.fail([r.request_id], e, "internal")
        batch = self.scheduler.pick_batch()
        if batch:
            start = time.perf_counter()
            comm = COMM.seconds
            try:
                self.adapter.denoise(batch)
            except Exception as e:
                self.fail([r.request_id for r in batch], e, "internal")
            else:
                if self.sizer is not None and self.adapter.step_level:
                    images = sum(r.params.num_images for r in batch)
                    self.sizer.record(batch[0].key, images, time.perf_counter() - start)
                now = time.monotonic()
                for r in batch:
                    if self.parallel:
                        r.extras["comm"] = r.extras.get("comm", 0.0) + COMM.seconds - comm
                    last = self._last_progress.get(r.request_id, r.arrival_time)
                    if not r.denoised and now - last >= self.progress_interval:
                        self._last_progress[r.request_id] = now
                        self.send(DiffusionOutput(r.request_id, step=r.step,
                                                  num_steps=r.num_steps))
        for group in self.scheduler.denoised():
            self.finish(group)

    def finish(self, group: list[DiffusionRequest]) -> None:
        # A group shares a batch key, not the output: requests for latents skip the VAE.
        to_decode = [r for r in group if r.params.output != "latent"]
        try:
            if to_decode:
                self.adapter.decode(to_decode)
        except Exception as e:
            self.fail([r.request_id for r in group], e, "internal")
            return
        for r in group:
            self.drop(r.request_id)
            tensors = result_tensors(r)
            self.send(DiffusionOutput(
                r.request_id, finished=True, seed=r.params.seed, step=r.num_steps,
                num_steps=r.num_steps, cache=r.cache_stats(),
                comm_seconds=r.extras.get("comm"),
                fps=r.params.fps if r.video is not None else None,
                handle=self.connector.put(tensors) if tensors else None,
            ))
