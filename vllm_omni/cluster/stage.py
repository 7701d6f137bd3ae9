"""Stages on a Ray cluster: the launcher that starts them as actors, and the proxy the
orchestrator holds for each (a `Stage` like any other; the orchestrator cannot tell).

`RayLauncher` is the start context's launcher: it joins the cluster, reserves each stage's
placement group, starts the actor that hosts the stage (cluster/actor.py), and knows on
which node every stage runs, so a stage's payloads take the object store exactly when one
of their readers is on another node (the connector is chosen per edge).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray.exceptions import RayError
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from vllm.v1.engine.exceptions import EngineDeadError

from vllm_omni.cluster.actor import hosted_class
from vllm_omni.cluster.connect import connect
from vllm_omni.cluster.placement import reserve
from vllm_omni.config.kinds import stage_kind
from vllm_omni.config.schema import PipelineConfig, StageConfig
from vllm_omni.engine.stage import StageInfo, StartContext
from vllm_omni.outputs import OmniRequestOutput

logger = logging.getLogger(__name__)

# Settings of our engines and vLLM's that a stage's actor takes from the serving process
# (the nodes' own environment is the raylet's, not the user's shell).
_FORWARDED_ENV = ("VLLM_", "VLLM_OMNI_", "OMP_", "TOKENIZERS_", "HF_")
# Async actor calls in flight per stage: a request holds one for its whole generation.
_MAX_CALLS = 1000


def forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_ENV)}


class RayStage:
    """A stage hosted by a Ray actor. Requests, aborts and probes go to the actor; `info`
    is the `StageInfo` the actor handed out at start, from which `sampling_params` are
    made here (by the stage's kind) and an AR stage's renderer is built in this process."""

    def __init__(self, config: StageConfig, actor: Any, group: Any, facts: dict[str, Any],
                 launcher: RayLauncher) -> None:
        self.config = config
        self.name = config.name
        self.actor = actor
        self.group = group
        self.node: str = facts["node"]
        self.info: StageInfo = facts["info"]
        self.kind = stage_kind(config.engine)
        self.launcher = launcher
        self._lifeline = actor.lifeline.remote()
        self._dead: str | None = None

    @functools.cached_property
    def renderer(self) -> Any:
        """vLLM's renderer for the stage's model, built here from its config, as vLLM's
        server builds one in its API process (None for kinds without one). Its multimodal
        processor cache is off: the actor's engine mirrors the cache of its own renderer,
        which this one is not."""
        if self.info.vllm_config is None:
            return None
        from vllm.renderers import renderer_from_config

        config = copy.deepcopy(self.info.vllm_config)
        if config.model_config.multimodal_config is not None:
            config.model_config.multimodal_config.mm_processor_cache_gb = 0
        return renderer_from_config(config)

    def _died(self, error: BaseException) -> EngineDeadError:
        self._dead = self._dead or f"its Ray actor died ({type(error).__name__})"
        return EngineDeadError(f"stage {self.name!r} on Ray node {self.node[:12]}: "
                               f"{self._dead}: {error}")

    def sampling_params(self, given: Any) -> Any:
        return self.kind.request_params(self.info, given)

    async def render(self, prompts: list[Any]) -> list[Any]:
        try:
            return await self.actor.render.remote(prompts)
        except RayError as e:
            raise self._died(e) from None

    async def generate(
        self,
        request_id: str,
        prompt: Any,
        params: Any,
        *,
        input_complete: bool = True,
        keep_hidden_states: bool = False,
    ) -> AsyncIterator[OmniRequestOutput]:
        stream = self.actor.generate.remote(
            request_id, prompt, params, input_complete=input_complete,
            keep_hidden_states=keep_hidden_states,
            export_payloads=self.launcher.crosses_nodes(self.name))
        finished = False
        try:
            async for ref in stream:
                out = await ref
                finished = out.finished
                yield out
        except RayError as e:
            raise self._died(e) from None
        finally:
            if not finished:  # left early: stop the actor's generation too
                with contextlib.suppress(Exception):
                    ray.cancel(stream)

    async def add_input(self, request_id: str, prompt: Any, complete: bool) -> None:
        try:
            await self.actor.add_input.remote(request_id, prompt, complete)
        except RayError as e:
            raise self._died(e) from None

    async def abort(self, request_id: str) -> None:
        try:
            await self.actor.abort.remote(request_id)
        except RayError as e:
            raise self._died(e) from None

    async def load_adapter(self, name: str, path: str) -> None:
        await self._refusable(self.actor.load_adapter.remote(name, path))

    async def unload_adapter(self, name: str) -> None:
        await self._refusable(self.actor.unload_adapter.remote(name))

    async def _refusable(self, call: Any) -> Any:
        """A call the stage may refuse: its ValueError stays one (Ray's task error is an
        instance of its cause), anything else from Ray is the actor gone."""
        try:
            return await call
        except RayError as e:
            if isinstance(e, ValueError):
                raise ValueError(str(getattr(e, "cause", e))) from None
            raise self._died(e) from None

    async def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError(f"stage {self.name!r} on Ray node {self.node[:12]}: "
                                  f"{self._dead}")
        try:
            await self.actor.check_health.remote()
        except RayError as e:
            raise self._died(e) from None

    async def ping(self) -> None:
        try:
            await self.actor.ping.remote()
        except RayError as e:
            raise self._died(e) from None

    @property
    def errored(self) -> bool:
        if self._dead is None:
            ready, _ = ray.wait([self._lifeline], timeout=0)
            if ready:
                try:
                    self._dead = ray.get(ready[0])
                except RayError as e:
                    self._dead = f"its Ray actor died ({type(e).__name__})"
        return self._dead is not None

    def shutdown(self) -> None:
        """Stop the engine in the actor (a dead actor has nothing to stop), then remove the
        actor and its placement group."""
        if self._dead is None:
            with contextlib.suppress(Exception):
                ray.get(self.actor.shutdown.remote(), timeout=60)
        with contextlib.suppress(Exception):
            ray.kill(self.actor)
        with contextlib.suppress(Exception):
            remove_placement_group(self.group)
        self.launcher.forget(self)

    async def received(self) -> list[dict[str, Any]]:
        """The payloads the stage fetched from other nodes' object stores."""
        return await self.actor.received.remote()


class RayLauncher:
    """Starts stages as actors on the Ray cluster at `address`; a StartContext's launcher."""

    def __init__(self, address: str, pipeline: PipelineConfig, *,
                 connect_timeout: float = 30.0, placement_timeout: float = 60.0) -> None:
        self.pipeline = pipeline
        self.placement_timeout = placement_timeout
        self.connected_here = connect(address, connect_timeout)
        self.driver_node = ray.get_runtime_context().get_node_id()
        self.stages: dict[str, RayStage] = {}
        logger.info("Joined Ray cluster %s: %d live node(s)", address,
                    sum(1 for n in ray.nodes() if n.get("Alive")))

    def __call__(self, config: StageConfig, context: StartContext) -> RayStage:
        start = time.monotonic()
        group = reserve(config, context, self.placement_timeout)
        bundle = group.bundle_specs[0]
        actor = None
        try:
            actor_class = ray.remote(hosted_class(stage_kind(config.engine)))
            actor = actor_class.options(
                name=f"vllm-omni:{self.pipeline.name}:{config.name}:{os.getpid()}:{start:.0f}",
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=0,
                    placement_group_capture_child_tasks=True),
                runtime_env={"env_vars": forwarded_env()},
                max_concurrency=_MAX_CALLS,
            ).remote(config, dataclasses.replace(context, launcher=None))
            facts = ray.get(actor.facts.remote())  # after the engine started (or failed)
        except BaseException:
            if actor is not None:
                ray.kill(actor)
            remove_placement_group(group)
            raise
        stage = RayStage(config, actor, group, facts, self)
        self.stages[config.name] = stage
        logger.info("Stage %r runs on Ray node %s (%s), started in %.1f s", config.name,
                    stage.node, bundle, time.monotonic() - start)
        return stage

    def crosses_nodes(self, name: str) -> bool:
        """Whether a reader of the stage's payloads (a consumer stage, or this process for
        a final output) runs on another node than the stage."""
        stage = self.stages.get(name)
        if stage is None:
            return True
        readers = [self.stages[c.name].node if c.name in self.stages else None
                   for c in self.pipeline.consumers(name)]
        if stage.config.final_output:
            readers.append(self.driver_node)
        return any(node != stage.node for node in readers)

    def forget(self, stage: RayStage) -> None:
        if self.stages.get(stage.name) is stage:
            del self.stages[stage.name]

    def close(self) -> None:
        """Remove what is left of ours, and leave the cluster if this process joined it."""
        for stage in list(self.stages.values()):
            stage.shutdown()
        if self.connected_here:
            ray.shutdown()

