"""Chat and text completions over AsyncOmniLLM.

Requests are rendered (chat template, tokenization, length checks) by vLLM's own
OnlineRenderer for the pipeline's entry stage, so a prompt is the same token for token as
under `vllm serve`. Responses use vLLM's OpenAI response models.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from vllm import SamplingParams
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm.entrypoints.serve.engine.protocol import UsageInfo
from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
from vllm.exceptions import VLLMValidationError
from vllm.inputs import EngineInput
from vllm.renderers.online_renderer import OnlineRenderer
from vllm.v1.engine.exceptions import EngineDeadError

from vllm_omni.entrypoints.async_omni_llm import AsyncOmniLLM
from vllm_omni.entrypoints.openai.audio import (
    STREAMABLE,
    AudioPieces,
    audio_b64,
    check_voice_and_format,
)
from vllm_omni.entrypoints.openai.images import ImageServing, chat_image_prompt, encode_image
from vllm_omni.entrypoints.openai.protocol import (
    AudioOutputParams,
    OmniChatCompletionRequest,
    OmniCompletionRequest,
    OmniHTTPError,
    check_stage_names,
    raise_for_error,
)
from vllm_omni.entrypoints.openai.speech import SpeechServing
from vllm_omni.errors import StageError
from vllm_omni.outputs import AudioOutput, OmniRequestOutput

# What a chat message can carry, by stage output type.
CHAT_OUTPUTS = {"text", "image", "audio"}

Request = OmniChatCompletionRequest | OmniCompletionRequest


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def _reject_unsupported(request: Request) -> None:
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


class OpenAIServing:
    def __init__(
        self,
        omni: AsyncOmniLLM,
        served_model_names: list[str],
        *,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        default_chat_template_kwargs: dict[str, Any] | None = None,
        response_role: str = "assistant",
    ) -> None:
        self.omni = omni
        self.served_model_names = served_model_names
        self.response_role = response_role
        self.images = ImageServing(omni, self.check_model)
        entry = omni.entry_stage
        # Pipelines without an AR entry stage (a diffusion model) take prompts unrendered.
        self.renderer = None
        if omni.text_stage is not None:
            self.renderer = OnlineRenderer(
                entry.model_config,
                entry.renderer,
                request_logger=None,
                chat_template=chat_template,
                chat_template_content_format=chat_template_content_format,
                default_chat_template_kwargs=default_chat_template_kwargs,
            )
        self.speech = SpeechServing(omni, self.renderer, self.check_model)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise OmniHTTPError(
                HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist.", "model"
            )

    # -- sampling -----------------------------------------------------------------------

    def sampling_params_list(
        self, request: Request, prompt_len: int, extra: dict[str, dict] | None = None
    ) -> list[SamplingParams]:
        """The text stage takes the request's OpenAI fields; other stages their defaults,
        then `extra` (what other request fields mean for a stage, like the voice).
        `stage_sampling_params` overrides either, per stage."""
        overrides = dict(request.stage_sampling_params or {})
        for name, values in (extra or {}).items():
            overrides[name] = {**values, **overrides.get(name, {})}
        names = [s.name for s in self.omni.pipeline.stages]
        check_stage_names(overrides, names)
        text_stage = self.omni.text_stage
        params: list[SamplingParams | dict[str, Any] | None] = []
        for name in names:
            if name != text_stage.name:
                params.append(overrides.get(name))
                continue
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
                text_stage.max_model_len,
                getattr(stage_request, "max_completion_tokens", None) or stage_request.max_tokens,
                prompt_len,
                text_stage.default_sampling,
            )
            params.append(stage_request.to_sampling_params(max_tokens, text_stage.default_sampling))
        return self.omni.sampling_params_list(params)

    # -- chat ---------------------------------------------------------------------------

    async def chat(self, request: OmniChatCompletionRequest, request_id: str):
        """A ChatCompletionResponse, or an async iterator of SSE lines when streaming."""
        self.check_model(request.model)
        _reject_unsupported(request)
        if self.renderer is None:
            return await self._chat_image(request, request_id)
        self._check_chat_answer(request)
        extra = self._audio_params(request)
        request = self._with_system_prompt(request)
        _, engine_inputs = raise_for_error(await self.renderer.render_chat(request))
        (engine_input,) = engine_inputs
        prompt_len = len(engine_input["prompt_token_ids"])
        params = self.sampling_params_list(request, prompt_len, extra)
        outputs = self.omni.generate(engine_input, params, request_id, request.modalities)
        if request.stream:
            outputs = await _primed(outputs)
            return self._chat_stream(request, request_id, outputs, prompt_len)
        return await self._chat_full(request, request_id, outputs, prompt_len)

    def _check_chat_answer(self, request: OmniChatCompletionRequest) -> None:
        """A chat answer carries text, images or audio: refuse a request whose final outputs
        are none of them before any stage runs."""
        try:
            _, returned = self.omni.plan(request.modalities)
        except ValueError as e:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, str(e), "modalities") from None
        outputs = sorted({self.omni.pipeline.stage(n).output for n in returned})
        if not set(outputs) & CHAT_OUTPUTS:
            raise OmniHTTPError(
                HTTPStatus.BAD_REQUEST,
                f"pipeline {self.omni.pipeline.name!r} answers this request with {outputs}; "
                f"a chat message carries {sorted(CHAT_OUTPUTS)}", "modalities")

    def _with_system_prompt(self, request: OmniChatCompletionRequest) -> OmniChatCompletionRequest:
        """The request with the pipeline's system prompt for an output it asks for, when it
        brings no system message of its own."""
        prompts = self.omni.pipeline.system_prompts
        modalities = request.modalities or self.omni.pipeline.default_modalities or []
        wanted = [prompts[m] for m in modalities if m in prompts]
        first = request.messages[0] if request.messages else {}
        role = first.get("role") if isinstance(first, dict) else getattr(first, "role", None)
        if not wanted or role == "system":
            return request
        system = {"role": "system", "content": wanted[0]}
        return request.model_copy(update={"messages": [system, *request.messages]})

    def _audio_params(self, request: OmniChatCompletionRequest) -> dict[str, dict]:
        """Checks an audio answer can be made; the voice as the audio stage's parameter."""
        if "audio" not in (request.modalities or []):
            return {}
        stage = self.omni.audio_stage
        if stage is None:
            return {}  # the plan names the missing modality in its error
        if "text" not in request.modalities:  # as OpenAI: the transcript comes along
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, 'modalities with "audio" must also '
                                'have "text": ["text", "audio"]', "modalities")
        if (request.n or 1) != 1:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, "audio output supports n=1 only", "n")
        audio = request.audio or AudioOutputParams()
        check_voice_and_format(stage.speakers, audio.voice, audio.format, "audio.voice",
                               "audio.format")
        params: dict = {"speaker": audio.voice} if audio.voice else {}
        if request.stream and audio.format in STREAMABLE:
            params["stream"] = True  # audio chunk by chunk as the talker speaks
        return {stage.name: params} if params else {}

    async def _chat_image(self, request: OmniChatCompletionRequest, request_id: str) -> dict:
        """Chat with a diffusion pipeline: the last user message is the prompt, the answer's
        content is the images (as data URLs); `stage_sampling_params` carries the diffusion
        parameters (size, steps, seed, ...)."""
        prompt = chat_image_prompt(request.messages)
        stage = self.images.stage_name()
        overrides = dict(request.stage_sampling_params or {})
        diffusion = {"num_images": request.n or 1, **overrides.pop(stage, {})}
        # Made whole before answering: an error is an HTTP error, also for a stream.
        out = await self.images.generate_images(prompt, diffusion, request_id, overrides)
        if request.stream:
            return self._image_stream(request, request_id, out.images)
        return self._image_answer(request, request_id, out.images, _usage(0, 0),
                                  _stage_seconds([out]))

    async def _image_stream(self, request, request_id: str, images: list) -> AsyncIterator[str]:
        """A streamed chat answer of images only: the role, then the images as content
        parts in one delta (they are made whole, not token by token)."""
        model, created = request.model or self.model_name, int(time.time())
        for delta, finish in (({"role": self.response_role, "content": ""}, None),
                              ({"content": image_parts(images)}, "stop")):
            yield sse(json.dumps({
                "id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }))
        yield sse("[DONE]")

    async def _chat_full(self, request, request_id, outputs, prompt_len):
        finals = await _finals(outputs)
        seconds = _stage_seconds(finals.values())
        if "text" not in finals:  # a pipeline that answers with images only
            if "image" not in finals:
                raise OmniHTTPError(HTTPStatus.INTERNAL_SERVER_ERROR,
                                    f"the pipeline returned {sorted(finals)}, no text or image")
            return self._image_answer(request, request_id, finals["image"].images,
                                      _usage(prompt_len, 0), seconds)
        final = finals["text"]
        choices = [
            ChatCompletionResponseChoice(
                index=c.index,
                message=ChatMessage(role=self.response_role, content=c.text),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in final.outputs
        ]
        body = ChatCompletionResponse(
            id=request_id,
            model=request.model or self.model_name,
            choices=choices,
            usage=_usage(prompt_len, final.num_generated_tokens),
        ).model_dump(exclude_none=True)
        body["stage_seconds"] = seconds
        message = body["choices"][0]["message"]
        if "image" in finals:  # text and images: one message of content parts
            text = message.pop("content", None)
            message["content"] = ([{"type": "text", "text": text}] if text else []) + (
                image_parts(finals["image"].images))
        elif "audio" in finals:  # OpenAI's shape: the spoken answer, the text its transcript
            message["audio"] = self._audio_body(request, request_id, finals["audio"].audio,
                                                transcript=message.pop("content", None))
            message["content"] = None
        return body

    def _image_answer(self, request, request_id: str, images: list, usage: UsageInfo,
                      seconds: dict[str, float]) -> dict:
        """A chat completion whose message is the images, as data-URL content parts."""
        return {
            "stage_seconds": seconds,
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.model or self.model_name,
            "choices": [{
                "index": 0,
                "message": {"role": self.response_role, "content": image_parts(images)},
                "finish_reason": "stop",
            }],
            "usage": usage.model_dump(),
        }

    def _audio_body(self, request, request_id: str, audio: AudioOutput, **fields) -> dict:
        fmt = (request.audio or AudioOutputParams()).format
        return {
            "id": f"audio-{request_id}",
            "data": audio_b64(audio.waveform, audio.sample_rate, fmt),
            "expires_at": int(time.time()) + 3600,
            **fields,
        }

    async def _chat_stream(
        self, request, request_id, outputs: AsyncIterator[OmniRequestOutput], prompt_len: int
    ) -> AsyncIterator[str]:
        model = request.model or self.model_name
        created = int(time.time())
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        n = request.n or 1

        def chunk(choices: list, usage: UsageInfo | None = None, **fields) -> str:
            extra = {"usage": usage} if usage is not None else {}
            body = ChatCompletionStreamResponse(
                id=request_id, created=created, model=model, choices=choices, **extra
            ).model_dump(mode="json", exclude_unset=True)
            return sse(json.dumps({**body, **fields}))

        yield chunk(
            [
                ChatCompletionResponseStreamChoice(
                    index=i, delta=DeltaMessage(role=self.response_role, content="")
                )
                for i in range(n)
            ]
        )
        generated = 0
        speaking = "audio" in (request.modalities or []) and self.omni.audio_stage is not None

        def audio_chunk(audio: dict) -> str:  # OpenAI's delta.audio (transcript, then data)
            return sse(json.dumps({
                "id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [{"index": 0, "delta": {"audio": audio}}],
            }))

        seconds: dict[str, float] = {}
        try:
            pieces = AudioPieces((request.audio or AudioOutputParams()).format in STREAMABLE)
            async for out in outputs:
                seconds = out.metrics.get("stage_seconds", seconds)
                if out.output_type == "image":
                    if out.finished:
                        yield sse(json.dumps({
                            "id": request_id, "object": "chat.completion.chunk",
                            "created": created, "model": model,
                            "choices": [{"index": 0,
                                         "delta": {"content": image_parts(out.images)}}],
                        }))
                    continue
                if out.output_type == "audio":
                    new = pieces.take(out.audio.waveform, out.finished)
                    if new is not None:
                        audio = AudioOutput(new, out.audio.sample_rate)
                        yield audio_chunk(self._audio_body(request, request_id, audio))
                    continue
                if out.output_type != "text":
                    continue
                generated += out.num_generated_tokens
                if speaking:
                    text = "".join(c.text for c in out.outputs)
                    if text:
                        yield audio_chunk({"transcript": text})
                    continue
                choices = [
                    ChatCompletionResponseStreamChoice(
                        index=c.index,
                        delta=DeltaMessage(content=c.text),
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                    for c in out.outputs
                    if c.text or c.finish_reason is not None
                ]
                if choices:
                    yield chunk(choices)
        except Exception as e:  # headers are sent: the error goes into the stream
            yield sse(_stream_error(e))
            yield sse("[DONE]")
            return
        if include_usage:  # the usage chunk also says how long each stage took
            yield chunk([], _usage(prompt_len, generated), stage_seconds=seconds)
        yield sse("[DONE]")

    # -- completions ---------------------------------------------------------------------

    async def completion(self, request: OmniCompletionRequest, request_id: str):
        self.check_model(request.model)
        _reject_unsupported(request)
        if request.prompt is None:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, "'prompt' is required", "prompt")
        finals = {s.output for s in self.omni.pipeline.stages if s.final_output}
        if self.renderer is None or "text" not in finals:
            raise OmniHTTPError(
                HTTPStatus.BAD_REQUEST,
                f"pipeline {self.omni.pipeline.name!r} does not output text; "
                "use /v1/images/generations or /v1/chat/completions",
            )
        engine_inputs: list[EngineInput] = raise_for_error(
            await self.renderer.render_completion(request)
        )
        streams = []
        prompt_lens = []
        for i, engine_input in enumerate(engine_inputs):
            prompt_len = len(engine_input["prompt_token_ids"])
            params = self.sampling_params_list(request, prompt_len)
            sub_id = request_id if len(engine_inputs) == 1 else f"{request_id}-{i}"
            streams.append(self.omni.generate(engine_input, params, sub_id, ["text"]))
            prompt_lens.append(prompt_len)
        if request.stream:
            try:
                streams = list(await asyncio.gather(*(_primed(s) for s in streams)))
            except BaseException:
                await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
                raise
            return self._completion_stream(request, request_id, streams, sum(prompt_lens))
        finals = await asyncio.gather(*(_last_text_output(s) for s in streams))
        n = request.n
        choices = [
            CompletionResponseChoice(
                index=p * n + c.index,
                text=c.text,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for p, final in enumerate(finals)
            for c in final.outputs
        ]
        generated = sum(f.num_generated_tokens for f in finals)
        return CompletionResponse(
            id=request_id,
            model=request.model or self.model_name,
            choices=choices,
            usage=_usage(sum(prompt_lens), generated),
        )

    async def _completion_stream(self, request, request_id, streams, prompt_tokens: int):
        model = request.model or self.model_name
        created = int(time.time())
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        n = request.n
        generated = 0
        try:
            async for p, out in _merge(streams):
                if out.output_type != "text":
                    continue
                generated += out.num_generated_tokens
                choices = [
                    CompletionResponseStreamChoice(
                        index=p * n + c.index,
                        text=c.text,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                    for c in out.outputs
                    if c.text or c.finish_reason is not None
                ]
                if choices:
                    yield sse(
                        CompletionStreamResponse(
                            id=request_id, created=created, model=model, choices=choices
                        ).model_dump_json(exclude_unset=True)
                    )
        except Exception as e:
            yield sse(_stream_error(e))
            yield sse("[DONE]")
            return
        if include_usage:
            yield sse(
                CompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=model,
                    choices=[],
                    usage=_usage(prompt_tokens, generated),
                ).model_dump_json(exclude_unset=True)
            )
        yield sse("[DONE]")


def _stage_seconds(outputs) -> dict[str, float]:
    """Seconds per stage of a finished request (every output shares the orchestrator's dict)."""
    for out in outputs:
        return dict(out.metrics.get("stage_seconds") or {})
    return {}


def image_parts(images: list) -> list[dict]:
    """Images as chat content parts (PNG data URLs)."""
    return [{"type": "image_url",
             "image_url": {"url": "data:image/png;base64," + encode_image(img, "png")}}
            for img in images]


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _usage(prompt: int, generated: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated
    )


async def _finals(outputs: AsyncIterator[OmniRequestOutput]) -> dict[str, OmniRequestOutput]:
    """The finished output of each output type (text, audio, ...)."""
    finals = {}
    async for out in outputs:
        if out.finished:
            finals[out.output_type] = out
    return finals


async def _last_text_output(outputs: AsyncIterator[OmniRequestOutput]) -> OmniRequestOutput:
    return _text_of(await _finals(outputs))


def _text_of(finals: dict[str, OmniRequestOutput]) -> OmniRequestOutput:
    if "text" not in finals:
        raise OmniHTTPError(HTTPStatus.INTERNAL_SERVER_ERROR, "the pipeline produced no text")
    return finals["text"]


async def _primed(outputs: AsyncIterator[OmniRequestOutput]) -> AsyncIterator[OmniRequestOutput]:
    """Wait for the first output, so errors the engine finds in a request become an HTTP
    error before the stream's 200 is sent; the returned iterator replays it."""
    first = await anext(outputs)

    async def replay() -> AsyncIterator[OmniRequestOutput]:
        yield first
        async for out in outputs:
            yield out

    return replay()


async def _merge(streams: list[AsyncIterator[OmniRequestOutput]]):
    """Interleave several output streams as items arrive, tagged with their index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[OmniRequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out = await queue.get()
            if out is done:
                remaining -= 1
                if (exc := tasks[i].exception()) is not None:
                    raise exc
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
        return HTTPStatus.SERVICE_UNAVAILABLE, "the engine is not running: " + str(e), None
    return HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}", None


def _stream_error(e: BaseException) -> str:
    from vllm_omni.entrypoints.openai.protocol import error_body

    return json.dumps(error_body(*error_status(e)))
