"""An autoregressive stage: vLLM's own AsyncLLM, its EngineCore in a separate process."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import fields
from typing import Any

from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import EngineInput, PromptType
from vllm.renderers.inputs.preprocess import parse_model_prompt
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine.async_llm import AsyncLLM

from vllm_omni.config.loader import load_function
from vllm_omni.config.schema import StageConfig
from vllm_omni.engine.ar import hidden_states, step_inputs
from vllm_omni.engine.ar.worker import worker_class_path
from vllm_omni.engine.stage import EngineStage
from vllm_omni.orchestrator.connectors import ShmHandle
from vllm_omni.outputs import OmniRequestOutput

_ENGINE_ARG_NAMES = {f.name for f in fields(AsyncEngineArgs)}


def stage_engine_args(
    model: str,
    stage: StageConfig,
    engine_kwargs: dict[str, Any],
    planned: dict[str, Any] | None = None,
) -> AsyncEngineArgs:
    """Engine args of one stage: the memory plan's settings, the stage's YAML args, then the
    caller's explicit args.

    The caller's args (CLI flags, OmniLLM kwargs) win, so `--max-model-len` reaches every
    stage; the stage's own `model` wins over the pipeline's model.
    """
    unknown = sorted(set(engine_kwargs) - _ENGINE_ARG_NAMES)
    if unknown:
        raise TypeError(f"unknown vLLM engine args: {unknown}")
    merged = {**(planned or {}), **stage.engine_args, **engine_kwargs,
              "model": stage.model or model}
    if isinstance(merged.get("hf_overrides"), str):  # 'module:function' from the YAML
        merged["hf_overrides"] = load_function(merged["hf_overrides"])
    if stage.keeps_hidden_states or stage.step_inputs:
        merged.setdefault("worker_cls", worker_class_path())
        # The worker reads the V1 model runner's batch layout; vLLM picks its V2 runner by
        # default where Triton runs (GPUs). The variable is process-wide: every stage then
        # runs the V1 runner.
        if os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0") != "0":
            raise ValueError(f"stage {stage.name!r} needs vLLM's V1 model runner; "
                             "unset VLLM_USE_V2_MODEL_RUNNER")
        # A prefix-cache hit skips the forward pass over the cached prompt tokens: their
        # hidden states would be missing, and step inputs (which differ between requests
        # with the same token ids) would be ignored. Every token must be computed.
        merged.setdefault("enable_prefix_caching", False)
        # The compiled graph runs without Python module hooks and callbacks: eager mode.
        merged.setdefault("enforce_eager", True)
    if stage.model and "tokenizer" not in stage.engine_args:
        merged.pop("tokenizer", None)
    return AsyncEngineArgs(**merged)


def is_engine_input(prompt: object) -> bool:
    """True for a prompt already rendered by vLLM's renderer (it carries a 'type')."""
    return isinstance(prompt, dict) and "type" in prompt


class ARStage(EngineStage):
    def __init__(
        self,
        config: StageConfig,
        engine_args: AsyncEngineArgs,
        usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
    ) -> None:
        self.config = config
        self.name = config.name
        self.engine = AsyncLLM.from_engine_args(engine_args, usage_context=usage_context)
        self.model_config = self.engine.model_config
        # The model's generation_config defaults, the ones derived from its config, then the
        # stage's own defaults from the YAML.
        derived = {}
        if config.sampling_defaults:
            derived = load_function(config.sampling_defaults)(self.model_config.hf_config)
        self.default_sampling = {
            **self.model_config.get_diff_sampling_param(),
            **derived,
            **config.sampling_params,
        }

    @property
    def renderer(self):
        return self.engine.renderer

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len

    def sampling_params(self, given: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        """SamplingParams for one request: given ones as they are, a dict over the defaults."""
        if isinstance(given, SamplingParams):
            return given
        unknown = sorted(set(given or {}) - set(SamplingParams.__struct_fields__))
        if unknown:
            raise ValueError(f"stage {self.name!r}: unknown sampling params {unknown}")
        try:
            return SamplingParams.from_optional(**{**self.default_sampling, **(given or {})})
        except TypeError as e:  # a value of the wrong type, from the request
            raise ValueError(f"stage {self.name!r}: invalid sampling params: {e}") from None

    async def render(self, prompts: list[PromptType | EngineInput]) -> list[EngineInput]:
        """Tokenize (and process multimodal data of) prompts in one batch, as vLLM's LLM does."""
        todo = [i for i, p in enumerate(prompts) if not is_engine_input(p)]
        if not todo:
            return list(prompts)
        parsed = [parse_model_prompt(self.model_config, prompts[i]) for i in todo]
        rendered = await self.renderer.render_cmpl_async(parsed)
        out = list(prompts)
        for i, engine_input in zip(todo, rendered, strict=True):
            out[i] = engine_input
        return out

    async def generate(
        self,
        request_id: str,
        prompt: PromptType | EngineInput,
        sampling_params: SamplingParams,
        keep_hidden_states: bool | None = None,
    ) -> AsyncIterator[OmniRequestOutput]:
        """Run one request. `keep_hidden_states` (default: when the stage outputs them) also
        returns the request's hidden states and input embeddings as a shared-memory handle.
        A prompt dict may carry `step_inputs` = {"tensors": ShmHandle, "args": {...}} for a
        stage with `step_inputs` (see engine/ar/step_inputs.py)."""
        output_type = self.config.output
        wants_hidden = (
            output_type == "hidden_states" if keep_hidden_states is None else keep_hidden_states
        )
        extra = {}
        if isinstance(prompt, dict) and "step_inputs" in prompt:
            if not self.config.step_inputs:
                raise ValueError(f"stage {self.name!r} takes no step inputs")
            prompt = dict(prompt)
            given = prompt.pop("step_inputs")
            tensors = given["tensors"]
            extra[step_inputs.REQUEST_KEY] = {
                "tensors": tensors.as_data() if isinstance(tensors, ShmHandle) else tensors,
                "args": given.get("args", {}),
            }
        if wants_hidden:
            extra[hidden_states.REQUEST_KEY] = request_id
        if extra:
            sampling_params = sampling_params.clone()
            sampling_params.extra_args = {**(sampling_params.extra_args or {}), **extra}
        (engine_input,) = await self.render([prompt])
        try:
            async for out in self.engine.generate(engine_input, sampling_params, request_id):
                result = OmniRequestOutput(
                    request_id=request_id,
                    stage=self.name,
                    output_type=output_type,
                    finished=out.finished,
                    prompt=out.prompt,
                    prompt_token_ids=out.prompt_token_ids,
                    outputs=out.outputs,
                    num_cached_tokens=out.num_cached_tokens or 0,
                )
                if wants_hidden and out.finished:
                    result.tensor_handles = await self._take_hidden_states(request_id)
                yield result
        except BaseException:
            if wants_hidden:
                await self.engine.collective_rpc("drop_hidden_states", args=(request_id,))
            raise

    async def _take_hidden_states(self, key: str) -> dict[str, Any]:
        replies = await self.engine.collective_rpc("take_hidden_states", args=(key,))
        found = [r for r in replies if r is not None]
        return {"hidden_states": ShmHandle.from_data(found[0])} if found else {}
