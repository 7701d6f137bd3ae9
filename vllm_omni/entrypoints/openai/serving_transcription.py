"""`/v1/audio/transcriptions`: OpenAI's speech-to-text endpoint over a pipeline whose text
stage hears (Qwen2.5-Omni's thinker). The upload becomes a chat turn, the model card's task
prompt beside the audio, rendered by the entry stage's own renderer, so a transcription is
the same prompt as the chat endpoint given that turn; only the text stage runs."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from vllm_omni.entrypoints.openai.audio import heard_wav
from vllm_omni.entrypoints.openai.protocol import (
    OmniChatCompletionRequest,
    OmniHTTPError,
    parse_model,
    rendered,
)
from vllm_omni.entrypoints.openai.serving_base import (
    OmniServing,
    TextDeltas,
    error_event,
    final_outputs,
    primed,
    sse,
)

# The task as the Qwen2.5-Omni model card asks for speech recognition.
SYSTEM_PROMPT = "You are a speech recognition model."
TASK_PROMPT = "Transcribe the {language} audio into text."
RESPONSE_FORMATS = {"json", "text"}
# Fields of OpenAI's request about timestamps and segmenting, which a model that writes no
# timestamps has no use for: dropped. (`prompt`, Whisper's style hint, follows the task.)
IGNORED = {"timestamp_granularities[]", "timestamp_granularities", "chunking_strategy",
           "include[]", "include"}


class OmniServingTranscription(OmniServing):
    """Transcribes an uploaded audio file (wav, flac, mp3, anything libsndfile reads) with the
    text stage: as JSON, as plain text, or streamed as `transcript.text.delta` events."""

    async def transcribe(self, form: dict[str, list[Any]], request_id: str
                         ) -> dict | tuple[bytes, str] | AsyncIterator[str]:
        upload = (form.pop("file", None) or [None])[-1]
        if not isinstance(upload, bytes | bytearray) or not upload:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, "file: an audio file is required",
                                "file")
        fields = {k: v[-1] for k, v in form.items() if k not in IGNORED}
        self.check_model(fields.pop("model", None))
        if not self.hears():
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, f"pipeline {self.omni.pipeline.name!r}"
                                " has no text stage that hears audio")
        fmt = fields.pop("response_format", "json")
        if fmt not in RESPONSE_FORMATS:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, f"response_format {fmt!r} is not "
                                f"supported; use one of {sorted(RESPONSE_FORMATS)}",
                                "response_format")
        stream = str(fields.pop("stream", "false")).lower() == "true"
        request = parse_model(OmniChatCompletionRequest, {
            "messages": transcription_messages(upload, self.hearing_rate(),
                                               fields.pop("language", None),
                                               fields.pop("prompt", None)),
            "temperature": float(fields.pop("temperature", 0) or 0),
            "stream": stream, **fields,
        })
        outputs, prompt_len = await self._start(request, request_id)
        if stream:
            return self._events(await primed(outputs), prompt_len)
        text = (await final_outputs(outputs))["text"]
        transcript = text.outputs[0].text
        if fmt == "text":
            return transcript.encode(), "text/plain; charset=utf-8"
        return {"text": transcript, "usage": _usage(prompt_len, text.num_generated_tokens)}

    async def _start(self, request: OmniChatCompletionRequest, request_id: str
                     ) -> tuple[AsyncIterator, int]:
        _, (engine_input,) = await rendered(self.renderer.render_chat(request))
        prompt_len = len(engine_input["prompt_token_ids"])
        params = self.text_request_params(request, prompt_len)
        return self.omni.generate(engine_input, params, request_id, ["text"]), prompt_len

    def hears(self) -> bool:
        return self.renderer is not None and self.hearing_rate() is not None

    async def transcript(self, wav: bytes, request_id: str, language: str | None = None,
                         prompt: str | None = None) -> tuple[str, dict]:
        """The transcript of a wav file and its usage, greedy: what the endpoint answers
        for that upload (the Realtime API's input transcription)."""
        request = parse_model(OmniChatCompletionRequest, {
            "messages": transcription_messages(wav, self.hearing_rate(), language, prompt),
            "temperature": 0})
        outputs, prompt_len = await self._start(request, request_id)
        text = (await final_outputs(outputs))["text"]
        return text.outputs[0].text, _usage(prompt_len, text.num_generated_tokens)

    async def _events(self, outputs: AsyncIterator, prompt_len: int) -> AsyncIterator[str]:
        text, whole = TextDeltas(), ""
        try:
            async for out in outputs:
                for delta in text.take(out):
                    whole += delta.text
                    if delta.text:
                        yield sse(json.dumps({"type": "transcript.text.delta",
                                              "delta": delta.text}))
        except Exception as e:  # headers are sent: the error goes into the stream
            yield error_event(e)
            return
        yield sse(json.dumps({"type": "transcript.text.done", "text": whole,
                              "usage": _usage(prompt_len, text.generated)}))


def transcription_messages(audio_file: bytes, rate: int, language: str | None = None,
                           prompt: str | None = None) -> list[dict]:
    """The chat turn that asks for a transcript of `audio_file`, its audio as 16-bit mono
    wav at `rate` (what the renderer reads, whatever container and rate it came in); a 400
    for what is no audio."""
    try:
        wav = heard_wav(audio_file, rate) or audio_file
    except ValueError as e:
        raise OmniHTTPError(HTTPStatus.BAD_REQUEST, f"file: {e}", "file") from None
    task = TASK_PROMPT.format(language=language or "spoken")
    if prompt:
        task += " " + prompt
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": [
            {"type": "input_audio",
             "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
            {"type": "text", "text": task},
        ]},
    ]


def _usage(prompt_len: int, generated: int) -> dict:
    return {"type": "tokens", "input_tokens": prompt_len, "output_tokens": generated,
            "total_tokens": prompt_len + generated}
