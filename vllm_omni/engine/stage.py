"""The stage contract: what the orchestrator may ask of a stage, whatever its engine.

A stage kind is a class implementing `StageKind` (its class-level facts and checks) whose
instances implement `Stage`. Kinds are registered by name in config/kinds.py; the
orchestrator reaches every stage through these two interfaces only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    from vllm_omni.config.schema import StageConfig
    from vllm_omni.engine.memory import StagePlan
    from vllm_omni.outputs import OmniRequestOutput


@dataclass
class StartContext:
    """What a stage is planned and started with beside its own config."""

    model: str  # the model the pipeline is served for (a stage's own `model` wins)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # the caller's engine args
    usage_context: Any = None  # vLLM's UsageContext
    cache_config: dict[str, Any] | None = None  # the server's step caching (diffusion)
    # Each stage's share of the memory plan (orchestrator/memory.py), set once planned,
    # before stages start.
    stage_plans: dict[str, StagePlan] | None = None
    # Degrees for every diffusion stage (ulysses_degree, ring_degree, cfg_parallel_size),
    # over the stages' own engine_args (the CLI's --ulysses-degree...).
    diffusion_parallel: dict[str, int] | None = None
    # LoRA adapters (name -> file) the stages with the `adapters` capability serve; kept
    # current as adapters are loaded at run time, so a restarted stage serves them too.
    lora_modules: dict[str, str] = field(default_factory=dict)
    # Where stages start: None, in this process through their kind; a Ray cluster's
    # launcher (cluster/stage.py) starts each as an actor and returns its proxy.
    launcher: Callable[[StageConfig, StartContext], Stage] | None = None


def start_stage(config: StageConfig, context: StartContext) -> Stage:
    """Start a stage where the context says: through its launcher, else its kind."""
    from vllm_omni.config.kinds import stage_kind

    if context.launcher is not None:
        return context.launcher(config, context)
    return stage_kind(config.engine).start(config, context)


@dataclass(frozen=True)
class StageInfo:
    """What callers may know of a running stage, the same on one host and on a cluster
    (plain data: a Ray proxy holds the copy its actor made at start)."""

    name: str
    engine: str  # its kind's name
    output: str
    # Request defaults: an AR stage's sampling, a diffusion stage's size, steps...
    defaults: dict[str, Any] = field(default_factory=dict)
    inputs: tuple[str, ...] = ("text",)  # modalities its prompts may carry
    family: str | None = None  # the model family (diffusion: flux, wan...)
    takes_images: bool = False  # image inputs (edits, image-to-video)
    step_level: bool = False  # batched step by step (not one request at a time)
    # Bounds a request is checked against before it queues: size_multiple, frame_step,
    # max_image_pixels (None: the engine checks alone).
    limits: dict[str, Any] = field(default_factory=dict)
    voices: tuple[str, ...] = ()
    sample_rate: int | None = None
    max_model_len: int | None = None
    # Most requests it runs at once (an AR stage's max_num_seqs, a DiT's running limit);
    # more wait in its queue. None: no bound it knows.
    max_running: int | None = None
    # An AR stage's vLLM config: what a renderer and a tokenizer are built from.
    vllm_config: Any = None

    @property
    def model_config(self) -> Any:
        return self.vllm_config.model_config if self.vllm_config is not None else None


@runtime_checkable
class Stage(Protocol):
    """One running stage of a pipeline.

    `generate` takes the stage's prompt (what its input processor made, or the request's
    prompt for an entry stage) and its parameters (from `sampling_params`), and yields
    `OmniRequestOutput`s until one with `finished`. With `input_complete` false, the prompt
    is the first part of the input and `add_input` brings the rest (a streamed edge; only
    kinds with the `streamed_input` capability are given one). With `keep_hidden_states`,
    the finished output carries the request's hidden states as
    `tensor_handles["hidden_states"]` (AR kinds). Leaving the iteration early stops the
    request in the engine.

    Outputs are cumulative: each holds the whole output so far (text and tokens, audio),
    whatever the parameters ask for (a caller that wants deltas makes them); parameters
    asking for the final output only get one output, the finished one.
    """

    name: str
    config: StageConfig
    info: StageInfo
    # Renders prompts in this process (vLLM's renderer, from `info.vllm_config`): chat
    # templates, tokenizer, multimodal processing. None for kinds that take prompts as
    # they come.
    renderer: Any

    def sampling_params(self, given: Any) -> Any:
        """The request's parameters for this stage: `given` ones as they are, or a dict of
        overrides (None for none) over the stage's defaults. ValueError for bad ones."""

    async def render(self, prompts: list[Any]) -> list[Any]:
        """Prompts in the form `generate` takes, in one batch (tokenized, for AR stages)."""

    def generate(
        self,
        request_id: str,
        prompt: Any,
        params: Any,
        *,
        input_complete: bool = True,
        keep_hidden_states: bool = False,
    ) -> AsyncIterator[OmniRequestOutput]: ...

    async def add_input(self, request_id: str, prompt: Any, complete: bool) -> None:
        """The input so far of a request started with `input_complete` false."""

    async def abort(self, request_id: str) -> None: ...

    async def check_health(self) -> None:
        """Raises when the stage's engine is dead."""

    async def ping(self) -> None:
        """Returns once the engine's loop has answered: a watchdog's probe of a live but
        possibly hung engine (it answers between steps)."""

    @property
    def errored(self) -> bool: ...

    def shutdown(self) -> None:
        """Stop the engine and its processes; a hung one is killed."""


