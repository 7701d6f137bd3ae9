"""What every endpoint's serving shares: the served model, a request's per-stage parameters,
the entry stage's renderer, and the helpers of streamed answers and their errors."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from vllm import SamplingParams
from vllm.entrypoints.serve.engine.protocol import UsageInfo
from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
from vllm.exceptions import VLLMValidationError
from vllm.renderers.online_renderer import OnlineRenderer
from vllm.v1.engine.exceptions import EngineDeadError

from vllm_omni.entrypoints.async_omni_llm import AsyncOmniLLM
from vllm_omni.entrypoints.openai.protocol import (
    OmniChatCompletionRequest,
    OmniCompletionRequest,
    OmniHTTPError,
    check_stage_names,
    error_body,
)
from vllm_omni.errors import StageError
from vllm_omni.outputs import OmniRequestOutput

TextRequest = OmniChatCompletionRequest | OmniCompletionRequest


class EntryRenderer:
    """vLLM's own renderer for the entry stage, so a prompt is the same token for token as
    under `vllm serve`; None for a pipeline without a text stage (a diffusion model), which
    takes its prompts unrendered. Rebuilt when the entry stage is (a restarted stage has a
    new engine, and its renderer with it)."""

    def __init__(
        self,
        omni: AsyncOmniLLM,
        *,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        default_chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.omni = omni
        self.settings = {
            "chat_template": chat_template,
            "chat_template_content_format": chat_template_content_format,
            "default_chat_template_kwargs": default_chat_template_kwargs,
        }
        self._stage: Any = None
        self._renderer: OnlineRenderer | None = None

    def get(self) -> OnlineRenderer | None:
        if self.omni.text_stage is None:
            return None
        # A restarting entry stage's old renderer is shut down: refuse (503), not a 400.
        self.omni.orchestrator.check_available({self.omni.order[0].name})
        entry = self.omni.entry_stage
        if entry is not self._stage:
            self._renderer = OnlineRenderer(entry.info.model_config, entry.renderer,
                                            request_logger=None, **self.settings)
            self._stage = entry
        return self._renderer


class OmniServing:
    """The base of the endpoint servings: the pipeline (`omni`), the names it is served under,
    and the renderer of its entry stage (None when the pipeline takes prompts unrendered).

    Every request's `stage_sampling_params` pass through `stage_overrides`, so each endpoint
    refuses a stage name the pipeline does not have in the same words."""

    def __init__(
        self,
        omni: AsyncOmniLLM,
        served_model_names: list[str],
        renderer: EntryRenderer | None = None,
    ) -> None:
        self.omni = omni
        self.served_model_names = served_model_names
        self._renderer = renderer

    @property
    def renderer(self) -> OnlineRenderer | None:
        return self._renderer.get() if self._renderer is not None else None

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def hearing_rate(self) -> int | None:
        """The sample rate the model's audio feature extractor takes; None for a model that
        has none. Uploads at other rates are resampled to it here: vLLM would resample with
        torchaudio, which the CPU install cannot have."""
        if not hasattr(self, "_hearing_rate"):
            from transformers import AutoFeatureExtractor

            try:
                extractor = AutoFeatureExtractor.from_pretrained(self.omni.model)
            except Exception:  # no preprocessor config, or none of audio: it does not hear
                extractor = None
            self._hearing_rate = getattr(extractor, "sampling_rate", None)
        return self._hearing_rate

    def check_model(self, model: str | None, adapters: bool = False) -> None:
        """A 404 for a model this server does not serve; with `adapters`, the LoRA
        adapters' names are models too (the endpoints that draw)."""
        if model is None or model in self.served_model_names:
            return
        if adapters and model in self.omni.adapters:
            return
        raise OmniHTTPError(HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist.",
                            "model")

    def adapter_params(self, model: str | None, scale: float | None) -> dict[str, Any]:
        """The diffusion parameters that select the request's adapter (its `model`)."""
        if model is not None and model in self.omni.adapters:
            return {"lora": model, **({"lora_scale": scale} if scale is not None else {})}
        if scale is not None:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, "lora_scale: the request's model is "
                                "not a LoRA adapter (GET /v1/models lists them)", "lora_scale")
        return {}

    # -- per-stage parameters ------------------------------------------------------------

    @property
    def stage_names(self) -> list[str]:
        """The pipeline's stages in declaration order, the order generate() takes them in."""
        return [s.name for s in self.omni.pipeline.stages]

    def stage_overrides(
        self, given: dict[str, dict[str, Any]] | None, under: dict[str, dict] | None = None
    ) -> dict[str, Any]:
        """A request's parameters by stage name: `given` (its `stage_sampling_params`) over
        `under` (what the request's other fields mean for a stage, like the voice); a 400
        for a stage the pipeline does not have."""
        overrides = dict(given or {})
        for name, values in (under or {}).items():
            overrides[name] = {**values, **overrides.get(name, {})}
        check_stage_names(overrides, self.stage_names)
        return overrides

    def in_stage_order(self, by_stage: dict[str, Any]) -> list[Any]:
        """One entry per stage (None for its defaults), as generate() takes them."""
        return [by_stage.get(name) for name in self.stage_names]

    def text_request_params(
        self, request: TextRequest, prompt_len: int, under: dict[str, dict] | None = None
    ) -> list[SamplingParams]:
        """The sampling of every stage for a chat or completion request: the text stage takes
        the request's OpenAI fields, the other stages their defaults, then `under`;
        `stage_sampling_params` overrides either, per stage."""
        overrides = self.stage_overrides(request.stage_sampling_params, under)
        text_stage = self.omni.text_stage
        name = text_stage.name
        stage_request = request
        if name in overrides:
            bad = sorted(set(overrides[name]) - set(type(request).model_fields))
            if bad:
                raise OmniHTTPError(
                    HTTPStatus.BAD_REQUEST,
                    f"stage_sampling_params[{name!r}] has unknown fields {bad}",
                    "stage_sampling_params",
                )
            stage_request = type(request).model_validate(
                {**request.model_dump(exclude_unset=True), **overrides[name]}
            )
        max_tokens = get_max_tokens(
            text_stage.info.max_model_len,
            getattr(stage_request, "max_completion_tokens", None) or stage_request.max_tokens,
            prompt_len,
            text_stage.info.defaults,
        )
        overrides[name] = stage_request.to_sampling_params(max_tokens, text_stage.info.defaults)
        return self.omni.sampling_params_list(self.in_stage_order(overrides))


