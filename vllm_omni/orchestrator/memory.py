"""The memory plan: what each stage holds, computed from its model before any engine starts.

vLLM sizes its KV cache as a fraction of the whole device (on CPU, 92% of the NUMA node,
refusing to start when that much is not free). A pipeline runs several engines side by
side, so each stage instead gets a budget from what it needs: its weights, a KV cache for
`max_num_seqs` sequences of `max_model_len` tokens (AR stages), its activations and its
process' own overhead. Where a device cannot hold every stage's wish, the KV caches share
what is free (after a headroom), each keeping at least one full-length sequence. What the
user sets (VLLM_CPU_KVCACHE_SPACE, kv_cache_memory_bytes, gpu_memory_utilization,
placement.memory_gib) wins. A plan that cannot fit fails with every problem named.

The plan is handed to the engines as settings: `kv_cache_memory_bytes` for AR stages (and
`gpu_memory_utilization` on GPUs, so stages sharing a device ask for fractions that add up).
Figures other than weights and KV are estimates; the plan shows them so they can be checked.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import struct
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_omni.config.placement import GIB, PlacementError, device_problems, stage_device
from vllm_omni.config.schema import PipelineConfig, StageConfig
from vllm_omni.errors import StageStartError

logger = logging.getLogger(__name__)

MIB = 1 << 20
HEADROOM = 0.10  # of what is free at start-up, left to everything else on the device
# The engine processes' own memory (libraries, allocator pools, a CUDA context). On CPU
# measured here: a vLLM engine core and its worker ~1.5 GiB, a diffusers core ~0.6 GiB.
RUNTIME = {("ar", "cpu"): 1.5 * GIB, ("ar", "cuda"): 1.0 * GIB,
           ("other", "cpu"): 0.6 * GIB, ("other", "cuda"): 0.75 * GIB}
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2,
                "BF16": 2, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_TORCH_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


@dataclasses.dataclass
class StagePlan:
    """One stage's memory on its device, in bytes. `source` says who set the budget."""

    stage: str
    engine: str
    device: str
    weights: int
    kv_cache: int
    activations: int
    runtime: int
    source: str = "planned"
    # Settings handed to the engine (vLLM engine args for AR stages).
    engine_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    # AR stages: the KV cache the stage would like and the least it can run with.
    kv_wanted: int = 0
    kv_floor: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations + self.runtime


@dataclasses.dataclass
class DeviceMemory:
    device: str
    total: int
    free: int

    @property
    def usable(self) -> int:
        return int(self.free * (1 - HEADROOM))


