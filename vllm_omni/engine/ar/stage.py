"""An autoregressive stage: vLLM's own AsyncLLM, its EngineCore in a separate process."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncIterator
from dataclasses import fields
from pathlib import Path
from typing import Any, ClassVar

from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import EngineInput, PromptType
from vllm.platforms import current_platform
from vllm.renderers.inputs.preprocess import parse_model_prompt
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM

from vllm_omni.config.kinds import Capability
from vllm_omni.config.loader import load_function
from vllm_omni.config.schema import StageConfig
from vllm_omni.engine.ar import hidden_states, parallel, step_inputs
from vllm_omni.engine.ar.attention import attention_problems
from vllm_omni.engine.ar.worker import worker_class_path
from vllm_omni.engine.memory import AR_RANK_RUNTIME, RUNTIME, StagePlan, weights_bytes
from vllm_omni.engine.stage import EngineStage, StageInfo, StartContext
from vllm_omni.outputs import OmniRequestOutput
from vllm_omni.transfer.connectors import SharedMemoryConnector, ShmHandle

_ENGINE_ARG_NAMES = {f.name for f in fields(AsyncEngineArgs)}
# Multimodal inputs a chat message can carry, by vLLM's modality name.
CHAT_INPUTS = ("image", "audio", "video")
AOT_ENV = "VLLM_USE_AOT_COMPILE"


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
    root = stage.model or model
    merged = {**(planned or {}), **stage.engine_args, **engine_kwargs,
              "model": str(Path(root) / stage.subfolder) if stage.subfolder else root}
    tokenizer = stage.engine_args.get("tokenizer")
    if stage.subfolder and tokenizer and not Path(tokenizer).is_absolute():
        merged["tokenizer"] = str(Path(root) / tokenizer)
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
    if stage.step_inputs:
        # Step inputs differ between requests with the same token ids, which a prefix-cache
        # hit would ignore; the model reads them through a Python call in its forward, which
        # a compiled graph would not make.
        merged.setdefault("enable_prefix_caching", False)
        merged.setdefault("enforce_eager", True)
    elif stage.keeps_hidden_states and not current_platform.is_cpu():
        # A full CUDA graph replays without calling the model's forward, which the hidden
        # states hooks watch; piecewise graphs call it.
        compilation = merged.get("compilation_config") or {}
        if isinstance(compilation, dict):
            merged["compilation_config"] = {"cudagraph_mode": "PIECEWISE", **compilation}
    if (stage.model or stage.subfolder) and "tokenizer" not in stage.engine_args:
        merged.pop("tokenizer", None)
    return AsyncEngineArgs(**merged)


def input_modalities(model_config: Any) -> tuple[str, ...]:
    """Text, plus the modalities the model takes in a chat message (from vLLM's model
    class: those it has a placeholder for)."""
    if not model_config.is_multimodal_model:
        return ("text",)
    from vllm.model_executor.models import ModelRegistry

    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architectures, model_config)
    found = ["text"]
    for modality in CHAT_INPUTS:
        try:
            if model_cls.get_placeholder_str(modality, 1) is not None:
                found.append(modality)
        except (ValueError, NotImplementedError):
            pass
    return tuple(found)


def is_engine_input(prompt: object) -> bool:
    """True for a prompt already rendered by vLLM's renderer (it carries a 'type')."""
    return isinstance(prompt, dict) and "type" in prompt


