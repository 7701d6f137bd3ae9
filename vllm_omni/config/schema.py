"""The pipeline config: one pydantic model that every layer reads.

A pipeline is a graph of stages. Each stage names the stages that feed it; the orchestrator
runs them in topological order and hands each stage's outputs to its consumers through the
consumer's input processor.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from vllm_omni.config.kinds import Capability, kind_names, stage_kind

OutputType = Literal["text", "tokens", "hidden_states", "image", "video", "audio", "latent"]

# The `modalities` a request can ask for, by stage output type.
MODALITY_OF_OUTPUT: dict[str, str] = {
    "text": "text",
    "tokens": "text",
    "hidden_states": "hidden_states",
    "image": "image",
    "video": "video",
    "audio": "audio",
    "latent": "latent",
}

class Placement(BaseModel):
    """Where a stage runs and how much memory it may hold (weights, KV cache, activations)."""

    model_config = ConfigDict(extra="forbid")

    device: str = Field(default="cpu", pattern=r"^(cpu|cuda(:\d+)?)$")
    memory_gib: float | None = Field(default=None, gt=0)
    cores: list[int] | None = Field(
        default=None, min_length=1,
        description="AR stages on CPU: the cores the stage's ranks run on, split evenly over "
        "them (tensor_parallel_size x pipeline_parallel_size); default: the cores this "
        "process may use. Ignored where VLLM_CPU_OMP_THREADS_BIND is set.",
    )

    resources: dict[str, float] = Field(
        default_factory=dict,
        description="On a Ray cluster (--ray-address): Ray custom resources the stage's actor "
        "requires, e.g. {node_b: 1}, which pin it to the nodes that offer them. CPUs and GPUs "
        "follow from the device and the stage's ranks. Ignored without --ray-address.",
    )

    @field_validator("resources")
    @classmethod
    def _positive_resources(cls, value: dict[str, float]) -> dict[str, float]:
        bad = sorted(k for k, v in value.items() if v <= 0 or k in ("CPU", "GPU"))
        if bad:
            raise ValueError(f"resources {bad}: amounts must be positive, and CPU / GPU follow "
                             "from the device and ranks")
        return value

    @field_validator("cores")
    @classmethod
    def _distinct_cores(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (len(set(value)) != len(value) or min(value) < 0):
            raise ValueError(f"cores must be distinct core ids, got {value}")
        return value


class StageConfig(BaseModel):
    """One stage of a pipeline."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_\-]*$")
    engine: str = Field(
        default="ar",
        description="The stage kind (config/kinds.py): 'ar', 'diffusion', 'code2wav', or one "
        "a plugin registered.",
    )
    model: str | None = Field(
        default=None, description="Model folder; default: the model the pipeline was loaded for."
    )
    subfolder: str | None = Field(
        default=None,
        description="AR stages: the stage's model is this folder inside the pipeline's model "
        "(a diffusers folder's 'text_encoder'); a relative `engine_args.tokenizer` is read "
        "from the pipeline's model too.",
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Engine args of the stage's kind: vLLM's AsyncEngineArgs for 'ar', "
        "EngineOptions for 'diffusion', Code2WavOptions for 'code2wav'.",
    )
    sampling_params: dict[str, Any] = Field(
        default_factory=dict,
        description="Request defaults: SamplingParams for 'ar', DiffusionParams for "
        "'diffusion', code2wav's parameters for 'code2wav'.",
    )
    sampling_defaults: str | None = Field(
        default=None,
        description="AR stages: 'module:function' giving request defaults from the model's HF "
        "config (ids that differ per checkpoint); `sampling_params` still win.",
    )
    inputs: list[str] = Field(default_factory=list, description="Stages that feed this one.")
    stream_inputs: dict[str, int] = Field(
        default_factory=dict,
        description="Edges passed in chunks: upstream stage -> every how many of its tokens "
        "this stage gets the upstream's output so far. This stage starts on the first chunk "
        "instead of waiting for the whole upstream request. Only kinds that take streamed "
        "input (code2wav).",
    )
    input_processor: str | None = Field(
        default=None,
        description="'module:function' turning upstream outputs into this stage's prompt.",
    )
    output: OutputType = "text"
    final_output: bool = False
    hidden_states: bool = Field(
        default=False,
        description="AR stages: also keep the hidden states and input embeddings of each "
        "request for the stages this one feeds (its own output stays `output`).",
    )
    step_inputs: bool = Field(
        default=False,
        description="AR stages: the model reads per-position inputs that the input processor "
        "sends along with the prompt (Qwen2.5-Omni's talker).",
    )
    placement: Placement | None = Field(
        default=None, description="Device and memory budget, checked at start-up."
    )
    weights_prefix: str | None = Field(
        default=None,
        description="Name prefix of the checkpoint tensors this stage loads, where stages "
        "share one checkpoint (Qwen2.5-Omni's 'thinker.'); the memory plan counts only "
        "those. Default: every tensor of the stage's model.",
    )

    @property
    def keeps_hidden_states(self) -> bool:
        return self.hidden_states or self.output == "hidden_states"

    @field_validator("input_processor", "sampling_defaults")
    @classmethod
    def _dotted_path(cls, value: str | None) -> str | None:
        if value is not None and (value.count(":") != 1 or not all(value.split(":"))):
            raise ValueError(f"must look like 'package.module:function', got {value!r}")
        return value

    @field_validator("engine")
    @classmethod
    def _known_kind(cls, value: str) -> str:
        stage_kind(value)  # raises, naming the known kinds
        return value

    @field_validator("engine_args")
    @classmethod
    def _known_engine_args(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "engine" in info.data:
            stage_kind(info.data["engine"]).check_engine_args(value)
        return value

    @field_validator("sampling_params")
    @classmethod
    def _known_sampling_params(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "engine" in info.data:
            stage_kind(info.data["engine"]).check_sampling_params(value)
        return value

    @model_validator(mode="after")
    def _output_matches_engine(self) -> StageConfig:
        kind = stage_kind(self.engine)
        if self.output not in kind.outputs:
            raise ValueError(
                f"engine {self.engine!r} cannot output {self.output!r} "
                f"(it can output {sorted(kind.outputs)})"
            )
        if self.inputs and self.input_processor is None:
            raise ValueError("a stage with inputs needs an input_processor")
        if (Capability.HIDDEN_STATES not in kind.capabilities
                and (self.hidden_states or self.step_inputs)):
            raise ValueError("hidden_states and step_inputs are options of "
                             f"{_takers(Capability.HIDDEN_STATES)} stages")
        if Capability.SUBFOLDER not in kind.capabilities and self.subfolder is not None:
            raise ValueError(f"subfolder is an option of {_takers(Capability.SUBFOLDER)} stages")
        if self.stream_inputs:
            if Capability.STREAMED_INPUT not in kind.capabilities:
                takers = [k for k in kind_names()
                          if Capability.STREAMED_INPUT in stage_kind(k).capabilities]
                raise ValueError(f"stream_inputs: only {', '.join(takers)} stages take "
                                 "streamed input")
            if list(self.stream_inputs) != self.inputs or len(self.inputs) != 1:
                raise ValueError("stream_inputs must name the stage's one input")
            if min(self.stream_inputs.values()) < 1:
                raise ValueError("stream_inputs: chunks must have at least 1 token")
        return self


class PipelineConfig(BaseModel):
    """A graph of stages, declared once in YAML."""

    model_config = ConfigDict(extra="forbid")

    name: str
    architectures: list[str] = Field(
        default_factory=list,
        description="What this built-in pipeline serves: HF architectures (config.json) or "
        "diffusers pipeline classes (model_index.json's _class_name).",
    )
    stages: list[StageConfig] = Field(min_length=1)
    default_modalities: list[str] | None = Field(
        default=None,
        description="What a request that names no `modalities` gets; default: every final output.",
    )
    fallback: str | None = Field(
        default=None,
        description="A built-in pipeline serving the same models in fewer stages (diffusers "
        "running a whole request, say): offered when a stage of this one cannot start.",
    )
    system_prompts: dict[str, str] = Field(
        default_factory=dict,
        description="Output modality -> the system message a chat request asking for it gets "
        "when it brings none (a model may need one to speak, say).",
    )

    @model_validator(mode="after")
    def _valid_graph(self) -> PipelineConfig:
        names = [s.name for s in self.stages]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"stage names must be unique, repeated: {dupes}")
        for stage in self.stages:
            missing = [i for i in stage.inputs if i not in names]
            if missing:
                raise ValueError(f"stage {stage.name!r}: inputs name unknown stages {missing}")
        self.topological_order()  # raises on cycles
        if not any(s.final_output for s in self.stages):
            raise ValueError("no stage has final_output: true, so the pipeline returns nothing")
        offered = {MODALITY_OF_OUTPUT[s.output] for s in self.stages if s.final_output}
        unknown = sorted(set(self.default_modalities or []) - offered)
        if unknown:
            raise ValueError(
                f"default_modalities {unknown} are not final outputs {sorted(offered)}"
            )
        return self

    def stage(self, name: str) -> StageConfig:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"pipeline {self.name!r} has no stage {name!r}")

    def topological_order(self) -> list[StageConfig]:
        """Stages so that each comes after every stage that feeds it."""
        done: list[str] = []
        pending = list(self.stages)
        while pending:
            ready = [s for s in pending if all(i in done for i in s.inputs)]
            if not ready:
                raise ValueError(f"stage inputs form a cycle among {[s.name for s in pending]}")
            done += [s.name for s in ready]
            pending = [s for s in pending if s not in ready]
        return [self.stage(n) for n in done]

    def consumers(self, name: str) -> list[StageConfig]:
        return [s for s in self.stages if name in s.inputs]


def _takers(capability: Capability) -> str:
    """The kinds with a capability, as a config error names them ('ar')."""
    return ", ".join(repr(k) for k in kind_names() if capability in stage_kind(k).capabilities)
