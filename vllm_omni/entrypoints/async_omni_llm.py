"""AsyncOmniLLM: the online entry point and the one orchestrator every caller goes through.

A request runs through the pipeline's stages in topological order. A stage with inputs gets
its prompt from its input processor, called with the finished outputs of the stages that feed
it. Outputs of stages marked `final_output` are yielded to the caller as they come.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm import SamplingParams
from vllm.inputs import EngineInput, PromptType
from vllm.plugins import load_general_plugins
from vllm.usage.usage_lib import UsageContext

from vllm_omni.config import PipelineConfig, StageConfig, resolve_pipeline
from vllm_omni.config.loader import load_function
from vllm_omni.config.schema import MODALITY_OF_OUTPUT
from vllm_omni.engine.ar import ARStage
from vllm_omni.engine.ar.stage import stage_engine_args
from vllm_omni.engine.code2wav.stage import Code2WavStage
from vllm_omni.engine.diffusion.params import DiffusionParams
from vllm_omni.engine.diffusion.stage import DiffusionStage
from vllm_omni.errors import StageError, StageStartError
from vllm_omni.orchestrator.memory import plan_pipeline
from vllm_omni.outputs import OmniRequestOutput

logger = logging.getLogger(__name__)

StageSampling = SamplingParams | DiffusionParams | dict[str, Any] | None
Stage = ARStage | DiffusionStage | Code2WavStage
InputProcessor = Callable[..., Any]
TENSOR_OUTPUTS = {"hidden_states", "latent"}


def load_input_processor(path: str) -> InputProcessor:
    """The processor as `f(upstream_outputs, prompt, stage, params)`. Processors may take
    just `(upstream_outputs, prompt)`; those that need more get the consuming stage (its model
    config, say) and the request's parameters per stage name."""
    func = load_function(path)
    if len(inspect.signature(func).parameters) >= 4:
        return func
    return lambda upstream, prompt, _stage, _params: func(upstream, prompt)


@dataclasses.dataclass
class _Edge:
    """A streamed edge as the upstream sees it: every `every` tokens (and at the end) its
    output so far goes to the consumer's queue."""

    queue: asyncio.Queue
    every: int
    forwarded: int = 0

    def offer(self, out: OmniRequestOutput) -> None:
        if out.finished or out.num_generated_tokens - self.forwarded >= self.every:
            self.forwarded = out.num_generated_tokens
            self.queue.put_nowait(out)


