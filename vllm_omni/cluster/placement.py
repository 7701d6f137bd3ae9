"""Where a stage's actor goes on a Ray cluster: one placement group per stage.

A stage's bundle holds everything its ranks need on one node (so they are co-located): one
CPU per rank on CPU, one GPU per rank (and a CPU for the actor) on GPUs, plus the custom
resources of its placement (`placement: {resources: {node_b: 1}}`) that pin it to nodes.
The group is reserved before the stage's engine starts; a group the cluster cannot place
within the timeout is a start-up error naming the stage and what no node offers.
"""

from __future__ import annotations

from typing import Any

from vllm_omni.config.placement import PlacementError, stage_device
from vllm_omni.config.schema import StageConfig
from vllm_omni.engine.stage import StartContext


def stage_bundle(config: StageConfig, context: StartContext) -> dict[str, float]:
    """The resources of a stage's actor, from its device, ranks and placement."""
    plan = (context.stage_plans or {}).get(config.name)
    device = plan.device if plan else stage_device(config)
    args = config.engine_args
    ranks = plan.ranks if plan else (int(args.get("tensor_parallel_size", 1))
                                     * int(args.get("pipeline_parallel_size", 1)))
    bundle: dict[str, float] = {"CPU": float(ranks)}
    if device.startswith("cuda"):
        bundle = {"CPU": 1.0, "GPU": float(ranks)}
    if config.placement is not None:
        bundle.update(config.placement.resources)
    return bundle


def shortfall(bundle: dict[str, float], nodes: list[dict[str, Any]]) -> str:
    """What no live node offers, in words (from `ray.nodes()`)."""
    alive = [n["Resources"] for n in nodes if n.get("Alive")]
    missing = [f"{k}: {v:g}" for k, v in bundle.items()
               if not any(r.get(k, 0) >= v for r in alive)]
    if missing:
        return f"no live node offers {{{', '.join(missing)}}}"
    return (f"no live node has all of {bundle} free at once (other actors hold them, "
            "or no single node offers them together)")


def reserve(config: StageConfig, context: StartContext, timeout: float) -> Any:
    """The stage's placement group, once placed; PlacementError naming the stage and what is
    missing when the cluster has not placed it within `timeout` seconds."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle = stage_bundle(config, context)
    group = placement_group([bundle], strategy="STRICT_PACK",
                            name=f"vllm-omni-{config.name}")
    ready, _ = ray.wait([group.ready()], timeout=timeout)
    if not ready:
        remove_placement_group(group)
        raise PlacementError(
            f"stage {config.name!r}: the Ray cluster could not place its actor "
            f"({bundle}) within {timeout:g} s: {shortfall(bundle, ray.nodes())} "
            "(see the stage's `placement.resources`, or --ray-placement-timeout)")
    return group