@dataclasses.dataclass
class MemoryPlan:
    stages: list[StagePlan]
    devices: dict[str, DeviceMemory]

    def stage(self, name: str) -> StagePlan:
        return next(s for s in self.stages if s.stage == name)

    def as_dict(self) -> dict[str, Any]:
        return {
            "headroom": HEADROOM,
            "devices": [{**dataclasses.asdict(d), "usable": d.usable,
                         "planned": sum(s.total for s in self.stages if s.device == d.device)}
                        for d in self.devices.values()],
            "stages": [{"stage": s.stage, "engine": s.engine, "device": s.device,
                        "weights": s.weights, "kv_cache": s.kv_cache,
                        "activations": s.activations, "runtime": s.runtime, "total": s.total,
                        "source": s.source} for s in self.stages],
        }

    def table(self) -> str:
        """The plan as a text table (GiB), one row per stage and one per device."""
        rows = [("stage", "device", "weights", "kv cache", "activations", "runtime", "total",
                 "set by")]
        for s in self.stages:
            rows.append((s.stage, s.device, *(_gib(v) for v in (
                s.weights, s.kv_cache, s.activations, s.runtime, s.total)), s.source))
        for d in self.devices.values():
            planned = sum(s.total for s in self.stages if s.device == d.device)
            rows.append((f"[{d.device}]", f"{_gib(d.free)} free", "", "", "", "",
                         _gib(planned), f"of {_gib(d.usable)} usable"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                         for r in rows)


def _gib(value: int) -> str:
    return f"{value / GIB:.3f}"


# -- weights ------------------------------------------------------------------------------


def _safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def weights_bytes(model: str, prefix: str | None = None, itemsize: int | None = None) -> int:
    """Bytes the weights under a model folder take in memory: safetensors tensors (only those
    whose names start with `prefix`, when given), floating ones at `itemsize` bytes per value
    when given; other weight files by their size. 0 for a name that is not a local folder."""
    folder = Path(model)
    if not folder.is_dir():
        return 0
    total = 0
    for f in sorted(folder.rglob("*")):
        if f.suffix == ".safetensors":
            for name, info in _safetensors_header(f).items():
                if name == "__metadata__" or (prefix and not name.startswith(prefix)):
                    continue
                count = 1
                for dim in info["shape"]:
                    count *= dim
                size = _DTYPE_BYTES.get(info["dtype"], 1)
                floating = info["dtype"].startswith(("F", "BF"))
                total += count * (itemsize if itemsize and floating else size)
        elif f.suffix in {".bin", ".pt", ".pth"} and f.name != "spk_dict.pt" and not prefix:
            total += f.stat().st_size
    return total


# -- what each stage kind needs -------------------------------------------------------------


def plan_ar_stage(stage: StageConfig, engine_args: Any, device: str,
                  usage_context: Any) -> StagePlan:
    """An AR stage's needs, read from the vLLM config its engine args give."""
    config = dataclasses.replace(engine_args).create_engine_config(usage_context)
    model, sched = config.model_config, config.scheduler_config
    itemsize = model.dtype.itemsize
    cache_dtype = config.cache_config.cache_dtype
    kv_item = itemsize if cache_dtype == "auto" else (1 if "fp8" in cache_dtype else 2)
    parallel = config.parallel_config
    per_token = (2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel)
                 * model.get_head_size() * kv_item)
    hidden = model.get_hidden_size()
    intermediate = getattr(model.hf_text_config, "intermediate_size", None) or 4 * hidden
    activations = (sched.max_num_batched_tokens * (4 * hidden + 2 * intermediate) * itemsize
                   + 2 * sched.max_num_seqs * model.get_vocab_size() * 4)
    return StagePlan(
        stage=stage.name, engine="ar", device=device,
        weights=weights_bytes(model.model, stage.weights_prefix, itemsize),
        kv_cache=0, activations=activations, runtime=int(RUNTIME[("ar", device[:4])]),
        kv_wanted=per_token * model.max_model_len * sched.max_num_seqs,
        kv_floor=per_token * model.max_model_len,
    )