class AsyncOmniLLM:
    """Serve a pipeline of stages; `generate()` is an async iterator per request.

    Args:
        model: model folder (or name) the pipeline is loaded for.
        stage_configs_path: a pipeline YAML; default: the built-in pipeline for the model's
            HF architecture, or the one-stage LLM pipeline.
        pipeline: an already loaded pipeline config (instead of `stage_configs_path`).
        cache_config: step caching for every diffusion stage (CacheConfig's fields, over
            the stage's own); requests may override it field by field.
        **engine_kwargs: vLLM engine args applied to every AR stage (dtype, max_model_len...);
            diffusion stages take the ones that apply to them (dtype).
    """

    def __init__(
        self,
        model: str,
        *,
        stage_configs_path: str | None = None,
        pipeline: PipelineConfig | None = None,
        usage_context: UsageContext = UsageContext.OPENAI_API_SERVER,
        cache_config: dict[str, Any] | None = None,
        **engine_kwargs: Any,
    ) -> None:
        self.model = model
        self._cache_config = cache_config
        self.pipeline = pipeline or resolve_pipeline(model, stage_configs_path)
        self.order = self.pipeline.topological_order()
        self.stages: dict[str, Stage] = {}
        self._input_processors = {
            s.name: load_input_processor(s.input_processor)
            for s in self.pipeline.stages
            if s.input_processor
        }
        # Once, here: stages start in threads, and vLLM marks plugins loaded before it has
        # run them, so a second thread could build its config before our models register.
        load_general_plugins()
        # Before any engine starts: a plan that cannot fit fails here, all problems named.
        self.memory_plan = plan_pipeline(self.pipeline, model, engine_kwargs, usage_context,
                                         cache_config)
        logger.info("Memory plan of pipeline %r (GiB):\n%s", self.pipeline.name,
                    self.memory_plan.table())
        self._start_stages(engine_kwargs, usage_context)

    def _start_stages(self, engine_kwargs: dict[str, Any], usage_context: UsageContext) -> None:
        """Start every stage's engine at once; fail with every stage's error, named."""

        def start(stage: StageConfig) -> Stage:
            logger.info(
                "Starting stage %r (%s) of pipeline %r",
                stage.name,
                stage.engine,
                self.pipeline.name,
            )
            if stage.engine == "diffusion":
                return DiffusionStage(stage, self.model, engine_kwargs, self._cache_config)
            if stage.engine == "code2wav":
                return Code2WavStage(stage, self.model)
            planned = self.memory_plan.stage(stage.name).engine_args
            return ARStage(
                stage, stage_engine_args(self.model, stage, engine_kwargs, planned), usage_context
            )

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

    # -- stage access -------------------------------------------------------------------

    @property
    def entry_stage(self) -> Stage:
        """The stage that receives the user's prompt (renders chat, counts prompt tokens)."""
        return self.stages[self.order[0].name]

    @property
    def text_stage(self) -> ARStage | None:
        """The stage whose text is the request's text answer (OpenAI sampling params go here):
        the final text stage, else the first AR stage; None in a pipeline without AR stages."""
        final = self._final_stage("text")
        if final is not None:
            return final
        ar = [self.stages[s.name] for s in self.order if s.engine == "ar"]
        return ar[0] if ar else None

    def _final_stage(self, output: str) -> Stage | None:
        """The final stage with this output type (None when the pipeline makes none)."""
        for s in self.order:
            if s.final_output and s.output == output:
                return self.stages[s.name]
        return None

    @property
    def image_stage(self) -> DiffusionStage | None:
        return self._final_stage("image")

    @property
    def audio_stage(self) -> Code2WavStage | None:
        return self._final_stage("audio")

    def sampling_params_list(
        self, given: Sequence[StageSampling] | SamplingParams | None
    ) -> list[SamplingParams | DiffusionParams]:
        """One SamplingParams (DiffusionParams for a diffusion stage) per stage, in the
        pipeline's declaration order."""
        names = [s.name for s in self.pipeline.stages]
        if given is None or isinstance(given, SamplingParams | DiffusionParams | dict):
            given = [given] if len(names) == 1 else None
        if given is None:
            given = [None] * len(names)
        if len(given) != len(names):
            raise ValueError(
                f"sampling_params_list has {len(given)} entries; pipeline "
                f"{self.pipeline.name!r} has {len(names)} stages {names}"
            )
        return [self.stages[n].sampling_params(sp) for n, sp in zip(names, given, strict=True)]

    # -- requests -----------------------------------------------------------------------

    async def render(self, prompts: list[PromptType | EngineInput]) -> list[EngineInput]:
        """Render prompts for the entry stage in one batch; generate() renders any prompt it
        gets unrendered, one at a time."""
        return await self.entry_stage.render(prompts)

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

    async def generate(
        self,
        prompt: PromptType | EngineInput,
        sampling_params_list: Sequence[StageSampling] | SamplingParams | None = None,
        request_id: str | None = None,
        modalities: Sequence[str] | None = None,
    ) -> AsyncIterator[OmniRequestOutput]:
        """Run one request through the pipeline, yielding final-stage outputs as they come.

        A stage's failure is raised as StageError naming the stage. Cancelling the
        iteration (or closing it) aborts the request in every stage.
        """
        request_id = request_id or uuid.uuid4().hex
        stages, returned = self.plan(modalities)
        names = [s.name for s in self.pipeline.stages]
        params = dict(zip(names, self.sampling_params_list(sampling_params_list), strict=True))
        # Input processors see the first planned stage's rendered prompt (text and token
        # ids); a plan of independent stages starts where the request's outputs come from.
        (prompt,) = await self.stages[stages[0].name].render([prompt])
        finished: dict[str, OmniRequestOutput] = {}
        planned = {s.name for s in stages}
        # Hidden states are kept only when a stage of this plan reads them.
        keep_hidden = {
            s.name: s.output == "hidden_states"
            or (s.hidden_states and any(c.name in planned for c in self.pipeline.consumers(s.name)))
            for s in stages if s.engine == "ar"
        }
        done = {s.name: asyncio.Event() for s in stages}
        # Streamed edges (`stream_inputs`): the consumer's queue of its upstream's outputs.
        edges = {s.name: asyncio.Queue() for s in stages if s.stream_inputs}
        started: set[str] = set()
        outputs: asyncio.Queue = asyncio.Queue()
        # Seconds each stage took for this request, filled as stages finish; every output
        # carries this one dict, so a caller that read the whole request sees all stages.
        stage_seconds: dict[str, float] = {}

        def process(name: str, upstream: dict[str, OmniRequestOutput]) -> Any:
            return self._input_processors[name](upstream, prompt, self.stages[name], params)

        async def feed(stage_cfg: StageConfig) -> None:
            """Hand a streamed edge's later chunks to the running consumer."""
            (upstream,) = stage_cfg.inputs
            name = stage_cfg.name
            try:
                while True:
                    out = await edges[name].get()
                    stage_input = process(name, {upstream: out})
                    await self.stages[name].add_input(f"{request_id}-{name}", stage_input,
                                                      out.finished)
                    if out.finished:
                        return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                outputs.put_nowait(StageError(name, e))

        async def run_stage(stage_cfg: StageConfig) -> None:
            """One stage of this request, as soon as the stages feeding it are done (or, on a
            streamed edge, have sent their first chunk)."""
            name = stage_cfg.name
            feeder = None
            streams = [_Edge(edges[c.name], c.stream_inputs[name])
                       for c in self.pipeline.consumers(name) if c.name in edges]
            try:
                stage = self.stages[name]
                stage_prompt = prompt
                extra: dict[str, Any] = {}
                if stage_cfg.stream_inputs:
                    (upstream,) = stage_cfg.inputs
                    first = await edges[name].get()
                    stage_prompt = process(name, {upstream: first})
                    if not first.finished:
                        extra["input_complete"] = False
                        # It first runs when generate() below first waits, after the stage
                        # has sent the request to its engine: no chunk overtakes the start.
                        feeder = asyncio.create_task(feed(stage_cfg))
                elif stage_cfg.inputs:
                    for upstream in stage_cfg.inputs:
                        await done[upstream].wait()
                    stage_prompt = process(name, {n: finished[n] for n in stage_cfg.inputs})
                started.add(name)
                stage_start = time.perf_counter()
                if name in keep_hidden:
                    extra["keep_hidden_states"] = keep_hidden[name]
                async for out in stage.generate(f"{request_id}-{name}", stage_prompt,
                                                params[name], **extra):
                    out.request_id = request_id
                    out.metrics["stage_seconds"] = stage_seconds
                    if out.finished:
                        stage_seconds[name] = round(time.perf_counter() - stage_start, 6)
                        finished[name] = out
                    for edge in streams:
                        edge.offer(out)
                    if name in returned:
                        if out.output_type in TENSOR_OUTPUTS:
                            out.resolve_tensors()
                        else:  # handles kept for downstream stages are not the caller's
                            out = dataclasses.replace(out, tensor_handles={})
                        outputs.put_nowait(out)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                outputs.put_nowait(StageError(name, e))
            else:
                done[name].set()
                outputs.put_nowait(name)
            finally:
                if feeder is not None:
                    feeder.cancel()

        # Independent stages (fan-out branches, or the inputs of a fan-in) run concurrently.
        tasks = [asyncio.create_task(run_stage(s)) for s in stages]
        remaining = len(tasks)
        try:
            while remaining:
                item = await outputs.get()
                if isinstance(item, StageError):
                    raise item from item.cause
                if isinstance(item, str):  # a stage finished
                    remaining -= 1
                else:
                    yield item
        finally:
            # Cancelled, closed, or failed: stop every stage still holding the request.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for name in started - {n for n, e in done.items() if e.is_set()}:
                await self.stages[name].abort(f"{request_id}-{name}")
            # Payloads no stage read (a consumer failed or was cancelled first) are freed.
            for out in finished.values():
                out.discard_tensors()

    async def abort(self, request_id: str) -> None:
        """Abort a request in every stage (a no-op where it is not running)."""
        for name, stage in self.stages.items():
            await stage.abort(f"{request_id}-{name}")

    async def check_health(self) -> None:
        """Raises if any stage's engine is dead."""
        for stage in self.stages.values():
            await stage.check_health()

    @property
    def errored(self) -> bool:
        return any(s.errored for s in self.stages.values())

    def shutdown(self) -> None:
        for stage in self.stages.values():
            stage.shutdown()
        self.stages.clear()
