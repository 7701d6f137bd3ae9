"""The orchestrator: the pipeline's stages, started together, and the requests run over them.

It plans the pipeline's memory, starts every stage through its kind, and turns a request
into a `RequestRun` over the stages the request needs, with one parameter object per stage.
It reaches stages only through the stage contract (engine/stage.py).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm.v1.engine.exceptions import EngineDeadError

from vllm_omni.config import PipelineConfig, StageConfig
from vllm_omni.config.loader import load_function
from vllm_omni.config.schema import MODALITY_OF_OUTPUT
from vllm_omni.engine.stage import Stage, StartContext, start_stage
from vllm_omni.errors import StageStartError
from vllm_omni.orchestrator.memory import plan_pipeline
from vllm_omni.orchestrator.request import InputProcessor, RequestRun, stage_request_id
from vllm_omni.orchestrator.supervisor import StageSupervisor
from vllm_omni.outputs import OmniRequestOutput
from vllm_omni.transfer.connectors import sweep_orphaned_pools

logger = logging.getLogger(__name__)


def load_input_processor(path: str) -> InputProcessor:
    """The processor as `f(upstream_outputs, prompt, stage, params)`. Processors may take
    just `(upstream_outputs, prompt)`; those that need more get the consuming stage (its model
    config, say) and the request's parameters per stage name."""
    func = load_function(path)
    if len(inspect.signature(func).parameters) >= 4:
        return func
    return lambda upstream, prompt, _stage, _params: func(upstream, prompt)


