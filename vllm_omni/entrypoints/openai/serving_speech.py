"""`/v1/audio/speech`: OpenAI's text-to-speech endpoint over a pipeline that speaks.

A speaking pipeline speaks what its text stage answers (Qwen2.5-Omni: the talker speaks the
thinker's reply). To read a given text aloud, the request becomes a conversation whose answer
is already written: the pipeline's system prompt for audio, a user turn with the
instructions, and the input text as the assistant's reply. The text stage only reads it (one
prefill; the one token it generates is dropped), and `REPLY_START` tells the stages after it
where the reply starts, so they speak it as if the text stage had written it.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from fastapi.responses import Response, StreamingResponse
from vllm import SamplingParams
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from vllm_omni.entrypoints.openai.audio import (
    STREAMABLE,
    AudioPieces,
    check_voice_and_format,
    encode_audio,
)
from vllm_omni.entrypoints.openai.protocol import (
    OmniHTTPError,
    SpeechRequest,
    error_body,
    rendered,
)
from vllm_omni.entrypoints.openai.serving_base import OmniServing, error_status, sse
from vllm_omni.processors import REPLY_START

DEFAULT_INSTRUCTIONS = "Read the following text aloud."
MEDIA_TYPES = {"mp3": "audio/mpeg", "wav": "audio/wav", "flac": "audio/flac",
               "pcm": "audio/pcm", "pcm16": "audio/pcm"}


# Seconds each stage took, as JSON: the file answer has no body field to carry them.
STAGE_SECONDS_HEADER = "X-Stage-Seconds"


class OmniServingSpeech(OmniServing):
    """Reads a text aloud with the pipeline's audio stage, answering with the audio file, raw
    audio as it is spoken, or OpenAI's speech SSE events."""

    async def speech(self, request: SpeechRequest, request_id: str) -> Response | AsyncIterator:
        """The audio file, a stream of raw audio (`stream_format: audio` in pcm), or SSE
        events (`speech.audio.delta` ..., `speech.audio.done`)."""
        self.check_model(request.model)
        stage = self._check(request)
        prompt, reply_at = await self._prompt(request)
        in_pieces = request.response_format in STREAMABLE
        params = self._params(request, stage.name, reply_at, stream=in_pieces)
        outputs = self.omni.generate(prompt, params, request_id, ["audio"])
        if request.stream_format == "sse":
            return self._events(request, outputs, len(prompt["prompt_token_ids"]))
        media_type = MEDIA_TYPES[request.response_format]
        if in_pieces:
            audio = _new_audio(outputs, in_pieces=True)
            first = await anext(audio)  # an error before any audio still gets its status
            return StreamingResponse(_raw(first, audio), media_type=media_type)
        final = None
        async for out in outputs:
            final = out
        audio = final.audio
        data = encode_audio(audio.waveform, audio.sample_rate, request.response_format)
        seconds = json.dumps(final.metrics.get("stage_seconds") or {})
        return Response(data, media_type=media_type, headers={STAGE_SECONDS_HEADER: seconds})

    def _check(self, request: SpeechRequest) -> Any:
        """The audio stage, once the pipeline is known to speak as the request asks."""
        stage = self.omni.audio_stage
        text_stage = self.omni.text_stage
        if stage is None or text_stage is None or self.renderer is None:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST,
                                f"pipeline {self.omni.pipeline.name!r} does not speak")
        check_voice_and_format(list(stage.info.voices), request.voice, request.response_format,
                               "voice", "response_format")
        if request.speed != 1.0:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, "speed other than 1.0 is not "
                                "supported by this model", "speed")
        return stage

    async def _prompt(self, request: SpeechRequest) -> tuple[dict[str, list[int]], int]:
        """The conversation up to the assistant's turn, then the input text's tokens; and
        where the reply starts."""
        messages = [{"role": "user", "content": request.instructions or DEFAULT_INSTRUCTIONS}]
        system = self.omni.pipeline.system_prompts.get("audio")
        if system:
            messages.insert(0, {"role": "system", "content": system})
        chat = ChatCompletionRequest(messages=messages, add_generation_prompt=True)
        _, (prompt,) = await rendered(self.renderer.render_chat(chat))
        head = list(prompt["prompt_token_ids"])
        tokenizer = self.omni.text_stage.renderer.get_tokenizer()
        reply = tokenizer.encode(request.input, add_special_tokens=False)
        return {"prompt_token_ids": head + reply}, len(head)

    def _params(self, request: SpeechRequest, audio_stage: str, reply_at: int,
                stream: bool) -> list:
        audio = {"stream": stream, **({"speaker": request.voice} if request.voice else {})}
        overrides = self.stage_overrides(request.stage_sampling_params, {audio_stage: audio})
        text = self.omni.text_stage.name
        if text in overrides:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, f"the text stage {text!r} only reads "
                                "the input; it takes no parameters here", "stage_sampling_params")
        overrides[text] = SamplingParams(max_tokens=1, temperature=0,
                                         extra_args={REPLY_START: reply_at})
        return self.omni.sampling_params_list(self.in_stage_order(overrides))

    async def _events(self, request: SpeechRequest, outputs, input_tokens: int
                      ) -> AsyncIterator[str]:
        in_pieces = request.response_format in STREAMABLE
        codes = 0
        try:
            async for out, new in _new_audio(outputs, in_pieces):
                data = encode_audio(new, out.audio.sample_rate, request.response_format)
                yield sse(json.dumps({"type": "speech.audio.delta",
                                      "audio": base64.b64encode(data).decode()}))
                if out.finished:
                    codes = len(out.tensors.get("codes", ()))
        except Exception as e:  # headers are sent: the error goes into the stream, as chat's
            yield sse(json.dumps({"type": "error", **error_body(*error_status(e))}))
            return
        yield sse(json.dumps({"type": "speech.audio.done", "usage": {
            "input_tokens": input_tokens, "output_tokens": codes,
            "total_tokens": input_tokens + codes}}))


async def _new_audio(outputs: AsyncIterator, in_pieces: bool) -> AsyncIterator:
    """(output, what to send of it) per audio output with something to send."""
    pieces = AudioPieces(in_pieces)
    async for out in outputs:
        new = pieces.take(out.audio.waveform, out.finished)
        if new is not None:
            yield out, new


async def _raw(first: tuple, rest: AsyncIterator) -> AsyncIterator[bytes]:
    """Raw 16-bit audio: the first piece, then the others as they come."""
    out, new = first
    yield encode_audio(new, out.audio.sample_rate, "pcm")
    async for out, new in rest:
        yield encode_audio(new, out.audio.sample_rate, "pcm")