def reject_unsupported(request: TextRequest) -> None:
    """Fields whose output this server does not produce yet: a clear 400, not silence."""
    unsupported = {
        "logprobs": bool(request.logprobs),
        "echo": bool(getattr(request, "echo", False)),
        "suffix": getattr(request, "suffix", None) is not None,
        "tools": bool(getattr(request, "tools", None)),
        "use_beam_search": bool(getattr(request, "use_beam_search", False)),
    }
    for name, used in unsupported.items():
        if used:
            raise OmniHTTPError(
                HTTPStatus.BAD_REQUEST, f"'{name}' is not supported by vllm-omni yet", name
            )


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_info(prompt: int, generated: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated
    )


async def final_outputs(
    outputs: AsyncIterator[OmniRequestOutput],
) -> dict[str, OmniRequestOutput]:
    """The finished output of each output type (text, audio, ...)."""
    found = {}
    async for out in outputs:
        if out.finished:
            found[out.output_type] = out
    return found


async def primed(outputs: AsyncIterator[OmniRequestOutput]) -> AsyncIterator[OmniRequestOutput]:
    """Wait for the first output, so errors the engine finds in a request become an HTTP
    error before the stream's 200 is sent; the returned iterator replays it."""
    first = await anext(outputs)

    async def replay() -> AsyncIterator[OmniRequestOutput]:
        yield first
        async for out in outputs:
            yield out

    return replay()


# -- streamed answers and errors ---------------------------------------------------------


@dataclass
class TextDelta:
    """What one choice of a text output added since the last one a stream sent."""

    index: int
    text: str
    num_tokens: int
    finish_reason: str | None
    stop_reason: int | str | None


class TextDeltas:
    """The deltas a stream sends, made from a text stage's cumulative outputs (stages
    report the whole output so far; the contract in engine/stage.py)."""

    def __init__(self) -> None:
        self.sent: dict[int, tuple[int, int]] = {}  # per choice: characters, tokens

    def take(self, out: OmniRequestOutput) -> list[TextDelta]:
        """The new part of each choice that has one (or that just finished)."""
        deltas = []
        for c in out.outputs:
            chars, tokens = self.sent.get(c.index, (0, 0))
            self.sent[c.index] = (len(c.text), len(c.token_ids))
            delta = TextDelta(c.index, c.text[chars:], len(c.token_ids) - tokens,
                              c.finish_reason, c.stop_reason)
            if delta.text or delta.finish_reason is not None:
                deltas.append(delta)
        return deltas

    @property
    def generated(self) -> int:
        """Tokens generated so far, over every choice."""
        return sum(tokens for _, tokens in self.sent.values())


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def error_status(e: BaseException) -> tuple[HTTPStatus, str, str | None]:
    """The HTTP status an exception raised while serving a request maps to."""
    if isinstance(e, OmniHTTPError):
        return e.status, e.message, e.param
    if isinstance(e, StageError):
        status, message, param = error_status(e.cause)
        return status, f"stage {e.stage!r}: {message}", param
    if isinstance(e, VLLMValidationError):
        return HTTPStatus.BAD_REQUEST, str(e), getattr(e, "parameter", None)
    if isinstance(e, ValueError):  # validation; a TypeError is a bug, so a 500
        return HTTPStatus.BAD_REQUEST, str(e), None
    if isinstance(e, EngineDeadError):
        # vLLM puts its generic message first; the why given on raising it is the rest.
        why = "; ".join(str(a) for a in e.args[1:]) or str(e)
        return HTTPStatus.SERVICE_UNAVAILABLE, "the engine is not running: " + why, None
    return HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}", None


def error_event(e: BaseException) -> str:
    """The SSE event of an error met once a stream's headers are sent (so the status is
    already 200): the error body its status would have carried."""
    return sse(json.dumps(error_body(*error_status(e))))
