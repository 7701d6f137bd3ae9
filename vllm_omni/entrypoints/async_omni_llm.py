"""AsyncOmniLLM: the online entry point, a thin facade over the orchestrator.

It loads the pipeline for a model, starts it (orchestrator/), and offers what callers need:
`generate()` as an async iterator per request, abort, health, and which stage answers what
(the text, the images, the audio).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from vllm import SamplingParams
from vllm.inputs import EngineInput, PromptType
from vllm.plugins import load_general_plugins
from vllm.usage.usage_lib import UsageContext

from vllm_omni.config import PipelineConfig, StageConfig, resolve_pipeline
from vllm_omni.config.kinds import Capability, stage_kind
from vllm_omni.engine.diffusion.params import DiffusionParams
from vllm_omni.engine.stage import Stage, StartContext
from vllm_omni.orchestrator.orchestrator import Orchestrator
from vllm_omni.outputs import OmniRequestOutput

logger = logging.getLogger(__name__)

StageSampling = SamplingParams | DiffusionParams | dict[str, Any] | None


class AsyncOmniLLM:
    """Serve a pipeline of stages; `generate()` is an async iterator per request.

    Args:
        model: model folder (or name) the pipeline is loaded for.
        stage_configs_path: a pipeline YAML; default: the built-in pipeline for the model's
            HF architecture, or the one-stage LLM pipeline.
        pipeline: an already loaded pipeline config (instead of `stage_configs_path`).
        cache_config: step caching for every diffusion stage (CacheConfig's fields, over
            the stage's own); requests may override it field by field.
        stage_restarts: how many times a stage whose engine dies (or hangs) is restarted;
            0: never (orchestrator/supervisor.py).
        stage_hang_timeout: seconds a stage's engine may leave a probe unanswered before
            it counts as hung; None: dead engines only.
        diffusion_parallel: ranks of every diffusion stage (`ulysses_degree`, `ring_degree`,
            `cfg_parallel_size`), over each stage's own engine_args.
        ray_address: run every stage as an actor on the Ray cluster at this address
            ('auto': the one on this machine; cluster/, docs/design/ray.md); None: every
            stage in this host's processes, and Ray is not imported.
        lora_modules: LoRA adapters (name -> diffusers / PEFT LoRA file) every stage that
            serves adapters (the diffusion stages) loads at start; requests pick one by name.
        ray_placement_timeout: seconds a stage's placement on the Ray cluster may take
            before start-up fails naming the stage and what the cluster lacks.
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
        stage_restarts: int = 3,
        stage_hang_timeout: float | None = 120.0,
        diffusion_parallel: dict[str, int] | None = None,
        ray_address: str | None = None,
        ray_placement_timeout: float = 60.0,
        lora_modules: dict[str, str] | None = None,
        **engine_kwargs: Any,
    ) -> None:
        self.model = model
        self.pipeline = pipeline or resolve_pipeline(model, stage_configs_path)
        # Once, here: stages start in threads, and vLLM marks plugins loaded before it has
        # run them, so a second thread could build its config before our models register.
        load_general_plugins()
        context = StartContext(model, engine_kwargs, usage_context, cache_config,
                               diffusion_parallel=diffusion_parallel,
                               lora_modules=dict(lora_modules or {}))
        self.adapters: dict[str, str] = context.lora_modules  # what restarted stages load
        if self.adapters and not self._adapter_stage_names():
            raise ValueError(f"LoRA adapters {sorted(self.adapters)} given, but no stage of "
                             f"pipeline {self.pipeline.name!r} serves adapters (diffusion "
                             "stages do)")
        self.launcher = None
        if ray_address is not None:
            from vllm_omni.cluster.stage import RayLauncher

            self.launcher = context.launcher = RayLauncher(
                ray_address, self.pipeline, placement_timeout=ray_placement_timeout)
        try:
            self.orchestrator = Orchestrator(self.pipeline, context)
        except BaseException:
            if self.launcher is not None:
                self.launcher.close()
            raise
        self.memory_plan = self.orchestrator.memory_plan
        self.stages: dict[str, Stage] = self.orchestrator.stages
        self.order: list[StageConfig] = self.orchestrator.order  # stages, inputs first
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            logger.warning("AsyncOmniLLM built outside an event loop: stages are not "
                           "supervised (dead or hung stages are not restarted)")
        else:
            self.orchestrator.supervise(stage_restarts, stage_hang_timeout)

    # -- which stage answers what ------------------------------------------------------------

    @property
    def entry_stage(self) -> Stage:
        """The stage that receives the user's prompt (renders chat, counts prompt tokens)."""
        return self.stages[self.order[0].name]

    @property
    def text_stage(self) -> Stage | None:
        """The stage whose text is the request's text answer (OpenAI sampling params go here):
        the final text stage, else the first stage able to answer in text that writes text or
        tokens; None without one (a text encoder whose hidden states feed a DiT is not one:
        chat draws the last user message, as on a diffusion pipeline)."""
        final = self._final_stage("text")
        if final is not None:
            return final
        ar = [self.stages[s.name] for s in self.order
              if Capability.TEXT_ANSWER in stage_kind(s.engine).capabilities
              and s.output in ("text", "tokens")]
        return ar[0] if ar else None

    @property
    def image_stage(self) -> Stage | None:
        return self._final_stage("image")

    @property
    def video_stage(self) -> Stage | None:
        return self._final_stage("video")

    @property
    def audio_stage(self) -> Stage | None:
        return self._final_stage("audio")

    def _final_stage(self, output: str) -> Stage | None:
        """The final stage with this output type (None when the pipeline makes none)."""
        for s in self.order:
            if s.final_output and s.output == output:
                return self.stages[s.name]
        return None

    # -- adapters ------------------------------------------------------------------------------

    def _adapter_stage_names(self) -> list[str]:
        return [s.name for s in self.pipeline.stages
                if Capability.ADAPTERS in stage_kind(s.engine).capabilities]

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve the LoRA adapter at `path` as `name` on every stage that serves adapters
        (all or none: one that refuses it unloads it from the others). ValueError: it does
        not fit, or the name is taken."""
        if name in self.adapters:
            raise ValueError(f"an adapter named {name!r} is already loaded")
        if not self._adapter_stage_names():
            raise ValueError(f"no stage of pipeline {self.pipeline.name!r} serves LoRA "
                             "adapters (diffusion stages do)")
        done = []
        try:
            for stage_name in self._adapter_stage_names():
                await self.stages[stage_name].load_adapter(name, path)
                done.append(stage_name)
        except BaseException:
            for stage_name in done:
                with contextlib.suppress(Exception):
                    await self.stages[stage_name].unload_adapter(name)
            raise
        self.adapters[name] = path

    async def unload_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise ValueError(f"no adapter named {name!r} is loaded")
        for stage_name in self._adapter_stage_names():
            await self.stages[stage_name].unload_adapter(name)
        del self.adapters[name]

    # -- requests ------------------------------------------------------------------------------

    def sampling_params_list(
        self, given: Sequence[StageSampling] | SamplingParams | None
    ) -> list[Any]:
        """One parameter object per stage (SamplingParams for an AR stage, DiffusionParams
        for a diffusion stage...), in the pipeline's declaration order. A single one is
        fine for a one-stage pipeline."""
        if given is None or isinstance(given, SamplingParams | DiffusionParams | dict):
            given = [given] if len(self.pipeline.stages) == 1 else None
        return list(self.orchestrator.stage_params(given).values())

    def plan(self, modalities: Sequence[str] | None = None) -> tuple[list[StageConfig], set[str]]:
        """The stages a request asking for `modalities` runs, and those it returns."""
        return self.orchestrator.plan(modalities)

    async def render(self, prompts: list[PromptType | EngineInput]) -> list[EngineInput]:
        """Render prompts for the entry stage in one batch; generate() renders any prompt it
        gets unrendered, one at a time. An entry stage with an input processor takes its
        prompts as given (the processor makes the stage's prompt)."""
        if self.order[0].input_processor is not None:
            return list(prompts)
        return await self.entry_stage.render(prompts)

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
        names = [s.name for s in self.pipeline.stages]
        params = dict(zip(names, self.sampling_params_list(sampling_params_list), strict=True))
        run = self.orchestrator.run(request_id or uuid.uuid4().hex, prompt, params, modalities)
        async with contextlib.aclosing(run) as outputs:
            async for out in outputs:
                yield out

    async def abort(self, request_id: str) -> None:
        """Abort a request in every stage (a no-op where it is not running)."""
        await self.orchestrator.abort(request_id)

    async def check_health(self) -> None:
        """Raises if any stage's engine is dead."""
        await self.orchestrator.check_health()

    @property
    def errored(self) -> bool:
        return self.orchestrator.errored

    def shutdown(self) -> None:
        self.orchestrator.shutdown()
        if self.launcher is not None:
            self.launcher.close()