class Orchestrator:
    """Starts a pipeline's stages (all at once; fails naming every stage that cannot
    start) and runs requests over them."""

    def __init__(self, pipeline: PipelineConfig, context: StartContext) -> None:
        self.context = context
        self.supervisor: StageSupervisor | None = None
        self.pipeline = pipeline
        self.order = pipeline.topological_order()
        self.stages: dict[str, Stage] = {}
        self.runs: set[RequestRun] = set()  # the requests in flight
        self.processors = {s.name: load_input_processor(s.input_processor)
                           for s in pipeline.stages if s.input_processor}
        # Before any engine starts: a plan that cannot fit fails here, all problems named.
        self.memory_plan = plan_pipeline(pipeline, context.model, context.engine_kwargs,
                                         context.usage_context, context.cache_config,
                                         diffusion_parallel=context.diffusion_parallel)
        context.stage_plans = {p.stage: p for p in self.memory_plan.stages}
        logger.info("Memory plan of pipeline %r (GiB):\n%s", pipeline.name,
                    self.memory_plan.table())
        self._start(context)

    def _start(self, context: StartContext) -> None:
        def start(stage: StageConfig) -> Stage:
            logger.info("Starting stage %r (%s) of pipeline %r", stage.name, stage.engine,
                        self.pipeline.name)
            return start_stage(stage, context)

        failures: dict[str, BaseException] = {}
        if len(self.order) == 1:  # in this thread, so the engine binds to the running loop
            try:
                self.stages[self.order[0].name] = start(self.order[0])
            except Exception as e:
                failures[self.order[0].name] = e
        else:
            with ThreadPoolExecutor(len(self.order), thread_name_prefix="stage-start") as pool:
                futures = {s.name: pool.submit(start, s) for s in self.order}
            for name, future in futures.items():
                try:
                    self.stages[name] = future.result()
                except Exception as e:
                    failures[name] = e
        if failures:
            self.shutdown()
            raise StageStartError(failures) from next(iter(failures.values()))
        logger.info("Pipeline %r ready: stages %s", self.pipeline.name, list(self.stages))

    def plan(self, modalities: Sequence[str] | None = None) -> tuple[list[StageConfig], set[str]]:
        """The stages a request runs (in order) and the stages whose outputs it returns.

        `modalities` (e.g. ["text"]) keeps the final stages with those output types and the
        stages that feed them; stages that only serve other outputs are skipped.
        """
        finals = [s for s in self.order if s.final_output]
        if modalities is None:
            modalities = self.pipeline.default_modalities
        if modalities is not None:
            offered = {MODALITY_OF_OUTPUT[s.output] for s in finals}
            missing = sorted(set(modalities) - offered)
            if missing:
                raise ValueError(
                    f"pipeline {self.pipeline.name!r} cannot output {missing}; "
                    f"it outputs {sorted(offered)}"
                )
            finals = [s for s in finals if MODALITY_OF_OUTPUT[s.output] in modalities]
        needed: set[str] = set()
        todo = [s.name for s in finals]
        while todo:
            name = todo.pop()
            if name not in needed:
                needed.add(name)
                todo += self.pipeline.stage(name).inputs
        return [s for s in self.order if s.name in needed], {s.name for s in finals}

    def stage_params(self, given: Sequence[Any] | None) -> dict[str, Any]:
        """Each stage's parameters for one request, by stage name, from one entry per stage
        in the pipeline's declaration order (None: the stage's defaults)."""
        names = [s.name for s in self.pipeline.stages]
        given = [None] * len(names) if given is None else list(given)
        if len(given) != len(names):
            raise ValueError(
                f"sampling_params_list has {len(given)} entries; pipeline "
                f"{self.pipeline.name!r} has {len(names)} stages {names}"
            )
        return {n: self.stages[n].sampling_params(p) for n, p in zip(names, given, strict=True)}

    async def run(
        self,
        request_id: str,
        prompt: Any,
        params: dict[str, Any],
        modalities: Sequence[str] | None = None,
    ) -> AsyncIterator[OmniRequestOutput]:
        """One request's outputs, as its returned stages make them."""
        planned, returned = self.plan(modalities)
        self.check_available({s.name for s in planned})
        # Input processors see the first planned stage's rendered prompt (text and token
        # ids); a plan of independent stages starts where the request's outputs come from.
        # A first stage with its own input processor gets the prompt as given: the
        # processor makes the stage's prompt (a template around it, say).
        if planned[0].input_processor is None:
            (prompt,) = await self.stages[planned[0].name].render([prompt])
        run = RequestRun(request_id, self.pipeline, self.stages, self.processors, planned,
                         returned, prompt, params)
        self.runs.add(run)
        try:
            # Closed with this iterator, so a caller that stops reading stops the run at once.
            async with contextlib.aclosing(run.outputs()) as outputs:
                async for out in outputs:
                    yield out
        finally:
            self.runs.discard(run)

    def fail_stage(self, name: str, error: BaseException) -> None:
        """Fail every request in flight in a stage (its engine is being replaced)."""
        for run in list(self.runs):
            run.fail_stage(name, error)

    async def abort(self, request_id: str) -> None:
        """Abort a request in every stage (a no-op where it is not running), every engine
        request of a stage that runs several prompts for it included."""
        ids = {name: {stage_request_id(request_id, name)} for name in self.stages}
        for run in list(self.runs):
            if run.request_id == request_id:
                for name, engine_ids in run.engine_ids.items():
                    ids[name].update(engine_ids)
        for name, stage in self.stages.items():
            for engine_id in sorted(ids[name]):
                await stage.abort(engine_id)

    def supervise(self, restarts: int, hang_timeout: float | None) -> None:
        """Restart stages that die or hang (see supervisor.py); needs a running loop."""
        self.supervisor = StageSupervisor(self, self.context, restarts, hang_timeout)
        self.supervisor.start()

    def check_available(self, names: set[str]) -> None:
        """Raises EngineDeadError while one of these stages is restarting or down: what it
        would be asked (render, generate) has no engine behind it."""
        problem = self.supervisor.unavailable(names) if self.supervisor else None
        if problem:
            raise EngineDeadError(problem)

    async def check_health(self) -> None:
        """Raises while a stage is dead, restarting, or down for good."""
        problem = self.supervisor.problem() if self.supervisor else None
        if problem:
            raise EngineDeadError(problem)
        for stage in self.stages.values():
            await stage.check_health()

    @property
    def errored(self) -> bool:
        """True while some stage cannot serve (dead, restarting or down)."""
        if self.supervisor is not None and self.supervisor.problem():
            return True
        return any(s.errored for s in self.stages.values())

    def shutdown(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        for stage in self.stages.values():
            stage.shutdown()
        self.stages.clear()
        sweep_orphaned_pools()  # of engine processes that could not close them
