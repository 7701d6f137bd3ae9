"""OmniRequestOutput: what every caller (OmniLLM, AsyncOmniLLM, the server) gets back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch
    from PIL.Image import Image
    from vllm.outputs import CompletionOutput


@dataclass
class AudioOutput:
    """A mono waveform in [-1, 1] and its sample rate (taken from the model)."""

    waveform: np.ndarray
    sample_rate: int


@dataclass
class VideoOutput:
    """A video: its frames (PIL, in order) and the rate they are played at."""

    frames: list[Image]
    fps: int

    @property
    def seconds(self) -> float:
        return len(self.frames) / self.fps


@dataclass
class OmniRequestOutput:
    """One output of one stage for one request, the same shape for every modality.

    Which fields are set follows the stage's `output` type in the pipeline config:

    - ``text`` / ``tokens``: ``outputs`` holds vLLM's ``CompletionOutput`` per choice
      (text, token_ids, finish_reason, logprobs): the whole text so far (stages report
      cumulative outputs; a stream's deltas are made by whoever streams).
    - ``image``: ``images`` holds PIL images (one per requested image); with the diffusion
      parameter ``float_output``, ``tensors["images"]`` also holds the float images they were
      rounded from (N, H, W, 3 in [0, 1]); ``metrics`` has ``step`` / ``num_steps``
      (progress while not finished) and ``seed``.
    - ``video``: ``video`` holds the frames (PIL) and fps (with ``float_output``,
      ``tensors["video"]`` the float frames, F, H, W, 3 in [0, 1]); ``metrics`` as for images.
    - ``audio``: ``audio`` holds the waveform so far (a streamed request gets one output per
      chunk; ``metrics["new_samples"]`` is what the chunk added); ``metrics["input_complete"]``
      says whether all codes had arrived when it was made.
    - ``latent`` / ``hidden_states``: ``tensors`` holds named tensors (for hidden states:
      ``hidden_states``, one row per prompt token then one per decode step, as HF's last
      ``hidden_states``), alongside ``outputs``.

    ``finished`` is true on the stage's last output for the request. ``metrics["stage_seconds"]``
    is the orchestrator's per-stage time of the request, complete once the request is.
    """

    request_id: str
    stage: str
    output_type: str
    finished: bool
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    images: list[Image] = field(default_factory=list)
    audio: AudioOutput | None = None
    video: VideoOutput | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    num_cached_tokens: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    # Tensors still in a connector (shared memory, Ray's object store): what travels
    # between stages. The orchestrator resolves them into `tensors` only for outputs
    # returned to the caller.
    tensor_handles: dict[str, Any] = field(default_factory=dict)
    # A stage that ran several prompts for the request (a PromptGroup): every prompt's
    # finished output, in the group's order (this one first).
    parts: list[OmniRequestOutput] = field(default_factory=list)

    def resolve_tensors(self) -> None:
        from vllm_omni.transfer.connectors import connector_for

        for handle in self.tensor_handles.values():
            self.tensors.update(connector_for(handle).get(handle))
        self.tensor_handles = {}

    def discard_tensors(self) -> None:
        """Free payloads still in a connector (a no-op for ones already read)."""
        from vllm_omni.transfer.connectors import connector_for

        for handle in self.tensor_handles.values():
            connector_for(handle).discard(handle)
        self.tensor_handles = {}
        for part in self.parts:
            if part is not self:
                part.discard_tensors()

    @property
    def text(self) -> str | None:
        """The first choice's text (None when the stage does not output text)."""
        return self.outputs[0].text if self.outputs else None

    @property
    def token_ids(self) -> list[int] | None:
        return list(self.outputs[0].token_ids) if self.outputs else None

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.outputs)
