"""Step-level adapters: a diffusers pipeline cut into calls the engine's scheduler drives.

A pipeline's `__call__` runs one request (or one uniform batch) from prompt to image. The
engine needs the pieces apart, so requests can join and leave a running batch between steps:

    encode(requests)   text conditioning for new requests, batched
    prepare(request)   initial noise from the request's own seed, its own timestep schedule
    denoise(requests)  ONE batched transformer call (both guidance branches) + each request's
                       scheduler step
    decode(requests)   VAE decode, batched

Everything numeric that is not the denoising loop itself (prompt encoding, latent packing,
noise, timestep shift, VAE scaling) is the pipeline's own methods, so an image equals what
`pipeline(...)` makes for the same seed.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from typing import Any

import numpy as np
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

from vllm_omni.engine.diffusion.adapters.base import DiffusionAdapter
from vllm_omni.engine.diffusion.cache import CacheConfig, CacheSlot
from vllm_omni.engine.diffusion.executor import LocalTransformer, TransformerExecutor
from vllm_omni.engine.diffusion.lora import LoraSet
from vllm_omni.engine.diffusion.parallel.rank import TransformerSpec
from vllm_omni.engine.diffusion.params import DiffusionParams
from vllm_omni.engine.diffusion.request import DiffusionRequest


class StepAdapter(DiffusionAdapter):
    """Shared machinery; a family subclass says how its pipeline encodes, predicts, decodes.

    Subclasses set `size_multiple` and `transformer_spec`, and implement `encode_texts`,
    `initial_latents`, `transformer_inputs`, `latents_to_image`; `uses_cfg` / `combine`
    when their guidance differs. The transformer runs where the executor the core hands
    in says (this process, or the stage's ranks).
    """
    # How the transformer's arguments split between ranks (engine/diffusion/parallel/).
    transformer_spec = TransformerSpec(batched=(), sequence={}, output_sequence_dim=None)

    @staticmethod
    def supports(pipe: Any) -> bool:
        """False for a variant of the family's pipeline class that this adapter cannot step."""
        return True

    def __init__(self, pipe: Any, device: str | torch.device,
                 executor: TransformerExecutor) -> None:
        super().__init__(pipe)
        self.executor = executor
        # Adapters hook this process's transformer, so a stage split between ranks has none.
        self.loras = None
        if isinstance(executor, LocalTransformer):
            self.loras = LoraSet(pipe, pipe.transformer)
            executor.cache.row_views.append(self.loras.narrowed)
        # Where the models run, from the engine: diffusers says it only through a private
        # property, and the public `pipe.device` is the weights' resting place, the CPU, when
        # they are offloaded.
        self.device = torch.device(device)
        self.dtype = pipe.transformer.dtype
        call = inspect.signature(type(pipe).__call__).parameters
        height, width = self.default_size(call)
        # The pipeline's own defaults, read from its signature, so they cannot drift.
        self.defaults: dict[str, Any] = {
            "height": height,
            "width": width,
            "num_inference_steps": call["num_inference_steps"].default,
            "guidance_scale": call["guidance_scale"].default,
            "true_cfg_scale": call["true_cfg_scale"].default if "true_cfg_scale" in call else 1.0,
            "seed": None,
        }
        self.max_sequence_length = call["max_sequence_length"].default

    # -- per family --------------------------------------------------------------------

    size_multiple: int = 16
    makes_video = False

    def default_size(self, call: dict[str, inspect.Parameter]) -> tuple[int, int]:
        """(height, width) when a request gives none: the size the model was trained at,
        where its VAE records it (real Flux / SD3 VAEs say 1024, the pipelines' default too);
        else the pipeline's default."""
        size = getattr(self.pipe.vae.config, "sample_size", None)
        if not isinstance(size, int):
            size = self.pipe.default_sample_size * self.pipe.vae_scale_factor
        return size, size

    def encode_texts(self, texts: list[str]) -> list[dict[str, torch.Tensor]]:
        """Conditioning for each text, each tensor with a batch dim of 1."""
        raise NotImplementedError

    def initial_latents(self, req: DiffusionRequest, generator: torch.Generator) -> torch.Tensor:
        raise NotImplementedError

    def transformer_inputs(
        self, latents: torch.Tensor, t: torch.Tensor, conds: list[dict], reqs: list, rows: list
    ) -> dict[str, Any]:
        """The transformer's keyword arguments for a batch of rows (one row per image)."""
        raise NotImplementedError

    def latents_to_image(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def modulated_input(block, hidden: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """The first block's timestep-modulated input (TeaCache's signal)."""
        norm = block.norm1 if hasattr(block, "norm1") else block.norm
        return norm(hidden, emb=temb)[0]

    def shift_mu(self, req: DiffusionRequest) -> float | None:
        """The resolution-dependent timestep shift (None where the scheduler has none)."""
        cfg = self.pipe.scheduler.config
        if not cfg.get("use_dynamic_shifting", False):
            return None
        return calculate_shift(
            self.image_seq_len(req.params.height, req.params.width),
            cfg.get("base_image_seq_len", 256),
            cfg.get("max_image_seq_len", 4096),
            cfg.get("base_shift", 0.5),
            cfg.get("max_shift", 1.15),
        )

    def sigmas(self, steps: int) -> np.ndarray | None:
        return np.linspace(1.0, 1 / steps, steps)

    def image_seq_len(self, height: int, width: int) -> int:
        f = self.pipe.vae_scale_factor * 2
        return (height // f) * (width // f)

    def uses_cfg(self, p: DiffusionParams) -> bool:
        return p.true_cfg_scale > 1 and p.negative_prompt is not None

    def combine(self, pos: torch.Tensor, neg: torch.Tensor, reqs: list, rows: list) -> torch.Tensor:
        scale = self._per_row([r.params.true_cfg_scale for r in reqs], rows, pos)
        return neg + scale * (pos - neg)

    # -- shared ------------------------------------------------------------------------

    def resolve(self, params: DiffusionParams) -> DiffusionParams:
        """Fill the model's defaults and check what only the model can check (ValueError)."""
        given = params.true_cfg_scale
        if given is not None and given > 1 and not params.negative_prompt:
            raise ValueError("true_cfg_scale > 1 needs a negative_prompt")
        if not self.makes_video:
            video_only = sorted(f for f in ("num_frames", "fps") if getattr(params, f) is not None)
            if video_only:
                raise ValueError(f"{type(self.pipe).__name__} makes images, not videos: "
                                 f"{video_only} do not apply")
        p = params.merged({k: v for k, v in self.defaults.items() if v is not None})
        if p.cache is not None:
            self.check_cache(p.cache)
        for name in ("height", "width"):
            value = getattr(p, name)
            if value % self.size_multiple:
                raise ValueError(
                    f"{name} must be a multiple of {self.size_multiple} for this model, got {value}"
                )
        tokens = self.image_seq_len(p.height, p.width)
        if tokens % self.executor.sequence_parallel:
            raise ValueError(
                f"{p.width}x{p.height} makes {tokens} image tokens, which this stage's "
                f"{self.executor.sequence_parallel} sequence-parallel ranks cannot split evenly"
            )
        return p

    def default_area(self) -> int:
        """Pixels of one image at the model's default size."""
        return self.defaults["height"] * self.defaults["width"]

    def check_cache(self, config: CacheConfig) -> None:
        self.executor.cache.check(config, self.name)

    def load_lora(self, name: str, path: str) -> None:
        if self.loras is None:
            raise ValueError(f"{self.name} runs over several ranks here: LoRA adapters are "
                             "served on single-rank stages only")
        self.loras.load(name, path)

    def unload_lora(self, name: str) -> None:
        if self.loras is None:
            return super().unload_lora(name)
        self.loras.unload(name)

    def lora_names(self) -> list[str]:
        return sorted(self.loras.adapters) if self.loras is not None else []

    def check_lora(self, params: DiffusionParams) -> None:
        if self.loras is None:
            return super().check_lora(params)
        self.loras.check(params.lora)

    def check_conditioning(self, given: list[dict], params: DiffusionParams) -> None:
        """A request's upstream conditioning fits it; without one, the text encoder is here."""
        if not given:
            if getattr(self.pipe, "text_encoder", True) is None:
                raise ValueError(
                    f"{type(self.pipe).__name__} was loaded without its text encoder "
                    "(engine option skip_components): prompts must come encoded from an "
                    "upstream stage")
            return
        wanted = 2 if self.uses_cfg(params) else 1
        if len(given) < wanted:
            raise ValueError("true CFG needs the negative prompt encoded upstream too")

    def encode(self, reqs: list[DiffusionRequest]) -> None:
        todo = [r for r in reqs if not r.given]
        texts = sorted({t for r in todo for t in (r.prompt, r.params.negative_prompt) if t})
        if todo and self.needs_empty_negative(todo):
            texts = sorted(set(texts) | {""})
        encoded = dict(zip(texts, self.encode_texts(texts), strict=True)) if texts else {}
        for r in reqs:
            if r.given:
                r.cond = r.given[0]
                if self.uses_cfg(r.params):
                    r.uncond = r.given[1]
                continue
            r.cond = encoded[r.prompt]
            if self.uses_cfg(r.params):
                r.uncond = encoded[r.params.negative_prompt or ""]

    def needs_empty_negative(self, reqs: list[DiffusionRequest]) -> bool:
        return False

    def prepare(self, req: DiffusionRequest) -> None:
        p = req.params
        generator = torch.Generator(device="cpu").manual_seed(p.seed)
        req.latents = self.initial_latents(req, generator)
        req.scheduler = copy.deepcopy(self.pipe.scheduler)
        kwargs = {}
        mu = self.shift_mu(req)
        if mu is not None:
            kwargs["mu"] = mu
        req.timesteps, _ = retrieve_timesteps(
            req.scheduler,
            p.num_inference_steps,
            self.device,
            sigmas=self.sigmas(p.num_inference_steps),
            **kwargs,
        )
        req.scheduler.set_begin_index(0)
        if p.cache is not None and p.cache.enabled:
            branches = 2 if self.uses_cfg(p) else 1
            req.cache_slots = [CacheSlot(p.cache, (req.request_id, i))
                               for i in range(branches * p.num_images)]
        req.key = self.batch_key(req)
        req.cost = self.image_seq_len(p.height, p.width) * p.num_images

    def batch_key(self, req: DiffusionRequest) -> tuple:
        p = req.params
        return (p.height, p.width, self.uses_cfg(p))

    def denoise(self, reqs: list[DiffusionRequest]) -> None:
        """One denoising step for every request in `reqs` (all with the same batch key)."""
        rows = [r.params.num_images for r in reqs]
        latents = torch.cat([r.latents for r in reqs])
        t = torch.cat([r.timesteps[r.step].expand(n) for r, n in zip(reqs, rows, strict=True)])
        t = t.to(latents.dtype)
        cfg = self.uses_cfg(reqs[0].params)
        adapters = [(r.params.lora, r.params.lora_scale) for r, n in zip(reqs, rows, strict=True)
                    for _ in range(n)]
        with self._loras(adapters + adapters if cfg else adapters, latents):
            pred = self._predict(reqs, rows, latents, t, cfg)
        for r, noise in zip(reqs, pred.split(rows), strict=True):
            t_r = r.timesteps[r.step]
            r.latents = r.scheduler.step(noise, t_r, r.latents, return_dict=False)[0]
            r.step += 1

    def _loras(self, adapters: list[tuple[str | None, float]], like: torch.Tensor):
        if self.loras is None or all(name is None for name, _ in adapters):
            return contextlib.nullcontext()
        return self.loras.applied(adapters, like)

    def _predict(self, reqs: list[DiffusionRequest], rows: list[int], latents: torch.Tensor,
                 t: torch.Tensor, cfg: bool) -> torch.Tensor:
        """The guided noise prediction for the batch: one transformer call."""
        conds = [r.cond for r in reqs]
        slots = self._cache_slots(reqs, rows, branch=0)
        if cfg:
            # Both guidance branches in one call: rows are independent in the transformer.
            slots += self._cache_slots(reqs, rows, branch=1)
            inputs = self.transformer_inputs(
                torch.cat([latents, latents]),
                torch.cat([t, t]),
                conds + [r.uncond for r in reqs],
                reqs + reqs,
                rows + rows,
            )
            pred = self.run_transformer(inputs, slots, torch.cat([t, t]).tolist(), cfg=True)
            pos, neg = pred.chunk(2)
            pred = self.combine(pos, neg, reqs, rows)
        else:
            inputs = self.transformer_inputs(latents, t, conds, reqs, rows)
            pred = self.run_transformer(inputs, slots, t.tolist(), cfg=False)
        return pred

    def run_transformer(self, inputs: dict[str, Any], slots: list, timesteps: list[float],
                        cfg: bool) -> torch.Tensor:
        """The transformer's output for `inputs`, here or over the stage's ranks."""
        return self.executor(inputs, slots, timesteps, cfg)

    def release(self, request_id: str) -> None:
        self.executor.release(request_id)

    def decode(self, reqs: list[DiffusionRequest]) -> None:
        """VAE-decode finished requests (same size) into float HWC images in [0, 1]."""
        p = reqs[0].params
        image = self.latents_to_image(torch.cat([r.latents for r in reqs]), p.height, p.width)
        images = self.pipe.image_processor.postprocess(image, output_type="np")
        start = 0
        for r in reqs:
            r.images = list(images[start : start + r.params.num_images])
            start += r.params.num_images

    # -- helpers for subclasses --------------------------------------------------------

    @staticmethod
    def _per_row(values: list[float], rows: list[int], like: torch.Tensor) -> torch.Tensor:
        """A per-request scalar repeated for each of its rows, shaped to broadcast."""
        v = torch.tensor(values, dtype=like.dtype, device=like.device).repeat_interleave(
            torch.tensor(rows, device=like.device)
        )
        return v.view(-1, *([1] * (like.dim() - 1)))

    @staticmethod
    def _cache_slots(reqs: list[DiffusionRequest], rows: list[int], branch: int) -> list:
        """Each row's cache slot (None where its request does not cache), in batch order."""
        out = []
        for r, n in zip(reqs, rows, strict=True):
            out += r.cache_slots[branch * n : (branch + 1) * n] or [None] * n
        return out

    @staticmethod
    def _rows(conds: list[dict], name: str, rows: list[int]) -> torch.Tensor:
        """Stack one conditioning tensor for every row (a request's images share a prompt)."""
        pairs = zip(conds, rows, strict=True)
        return torch.cat([c[name].expand(n, *c[name].shape[1:]) for c, n in pairs])