class ARStage(EngineStage):
    """A stage run by vLLM's engine: text, token or hidden-state outputs, with vLLM's
    continuous batching, paged KV cache and renderer (chat templates, multimodal inputs)."""

    outputs: ClassVar[frozenset[str]] = frozenset({"text", "tokens", "hidden_states"})
    capabilities: ClassVar[frozenset[str]] = frozenset({
        Capability.HIDDEN_STATES, Capability.SUBFOLDER, Capability.KV_CACHE,
        Capability.TEXT_ANSWER})

    # -- the kind ------------------------------------------------------------------------

    @classmethod
    def check_engine_args(cls, args: dict[str, Any]) -> None:
        unknown = sorted(set(args) - _ENGINE_ARG_NAMES)
        if unknown:
            raise ValueError(f"unknown vLLM engine args {unknown}")

    @classmethod
    def check_sampling_params(cls, params: dict[str, Any]) -> None:
        unknown = sorted(set(params) - set(SamplingParams.__struct_fields__))
        if unknown:
            raise ValueError(f"unknown sampling params {unknown}")

    @classmethod
    def default_device(cls, config: StageConfig, ar_device_type: str) -> str:
        return ar_device_type

    @classmethod
    def placement_problems(cls, config: StageConfig, device: str,
                           ar_device_type: str) -> list[str]:
        if config.placement is None:
            return []
        name = repr(config.name)
        if device.split(":")[0] != ar_device_type:
            return [f"stage {name}: device {device}, but this vLLM build runs on "
                    f"{ar_device_type}"]
        if device.startswith("cuda") and device != "cuda:0":
            return [f"stage {name}: vLLM runs an AR stage on the first visible GPU; for "
                    f"{device}, start with CUDA_VISIBLE_DEVICES instead"]
        return []

    @classmethod
    def memory_needs(cls, config: StageConfig, context: StartContext, device: str) -> StagePlan:
        """Weights, KV cache and activations of all the stage's ranks, read from the vLLM
        config the engine args give; with several ranks (tensor / pipeline parallel) each
        holds its part of the weights and KV heads and runs its own worker process. Ranks
        that cannot split the model or cannot each get a core (GPU), and a model the
        device's attention cannot run, are the plan's `problems`."""
        args = stage_engine_args(context.model, config, context.engine_kwargs)
        tp, pp = int(args.tensor_parallel_size), int(args.pipeline_parallel_size)
        ranks = tp * pp
        problems = parallel.parallel_problems(config, args.create_model_config(), tp, pp,
                                              device)
        rank_devices = ([device] * ranks if device == "cpu"
                        else [f"cuda:{i}" for i in range(ranks)])
        if not problems:  # else vLLM's config would refuse them with less to say
            vllm_config = dataclasses.replace(args).create_engine_config(context.usage_context)
            problems = attention_problems(config.name, vllm_config.model_config, device)
        if problems:
            return StagePlan(stage=config.name, engine=config.engine, device=device,
                             weights=0, kv_cache=0, activations=0, runtime=0, ranks=ranks,
                             rank_devices=rank_devices, problems=problems)
        model, sched = vllm_config.model_config, vllm_config.scheduler_config
        itemsize = model.dtype.itemsize
        cache_dtype = vllm_config.cache_config.cache_dtype
        kv_item = itemsize if cache_dtype == "auto" else (1 if "fp8" in cache_dtype else 2)
        parallel_config = vllm_config.parallel_config
        # Per rank: its KV heads (replicated where ranks outnumber them) of the layers of
        # its pipeline stage (the largest share); vLLM gives every rank the same budget.
        per_rank_token = (2 * -(-model.get_total_num_hidden_layers() // pp)
                          * model.get_num_kv_heads(parallel_config)
                          * model.get_head_size() * kv_item)
        hidden = model.get_hidden_size()
        intermediate = getattr(model.hf_text_config, "intermediate_size", None) or 4 * hidden
        # Each rank holds the whole hidden rows but only its share of the MLP's.
        per_rank_activations = (
            sched.max_num_batched_tokens * (4 * hidden + 2 * intermediate // tp) * itemsize
            + 2 * sched.max_num_seqs * model.get_vocab_size() * 4)
        binding = parallel.cpu_binding(config, ranks) if device == "cpu" else None
        return StagePlan(
            stage=config.name, engine=config.engine, device=device,
            weights=weights_bytes(model.model, config.weights_prefix, itemsize),
            kv_cache=0, activations=per_rank_activations * ranks,
            runtime=int(RUNTIME[("ar", device[:4])]
                        + (ranks - 1) * AR_RANK_RUNTIME[device[:4]]),
            kv_wanted=per_rank_token * ranks * model.max_model_len * sched.max_num_seqs,
            kv_floor=per_rank_token * ranks * model.max_model_len,
            ranks=ranks, rank_devices=rank_devices,
            env={parallel.BIND_ENV: binding} if device == "cpu" and
            parallel.user_value(parallel.BIND_ENV) is None else {},
        )

    @classmethod
    def joint_problems(cls, plans: list[StagePlan]) -> list[str]:
        return parallel.binding_conflicts({p.stage: p.env.get(parallel.BIND_ENV)
                                           for p in plans if p.device == "cpu"})

    @classmethod
    def apply_budget(cls, plan: StagePlan, device_totals: dict[str, int]) -> None:
        if plan.source in ("planned", "placement.memory_gib"):
            # vLLM sizes the KV cache of each rank (worker process).
            plan.engine_args["kv_cache_memory_bytes"] = plan.kv_cache // plan.ranks
        if plan.device != "cpu" and plan.source != "gpu_memory_utilization":
            # vLLM checks that this fraction of each rank's device is free at start: stages
            # sharing a device ask for fractions that add up.
            plan.engine_args["gpu_memory_utilization"] = min(
                max(plan.total * plan.share(d) / device_totals[d] for d in plan.devices), 1.0)

    @classmethod
    def start(cls, config: StageConfig, context: StartContext) -> ARStage:
        return cls(config, context)

    # -- the stage -----------------------------------------------------------------------

    def __init__(self, config: StageConfig, context: StartContext) -> None:
        self.config = config
        self.name = config.name
        plan = (context.stage_plans or {}).get(config.name)
        engine_args = stage_engine_args(context.model, config, context.engine_kwargs,
                                        plan.engine_args if plan else None)
        if plan is not None:
            env = plan.env
        elif current_platform.is_cpu() and parallel.user_value(parallel.BIND_ENV) is None:
            env = {parallel.BIND_ENV: parallel.cpu_binding(
                config, parallel.world_size(engine_args))}
        else:
            env = {}
        if current_platform.is_cpu() and parallel.user_value(AOT_ENV) is None:
            # vLLM 0.32 on CPU saves AOT-compiled models it cannot load again ('function'
            # object has no attribute 'finalize_loading'), so every start compiled anew; its
            # older compile cache loads, so a restarted stage skips compiling.
            env = {**env, AOT_ENV: "0"}
        # The engine core process takes this environment when AsyncLLM spawns it.
        with parallel.engine_environment(env):
            self.engine = AsyncLLM.from_engine_args(engine_args,
                                                    usage_context=context.usage_context)
        model_config = self.engine.model_config
        # The model's generation_config defaults, the ones derived from its config, then the
        # stage's own defaults from the YAML.
        derived = {}
        if config.sampling_defaults:
            derived = load_function(config.sampling_defaults)(model_config.hf_config)
        self.info = StageInfo(
            name=config.name, engine=config.engine, output=config.output,
            defaults={**model_config.get_diff_sampling_param(), **derived,
                      **config.sampling_params},
            inputs=input_modalities(model_config), family=model_config.architecture,
            max_model_len=model_config.max_model_len,
            max_running=self.engine.vllm_config.scheduler_config.max_num_seqs,
            vllm_config=self.engine.vllm_config)

    @property
    def renderer(self):
        return self.engine.renderer

    @classmethod
    def request_params(cls, info: StageInfo,
                       given: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        """SamplingParams for one request: given ones as they are, a dict over the defaults."""
        if isinstance(given, SamplingParams):
            return given
        unknown = sorted(set(given or {}) - set(SamplingParams.__struct_fields__))
        if unknown:
            raise ValueError(f"stage {info.name!r}: unknown sampling params {unknown}")
        try:
            return SamplingParams.from_optional(**{**info.defaults, **(given or {})})
        except TypeError as e:  # a value of the wrong type, from the request
            raise ValueError(f"stage {info.name!r}: invalid sampling params: {e}") from None

    async def render(self, prompts: list[PromptType | EngineInput]) -> list[EngineInput]:
        """Tokenize (and process multimodal data of) prompts in one batch, as vLLM's LLM does."""
        todo = [i for i, p in enumerate(prompts) if not is_engine_input(p)]
        if not todo:
            return list(prompts)
        parsed = [parse_model_prompt(self.info.model_config, prompts[i]) for i in todo]
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
        *,
        input_complete: bool = True,
        keep_hidden_states: bool = False,
    ) -> AsyncIterator[OmniRequestOutput]:
        """Run one request. `keep_hidden_states` (always, when the stage outputs them) also
        returns the request's hidden states and input embeddings as a shared-memory handle.
        A prompt dict may carry `step_inputs` = {"tensors": ShmHandle, "args": {...}} for a
        stage with `step_inputs` (see engine/ar/step_inputs.py)."""
        if not input_complete:
            raise ValueError(f"stage {self.name!r} takes no streamed input")
        output_type = self.config.output
        wants_hidden = output_type == "hidden_states" or keep_hidden_states
        extra = {}
        step_payload = None
        if isinstance(prompt, dict) and "step_inputs" in prompt:
            if not self.config.step_inputs:
                raise ValueError(f"stage {self.name!r} takes no step inputs")
            prompt = dict(prompt)
            given = prompt.pop("step_inputs")
            tensors = given["tensors"]
            if isinstance(tensors, ShmHandle):
                step_payload = tensors
            extra[step_inputs.REQUEST_KEY] = {
                "tensors": tensors.as_data() if isinstance(tensors, ShmHandle) else tensors,
                "args": given.get("args", {}),
            }
        if wants_hidden:
            extra[hidden_states.REQUEST_KEY] = request_id
        # Outputs are cumulative (the contract): the stages downstream read the whole
        # output so far, and a caller that streams makes its own deltas.
        cumulative = sampling_params.output_kind == RequestOutputKind.DELTA
        if extra or cumulative:
            sampling_params = sampling_params.clone()
            if extra:
                sampling_params.extra_args = {**(sampling_params.extra_args or {}), **extra}
            if cumulative:
                sampling_params.output_kind = RequestOutputKind.CUMULATIVE
        try:
            (engine_input,) = await self.render([prompt])
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
        finally:
            # Every rank read the step inputs when the request was first scheduled.
            if step_payload is not None:
                SharedMemoryConnector().discard(step_payload)

    async def ping(self) -> None:
        # A utility call: vLLM's engine core answers it from its busy loop, between steps.
        await self.engine.is_sleeping()

    async def _take_hidden_states(self, key: str) -> dict[str, Any]:
        replies = await self.engine.collective_rpc("take_hidden_states", args=(key,))
        found = [r for r in replies if r is not None]
        return {"hidden_states": ShmHandle.from_data(found[0])} if found else {}