class StageKind(Protocol):
    """The class of a stage kind: facts and checks that need no running engine."""

    outputs: ClassVar[frozenset[str]]  # the output types its stages can make
    # What it can do beyond this contract, by name (config/kinds.py's `Capability`).
    capabilities: ClassVar[frozenset[str]]

    @classmethod
    def check_engine_args(cls, args: dict[str, Any]) -> None:
        """ValueError naming engine args this kind does not know."""

    @classmethod
    def check_sampling_params(cls, params: dict[str, Any]) -> None:
        """ValueError for request defaults this kind would refuse."""

    @classmethod
    def request_params(cls, info: StageInfo, given: Any) -> Any:
        """A running stage's `sampling_params`, from its info alone (so a proxy of a stage
        elsewhere answers it without asking the stage)."""

    @classmethod
    def default_device(cls, config: StageConfig, ar_device_type: str) -> str:
        """The device of a stage without a placement."""

    @classmethod
    def placement_problems(cls, config: StageConfig, device: str,
                           ar_device_type: str) -> list[str]:
        """Why this kind cannot run the stage on `device` (sentences naming the stage)."""

    @classmethod
    def memory_needs(cls, config: StageConfig, context: StartContext,
                     device: str) -> StagePlan:
        """What the stage will hold, from its model's files; starts nothing."""

    @classmethod
    def joint_problems(cls, plans: list[StagePlan]) -> list[str]:
        """Why the plans of this kind's stages cannot all start together (sentences)."""

    @classmethod
    def apply_budget(cls, plan: StagePlan, device_totals: dict[str, int]) -> None:
        """Turn the plan's budget into the stage's engine settings (`plan.engine_args`),
        once the pipeline's plan is settled; `device_totals`: bytes of each device."""

    @classmethod
    def start(cls, config: StageConfig, context: StartContext) -> Stage:
        """Start the stage's engine; returns once it serves."""


class EngineStage:
    """Abort, health and shutdown of a stage over one engine client (vLLM's AsyncLLM or the
    runtime's EngineClient offer them under the same names), and the defaults of the
    optional parts of the contract."""

    engine: Any
    name: str
    info: StageInfo
    renderer: Any = None
    capabilities: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def joint_problems(cls, plans: list[StagePlan]) -> list[str]:
        return []

    @classmethod
    def apply_budget(cls, plan: StagePlan, device_totals: dict[str, int]) -> None:
        pass  # engines that size nothing from a budget

    def sampling_params(self, given: Any) -> Any:
        return self.request_params(self.info, given)

    @classmethod
    def default_device(cls, config: StageConfig, ar_device_type: str) -> str:
        return config.engine_args.get("device", "cpu")

    @classmethod
    def placement_problems(cls, config: StageConfig, device: str,
                           ar_device_type: str) -> list[str]:
        return []

    async def render(self, prompts: list[Any]) -> list[Any]:
        return list(prompts)  # non-AR engines take prompts as they come

    async def add_input(self, request_id: str, prompt: Any, complete: bool) -> None:
        raise ValueError(f"stage {self.name!r} takes no streamed input")

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def ping(self) -> None:
        await self.engine.ping()

    @property
    def errored(self) -> bool:
        return self.engine.errored

    def shutdown(self) -> None:
        self.engine.shutdown()
