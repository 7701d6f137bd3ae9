"""`/v1/chat/completions` over every kind of pipeline: text answers, text with the images a
later stage drew, spoken answers (OpenAI's `audio` shape), and on a diffusion pipeline the
images alone.

Messages are rendered by vLLM's own renderer for the entry stage, so a prompt is the same
token for token as under `vllm serve`; text answers use vLLM's response models.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus
from typing import Any

from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
)
from vllm.entrypoints.serve.engine.protocol import UsageInfo

from vllm_omni.entrypoints.async_omni_llm import AsyncOmniLLM
from vllm_omni.entrypoints.openai.audio import (
    STREAMABLE,
    AudioPieces,
    audio_b64,
    check_voice_and_format,
    heard_wav,
)
from vllm_omni.entrypoints.openai.images import chat_image_prompt, image_parts
from vllm_omni.entrypoints.openai.protocol import (
    AudioOutputParams,
    OmniChatCompletionRequest,
    OmniHTTPError,
    rendered,
)
from vllm_omni.entrypoints.openai.serving_base import (
    EntryRenderer,
    OmniServing,
    TextDeltas,
    error_event,
    final_outputs,
    primed,
    reject_unsupported,
    sse,
    usage_info,
)
from vllm_omni.entrypoints.openai.serving_images import OmniServingImages
from vllm_omni.outputs import AudioOutput, OmniRequestOutput

# What a chat message can carry, by stage output type.
CHAT_OUTPUTS = {"text", "image", "audio"}


class OmniServingChat(OmniServing):
    """Chat completions, streamed or not. The message carries what the pipeline's final
    stages output: text, content parts of text and images, or audio with its transcript.
    Without a renderer (a diffusion pipeline) the last user message is drawn by `images`."""

    def __init__(
        self,
        omni: AsyncOmniLLM,
        served_model_names: list[str],
        renderer: EntryRenderer | None,
        images: OmniServingImages,
        *,
        response_role: str = "assistant",
    ) -> None:
        super().__init__(omni, served_model_names, renderer)
        self.images = images
        self.response_role = response_role

    async def chat(
        self, request: OmniChatCompletionRequest, request_id: str
    ) -> dict | AsyncIterator[str]:
        """A chat completion body, or an async iterator of SSE lines when streaming."""
        # On a diffusion pipeline the adapters are models too.
        self.check_model(request.model, adapters=self.renderer is None)
        reject_unsupported(request)
        if self.renderer is None:
            return await self._chat_image(request, request_id)
        outputs, prompt_len = await self.start(request, request_id)
        if request.stream:
            outputs = await primed(outputs)
            return self._chat_stream(request, request_id, outputs, prompt_len)
        return await self._chat_full(request, request_id, outputs, prompt_len)

    async def start(self, request: OmniChatCompletionRequest, request_id: str
                    ) -> tuple[AsyncIterator[OmniRequestOutput], int]:
        """A text pipeline's answer to `request` as it comes, and its prompt's length: the
        checks, the rendered prompt and every stage's parameters (the Realtime API's
        responses start here too)."""
        self._check_chat_answer(request)
        extra = self._audio_params(request)
        request = self._with_system_prompt(self._audio_heard(request))
        _, engine_inputs = await rendered(self.renderer.render_chat(request))
        (engine_input,) = engine_inputs
        prompt_len = len(engine_input["prompt_token_ids"])
        params = self.text_request_params(request, prompt_len, extra)
        return self.omni.generate(engine_input, params, request_id, request.modalities), \
            prompt_len

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

    def _audio_heard(self, request: OmniChatCompletionRequest) -> OmniChatCompletionRequest:
        """The request with its `input_audio` parts at the rate the model hears (see
        `hearing_rate`, read only once a request has audio); a part that is no audio is left
        for the renderer to refuse."""
        messages, changed = [], False
        for message in request.messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                parts = [_heard_part(part, self.hearing_rate) for part in content]
                if any(new is not old for new, old in zip(parts, content, strict=True)):
                    message, changed = {**message, "content": parts}, True
            messages.append(message)
        return request.model_copy(update={"messages": messages}) if changed else request

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
        check_voice_and_format(list(stage.info.voices), audio.voice, audio.format, "audio.voice",
                               "audio.format")
        params: dict = {"speaker": audio.voice} if audio.voice else {}
        if request.stream and audio.format in STREAMABLE:
            params["stream"] = True  # audio chunk by chunk as the talker speaks
        return {stage.name: params} if params else {}

    async def _chat_image(
        self, request: OmniChatCompletionRequest, request_id: str
    ) -> dict | AsyncIterator[str]:
        """Chat with a diffusion pipeline: the last user message is the prompt, the answer's
        content is the images (as data URLs); `stage_sampling_params` carries the diffusion
        parameters (size, steps, seed, ...)."""
        prompt = chat_image_prompt(request.messages)
        # Made whole before answering: an error is an HTTP error, also for a stream.
        params = {"num_images": request.n or 1, "priority": request.priority,
                  **self.adapter_params(request.model, request.lora_scale)}
        out = await self.images.generate_images(prompt, params, request_id,
                                                request.stage_sampling_params)
        if request.stream:
            return self._image_stream(request, request_id, out.images)
        return self._image_answer(request, request_id, out.images, usage_info(0, 0),
                                  _stage_seconds([out]))

    async def _image_stream(self, request: OmniChatCompletionRequest, request_id: str,
                            images: list) -> AsyncIterator[str]:
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

    async def _chat_full(self, request: OmniChatCompletionRequest, request_id: str,
                         outputs: AsyncIterator[OmniRequestOutput], prompt_len: int) -> dict:
        finals = await final_outputs(outputs)
        seconds = _stage_seconds(finals.values())
        if "text" not in finals:  # a pipeline that answers with images only
            if "image" not in finals:
                raise OmniHTTPError(HTTPStatus.INTERNAL_SERVER_ERROR,
                                    f"the pipeline returned {sorted(finals)}, no text or image")
            return self._image_answer(request, request_id, finals["image"].images,
                                      usage_info(prompt_len, 0), seconds)
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
            usage=usage_info(prompt_len, final.num_generated_tokens),
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

    def _image_answer(self, request: OmniChatCompletionRequest, request_id: str, images: list,
                      usage: UsageInfo, seconds: dict[str, float]) -> dict:
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

    def _audio_body(self, request: OmniChatCompletionRequest, request_id: str,
                    audio: AudioOutput, **fields: Any) -> dict:
        fmt = (request.audio or AudioOutputParams()).format
        return {
            "id": f"audio-{request_id}",
            "data": audio_b64(audio.waveform, audio.sample_rate, fmt),
            "expires_at": int(time.time()) + 3600,
            **fields,
        }

    async def _chat_stream(
        self, request: OmniChatCompletionRequest, request_id: str,
        outputs: AsyncIterator[OmniRequestOutput], prompt_len: int
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
        text = TextDeltas()
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
                deltas = text.take(out)
                if speaking:
                    transcript = "".join(d.text for d in deltas)
                    if transcript:
                        yield audio_chunk({"transcript": transcript})
                    continue
                if deltas:
                    yield chunk([
                        ChatCompletionResponseStreamChoice(
                            index=d.index, delta=DeltaMessage(content=d.text),
                            finish_reason=d.finish_reason, stop_reason=d.stop_reason)
                        for d in deltas])
        except Exception as e:  # headers are sent: the error goes into the stream
            yield error_event(e)
            yield sse("[DONE]")
            return
        if include_usage:  # the usage chunk also says how long each stage took
            yield chunk([], usage_info(prompt_len, text.generated), stage_seconds=seconds)
        yield sse("[DONE]")


def _heard_part(part: Any, hearing_rate: Callable[[], int | None]) -> Any:
    """An `input_audio` content part re-encoded at the rate the model hears where it has
    another; else `part`."""
    if not isinstance(part, dict) or part.get("type") != "input_audio":
        return part
    audio = part.get("input_audio")
    if not isinstance(audio, dict):
        return part
    rate = hearing_rate()
    if rate is None:
        return part
    try:
        wav = heard_wav(base64.b64decode(audio.get("data") or "", validate=True), rate)
    except (ValueError, TypeError):  # not base64, or no audio: the renderer says so
        return part
    if wav is None:
        return part
    return {**part, "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}


def _stage_seconds(outputs) -> dict[str, float]:
    """Seconds per stage of a finished request (every output shares the orchestrator's dict)."""
    for out in outputs:
        return dict(out.metrics.get("stage_seconds") or {})
    return {}