def _read_config(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def plan_diffusion_stage(stage: StageConfig, folder: str, options: Any, device: str) -> StagePlan:
    """A diffusers pipeline: its weights at the engine's dtype, and the activations of a
    full batch at the model's default resolution. An estimate: the larger of the
    transformer's (16 hidden-sized tensors per token, both guidance branches) and the VAE
    decoder's (3 tensors of its first block's channels per pixel)."""
    itemsize = _TORCH_BYTES.get(options.dtype, 4)
    root = Path(folder)
    dit = _read_config(root / "transformer" / "config.json") or _read_config(
        root / "unet" / "config.json")
    vae = _read_config(root / "vae" / "config.json")
    inner = (dit.get("num_attention_heads", 0) * dit.get("attention_head_dim", 0)
             or dit.get("hidden_size") or dit.get("inner_dim") or 1024)
    if "temperal_downsample" in vae:  # Qwen-Image's and Wan's VAEs
        scale, channels = 2 ** len(vae["temperal_downsample"]), vae.get("base_dim", 96)
    else:
        channels = (vae.get("block_out_channels") or [128])[0]
        scale = 2 ** (len(vae.get("block_out_channels", [0] * 4)) - 1)
    latent_side = dit.get("sample_size") if isinstance(dit.get("sample_size"), int) else 128
    side = vae.get("sample_size") or latent_side * scale
    side = side[0] if isinstance(side, list) else side
    patch = dit.get("patch_size") or 2
    patch = max(patch[-1] if isinstance(patch, list) else patch, 2)  # Flux packs 2 x 2
    tokens = (side // scale // patch) ** 2
    per_image = max(2 * tokens * inner * itemsize * 16, side * side * channels * 3 * itemsize)
    weights = weights_bytes(folder, None, itemsize)
    if options.offload:  # the device holds one model, or one block, at a time
        weights = max((weights_bytes(str(p), None, itemsize) for p in root.iterdir()
                       if p.is_dir()), default=weights)
    return StagePlan(
        stage=stage.name, engine=stage.engine, device=device, weights=weights, kv_cache=0,
        activations=per_image * options.max_batch_size,
        runtime=int(RUNTIME[("other", device[:4])]),
    )


def plan_code2wav_stage(stage: StageConfig, folder: str, options: Any, device: str) -> StagePlan:
    """Token2wav: its weights (fp32, as HF runs it) and a batch of mel frames through the DiT
    and the vocoder (an estimate: 64 KiB per frame)."""
    prefix = stage.weights_prefix or "token2wav."
    return StagePlan(
        stage=stage.name, engine=stage.engine, device=device,
        weights=weights_bytes(folder, prefix, _TORCH_BYTES.get(options.dtype, 4)),
        kv_cache=0, activations=options.max_batch_frames * 64 * 1024,
        runtime=int(RUNTIME[("other", device[:4])]),
    )


# -- the plan --------------------------------------------------------------------------------


def device_memory(device: str) -> DeviceMemory:
    """What a device has now. On CPU the lower of the machine's available memory and the
    NUMA node's, which is what vLLM's CPU worker checks its KV cache against."""
    if device == "cpu":
        import psutil

        vm = psutil.virtual_memory()
        total, free = vm.total, vm.available
        try:
            from vllm.utils.cpu_resource_utils import get_memory_node_info

            node = get_memory_node_info(0)
            total, free = min(total, node.total_memory), min(free, node.available_memory)
        except (ImportError, OSError, KeyError):
            pass
        return DeviceMemory(device, total, free)
    import torch

    free, total = torch.cuda.mem_get_info(int(device.split(":")[1]))
    return DeviceMemory(device, total, free)


def _user_budget(stage: StageConfig, plan: StagePlan, given: dict[str, Any],
                 device: DeviceMemory, problems: list[str]) -> bool:
    """Apply what the user set for this stage; True when its KV cache is settled."""
    name = repr(stage.name)
    memory = stage.placement.memory_gib if stage.placement else None
    env_kv = os.environ.get("VLLM_CPU_KVCACHE_SPACE") if plan.device == "cpu" else None
    if stage.engine != "ar":
        if memory is not None:
            plan.source = "placement.memory_gib"
            plan.activations = max(int(memory * GIB) - plan.weights, 0)
            if plan.weights >= memory * GIB:
                problems.append(f"stage {name}: its weights take {_gib(plan.weights)} GiB, "
                                f"not less than its memory_gib {memory}")
        return True
    if memory is not None:
        if env_kv:
            problems.append(f"stage {name}: VLLM_CPU_KVCACHE_SPACE is set, and vLLM lets it "
                            "override the stage's memory_gib; unset it")
        plan.source = "placement.memory_gib"
        plan.kv_cache = int(memory * GIB) - plan.weights - plan.activations
        if plan.weights >= memory * GIB:
            problems.append(f"stage {name}: its weights take {_gib(plan.weights)} GiB, "
                            f"not less than its memory_gib {memory}")
        elif plan.kv_cache < plan.kv_floor:
            problems.append(
                f"stage {name}: memory_gib {memory} leaves {_gib(max(plan.kv_cache, 0))} GiB "
                f"for the KV cache after weights and activations; one sequence of "
                f"max_model_len needs {_gib(plan.kv_floor)} GiB")
        plan.kv_cache = max(plan.kv_cache, 0)
        return True
    if env_kv:
        plan.source = "VLLM_CPU_KVCACHE_SPACE"
        plan.kv_cache = int(env_kv) * GIB
        return True
    if given.get("kv_cache_memory_bytes") is not None:
        plan.source = "kv_cache_memory_bytes"
        plan.kv_cache = int(given["kv_cache_memory_bytes"])
        return True
    if given.get("gpu_memory_utilization") is not None:
        plan.source = "gpu_memory_utilization"
        share = int(float(given["gpu_memory_utilization"]) * device.total)
        plan.kv_cache = max(share - plan.weights - plan.activations - plan.runtime, 0)
        return True
    return False


def _share_kv(plans: list[StagePlan], spare: int) -> None:
    """Give planned KV caches their wish, or split `spare` bytes above their floors in
    proportion to what each wishes beyond its floor."""
    wished = sum(p.kv_wanted for p in plans)
    if wished <= spare:
        for p in plans:
            p.kv_cache = p.kv_wanted
        return
    above = spare - sum(p.kv_floor for p in plans)
    extra = sum(p.kv_wanted - p.kv_floor for p in plans) or 1
    for p in plans:
        p.kv_cache = p.kv_floor + max(above, 0) * (p.kv_wanted - p.kv_floor) // extra


def plan_pipeline(
    pipeline: PipelineConfig,
    model: str,
    engine_kwargs: dict[str, Any],
    usage_context: Any,
    cache_config: dict[str, Any] | None = None,
    ar_device_type: str | None = None,
) -> MemoryPlan:
    """The memory plan of a pipeline served for `model` with the caller's engine args (CLI
    flags, OmniLLM kwargs). Starts nothing. Raises PlacementError naming every problem of
    devices and memory, or StageStartError naming every stage whose config is unusable."""
    from vllm.platforms import current_platform

    from vllm_omni.engine.ar.stage import stage_engine_args
    from vllm_omni.engine.code2wav.stage import code2wav_options
    from vllm_omni.engine.diffusion.stage import engine_options

    def need(stage: StageConfig, device: str) -> StagePlan:
        folder = stage.model or model
        if stage.engine == "diffusion":
            options = engine_options(stage, engine_kwargs, cache_config)
            return plan_diffusion_stage(stage, folder, options, device)
        if stage.engine == "code2wav":
            return plan_code2wav_stage(stage, folder, code2wav_options(stage), device)
        args = stage_engine_args(model, stage, engine_kwargs)
        return plan_ar_stage(stage, args, device, usage_context)

    def given(stage: StageConfig) -> dict[str, Any]:
        return {**stage.engine_args, **engine_kwargs} if stage.engine == "ar" else {}

    return plan_memory(pipeline, ar_device_type or current_platform.device_type, need, given)


def plan_memory(
    pipeline: PipelineConfig,
    ar_device_type: str,
    need: Callable[[StageConfig, str], StagePlan],
    given_args: Callable[[StageConfig], dict[str, Any]],
) -> MemoryPlan:
    """The plan from each stage's needs: `need(stage, device)` (see the plan_*_stage
    functions) and `given_args(stage)`, the engine args the user set for it."""
    problems = device_problems(pipeline, ar_device_type)
    if problems:
        raise PlacementError("the pipeline's placement cannot be honoured:\n  "
                             + "\n  ".join(problems))
    plans: list[StagePlan] = []
    open_kv: dict[str, list[StagePlan]] = defaultdict(list)
    devices: dict[str, DeviceMemory] = {}
    unreadable: dict[str, BaseException] = {}
    for stage in pipeline.stages:
        device = stage_device(stage, ar_device_type)
        if device not in devices:
            devices[device] = device_memory(device)
        try:
            plan = need(stage, device)
        except Exception as e:  # its engine args cannot make a config: it cannot start
            unreadable[stage.name] = e
            continue
        plans.append(plan)
        if not _user_budget(stage, plan, given_args(stage), devices[device], problems):
            open_kv[device].append(plan)
    if unreadable:
        raise StageStartError(unreadable) from next(iter(unreadable.values()))
    for device, memory in devices.items():
        on_device = [p for p in plans if p.device == device]
        fixed = sum(p.total for p in on_device)  # planned KV caches are still 0 here
        spare = memory.usable - fixed
        floors = sum(p.kv_floor for p in open_kv[device])
        if fixed + floors > memory.usable:
            least = {p.stage: p.total + (p.kv_floor if p in open_kv[device] else 0)
                     for p in on_device}
            parts = ", ".join(f"{name} {_gib(v)}" for name, v in least.items())
            problems.append(
                f"{device}: stages need at least {_gib(fixed + floors)} GiB together ({parts}; "
                f"weights, activations, runtime and at least one max_model_len sequence of KV "
                f"cache each); it has {_gib(memory.free)} GiB free, {_gib(memory.usable)} GiB "
                f"usable after {HEADROOM:.0%} headroom")
        else:
            _share_kv(open_kv[device], spare)
    if problems:
        raise PlacementError("the pipeline's memory plan cannot fit:\n  " + "\n  ".join(problems))
    for p in plans:
        if p.engine != "ar":
            continue
        if p.source in ("planned", "placement.memory_gib"):
            p.engine_args["kv_cache_memory_bytes"] = p.kv_cache
        if p.device != "cpu" and p.source != "gpu_memory_utilization":
            # vLLM checks that this fraction of the device is free at start: stages sharing
            # a device ask for fractions that add up.
            p.engine_args["gpu_memory_utilization"] = min(p.total / devices[p.device].total, 1.0)
    return MemoryPlan(plans, devices)
