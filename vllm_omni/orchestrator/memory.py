"""The memory plan: what each stage holds, computed from its model before any engine starts.

vLLM sizes its KV cache as a fraction of the whole device (on CPU, 92% of the NUMA node,
refusing to start when that much is not free). A pipeline runs several engines side by
side, so each stage instead gets a budget from what it needs: its weights, a KV cache for
`max_num_seqs` sequences of `max_model_len` tokens (AR stages), its activations and its
process' own overhead. Where a device cannot hold every stage's wish, the KV caches share
what is free (after a headroom), each keeping at least one full-length sequence. What the
user sets (VLLM_CPU_KVCACHE_SPACE, kv_cache_memory_bytes, gpu_memory_utilization,
placement.memory_gib) wins. A plan that cannot fit fails with every problem named.

Each stage's kind turns its budget into its engine's settings (`apply_budget`): for AR
stages `kv_cache_memory_bytes` (and `gpu_memory_utilization` on GPUs, so stages sharing a
device ask for fractions that add up).
Figures other than weights and KV are estimates; the plan shows them so they can be checked.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from vllm_omni.config.kinds import Capability, stage_kind
from vllm_omni.config.loader import BUILTIN_DIR
from vllm_omni.config.placement import GIB, PlacementError, device_problems, stage_device
from vllm_omni.config.schema import PipelineConfig, StageConfig
from vllm_omni.engine.memory import StagePlan
from vllm_omni.engine.stage import StartContext
from vllm_omni.errors import StageStartError

logger = logging.getLogger(__name__)

HEADROOM = 0.10  # of what is free at start-up, left to everything else on the device


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

    def planned(self, device: str) -> int:
        """Bytes the stages hold on one device."""
        return int(sum(s.total * s.share(device) for s in self.stages))

    def as_dict(self) -> dict[str, Any]:
        return {
            "headroom": HEADROOM,
            "devices": [{**dataclasses.asdict(d), "usable": d.usable,
                         "planned": self.planned(d.device)}
                        for d in self.devices.values()],
            "stages": [{"stage": s.stage, "engine": s.engine, "device": s.device,
                        "ranks": s.ranks, "devices": s.devices,
                        "weights": s.weights, "kv_cache": s.kv_cache,
                        "activations": s.activations, "runtime": s.runtime, "total": s.total,
                        "source": s.source} for s in self.stages],
        }

    def table(self) -> str:
        """The plan as a text table (GiB), one row per stage and one per device."""
        rows = [("stage", "device", "weights", "kv cache", "activations", "runtime", "total",
                 "set by")]
        for s in self.stages:
            where = s.device if s.ranks == 1 else f"{s.device} x{s.ranks}"
            rows.append((s.stage, where, *(_gib(v) for v in (
                s.weights, s.kv_cache, s.activations, s.runtime, s.total)), s.source))
        for d in self.devices.values():
            planned = self.planned(d.device)
            rows.append((f"[{d.device}]", f"{_gib(d.free)} free", "", "", "", "",
                         _gib(planned), f"of {_gib(d.usable)} usable"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                         for r in rows)


def _gib(value: int) -> str:
    return f"{value / GIB:.3f}"


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
    if Capability.KV_CACHE not in stage_kind(stage.engine).capabilities:
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
        plan.kv_cache = int(env_kv) * GIB * plan.ranks  # vLLM's KV settings are per rank
        return True
    if given.get("kv_cache_memory_bytes") is not None:
        plan.source = "kv_cache_memory_bytes"
        plan.kv_cache = int(given["kv_cache_memory_bytes"]) * plan.ranks
        return True
    if given.get("gpu_memory_utilization") is not None:
        plan.source = "gpu_memory_utilization"
        share = int(float(given["gpu_memory_utilization"]) * device.total
                    * len(set(plan.devices)))
        plan.kv_cache = max(share - plan.weights - plan.activations - plan.runtime, 0)
        return True
    return False


def _share_kv(plans: list[tuple[StagePlan, float]], spare: int) -> dict[int, int]:
    """KV bytes on one device for each (plan, fraction of it on the device): their wish, or
    `spare` bytes above their floors split in proportion to what each wishes beyond it."""
    wished = sum(p.kv_wanted * f for p, f in plans)
    if wished <= spare:
        return {id(p): int(p.kv_wanted * f) for p, f in plans}
    above = spare - sum(p.kv_floor * f for p, f in plans)
    extra = sum((p.kv_wanted - p.kv_floor) * f for p, f in plans) or 1
    return {id(p): int((p.kv_floor + max(above, 0) * (p.kv_wanted - p.kv_floor) / extra) * f)
            for p, f in plans}


def plan_pipeline(
    pipeline: PipelineConfig,
    model: str,
    engine_kwargs: dict[str, Any],
    usage_context: Any,
    cache_config: dict[str, Any] | None = None,
    ar_device_type: str | None = None,
    diffusion_parallel: dict[str, int] | None = None,
) -> MemoryPlan:
    """The memory plan of a pipeline served for `model` with the caller's engine args (CLI
    flags, OmniLLM kwargs). Starts nothing. Raises PlacementError naming every problem of
    devices and memory, or StageStartError naming every stage whose config is unusable."""
    from vllm.platforms import current_platform

    context = StartContext(model, engine_kwargs, usage_context, cache_config,
                           diffusion_parallel=diffusion_parallel)

    def need(stage: StageConfig, device: str) -> StagePlan:
        return stage_kind(stage.engine).memory_needs(stage, context, device)

    def given(stage: StageConfig) -> dict[str, Any]:
        if Capability.KV_CACHE not in stage_kind(stage.engine).capabilities:
            return {}
        return {**stage.engine_args, **engine_kwargs}

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
    open_kv: dict[str, list[tuple[StagePlan, float]]] = defaultdict(list)
    devices: dict[str, DeviceMemory] = {}
    unreadable: dict[str, BaseException] = {}
    start_problems: list[str] = []
    for stage in pipeline.stages:
        device = stage_device(stage, ar_device_type)
        try:
            plan = need(stage, device)
        except Exception as e:  # its engine args cannot make a config: it cannot start
            unreadable[stage.name] = e
            continue
        plans.append(plan)
        if plan.problems:  # e.g. ranks on devices this machine lacks
            start_problems += plan.problems
            continue
        for d in plan.devices:
            if d not in devices:
                devices[d] = device_memory(d)
        if not _user_budget(stage, plan, given_args(stage), devices[device], problems):
            for d in dict.fromkeys(plan.devices):
                open_kv[d].append((plan, plan.share(d)))
    if unreadable:
        raise StageStartError(unreadable) from next(iter(unreadable.values()))
    for engine in dict.fromkeys(p.engine for p in plans):
        start_problems += stage_kind(engine).joint_problems(
            [p for p in plans if p.engine == engine])
    if start_problems:
        if pipeline.fallback:  # the same model in fewer stages, which may run here
            start_problems.append(
                f"pipeline {pipeline.name!r} also runs as pipeline {pipeline.fallback!r}: "
                f"--stage-configs-path {BUILTIN_DIR / (pipeline.fallback + '.yaml')}")
        raise PlacementError("the pipeline's stages cannot start here:\n  "
                             + "\n  ".join(start_problems))
    kv_on: dict[int, list[float]] = defaultdict(list)  # per open plan: KV bytes per its share
    for device, memory in devices.items():
        on_device = [(p, p.share(device)) for p in plans if p.share(device)]
        fixed = int(sum(p.total * f for p, f in on_device))  # planned KV caches are still 0
        spare = memory.usable - fixed
        opened = open_kv[device]
        floors = int(sum(p.kv_floor * f for p, f in opened))
        if fixed + floors > memory.usable:
            open_ids = {id(p) for p, _ in opened}
            least = {p.stage: (p.total + (p.kv_floor if id(p) in open_ids else 0)) * f
                     for p, f in on_device}
            parts = ", ".join(f"{name} {_gib(int(v))}" for name, v in least.items())
            problems.append(
                f"{device}: stages need at least {_gib(fixed + floors)} GiB together ({parts}; "
                f"weights, activations, runtime and at least one max_model_len sequence of KV "
                f"cache each); it has {_gib(memory.free)} GiB free, {_gib(memory.usable)} GiB "
                f"usable after {HEADROOM:.0%} headroom")
        else:
            shared = _share_kv(opened, spare)
            for p, f in opened:
                kv_on[id(p)].append(shared[id(p)] / f)
    if problems:
        raise PlacementError("the pipeline's memory plan cannot fit:\n  " + "\n  ".join(problems))
    for p in plans:
        if id(p) in kv_on:  # a stage over several devices gets what its tightest one allows
            p.kv_cache = int(min(kv_on[id(p)]))
        stage_kind(p.engine).apply_budget(p, {d: m.total for d, m in devices.items()})
    return MemoryPlan(plans, devices)
