"""`WS /v1/realtime`: OpenAI's Realtime API (the GA protocol) on a text or speaking pipeline.

A session keeps a conversation of items (user text or audio, assistant answers) and an input
audio buffer. A response is a chat request made of the conversation, started through the chat
serving (`OmniServingChat.start`), so it renders, checks and samples exactly as
`/v1/chat/completions` does for the same turns; its text and audio come back as the protocol's
delta events while the stages produce them. A response runs as a task beside the socket's
reader, so `response.cancel` and a closed socket cancel it, and cancelling the answer's
iterator aborts the request in every stage. Input transcription (`audio.input.transcription`)
runs each committed turn through `/v1/audio/transcriptions`' own request, also beside the
reader, and its event comes when it is done, before or after the response's.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import secrets
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from fastapi import WebSocket, WebSocketDisconnect

from vllm_omni.entrypoints.openai.audio import AudioPieces, encode_audio
from vllm_omni.entrypoints.openai.protocol import OmniChatCompletionRequest
from vllm_omni.entrypoints.openai.serving_base import TextDeltas, error_status
from vllm_omni.entrypoints.openai.serving_chat import OmniServingChat
from vllm_omni.entrypoints.openai.serving_transcription import OmniServingTranscription
from vllm_omni.entrypoints.openai.vad import SpeechDetector
from vllm_omni.outputs import OmniRequestOutput

logger = logging.getLogger(__name__)

PCM = "audio/pcm"  # the one audio format served: 16-bit little-endian mono
INPUT_RATE = 24000  # the protocol's default input rate; chat resamples it to the model's


class RealtimeError(Exception):
    """A client event the session refuses: an `error` event; the socket stays open."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None):
        super().__init__(message)
        self.message, self.code, self.param = message, code, param


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class RealtimeSession:
    """One socket's conversation. `send` writes one server event (a dict) to the client."""

    def __init__(self, chat: OmniServingChat, send,
                 transcription: OmniServingTranscription | None = None) -> None:
        self.chat, self._send = chat, send
        self.transcription = transcription if transcription and transcription.hears() else None
        stage = chat.omni.audio_stage
        self.voices = list(stage.info.voices) if stage is not None else []
        self.output_rate = stage.info.sample_rate if stage is not None else None
        self.session: dict[str, Any] = {
            "type": "realtime", "object": "realtime.session", "id": _id("sess"),
            "model": chat.model_name,
            "output_modalities": ["audio"] if stage is not None else ["text"],
            "instructions": None, "max_output_tokens": "inf",
            "audio": {
                "input": {"format": {"type": PCM, "rate": INPUT_RATE}, "turn_detection": None,
                          "transcription": None},
                "output": {"format": {"type": PCM, "rate": self.output_rate},
                           "voice": self.voices[0] if self.voices else None},
            },
        }
        # Beyond the protocol, as chat's: sampling temperature and per-stage parameters.
        self.sampling: dict[str, Any] = {}
        self.items: list[dict[str, Any]] = []
        self.buffer = bytearray()
        self.buffer_start = 0  # where the buffer starts in the session's input, in samples
        self.detector: SpeechDetector | None = None  # server VAD, when turned on
        self.turn_item: str | None = None  # the item of the turn being spoken
        self.response: asyncio.Task | None = None
        self.transcribing: set[asyncio.Task] = set()
        # Samples of audio sent per assistant item: what a truncation can cut back to.
        self.sent: dict[str, int] = {}

    # -- events out ----------------------------------------------------------------------

    async def send(self, type_: str, **fields: Any) -> None:
        await self._send({"type": type_, "event_id": _id("event"), **fields})

    async def error(self, e: RealtimeError, event_id: str | None) -> None:
        await self.send("error", error={"type": "invalid_request_error", "code": e.code,
                                        "message": e.message, "param": e.param,
                                        "event_id": event_id})

    async def start(self) -> None:
        await self.send("session.created", session=self.session)

    async def close(self) -> None:
        """The socket is gone: stop the running response (aborting it in every stage)."""
        tasks = [*self.transcribing, *([self.response] if self.response else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- events in -----------------------------------------------------------------------

    async def handle(self, raw: str) -> None:
        event_id = None
        try:
            try:
                event = json.loads(raw)
            except json.JSONDecodeError as e:
                raise RealtimeError(f"the event is not valid JSON: {e}", "invalid_json"
                                    ) from None
            if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                raise RealtimeError("an event is a JSON object with a 'type'", "invalid_event")
            event_id = event.get("event_id")
            handler = self.HANDLERS.get(event["type"])
            if handler is None:
                raise RealtimeError(f"unknown event type {event['type']!r}", "unknown_event",
                                    "type")
            await handler(self, event)
        except RealtimeError as e:
            await self.error(e, event_id)

    async def session_update(self, event: dict) -> None:
        given = _object(event.get("session"), "session")
        session = json.loads(json.dumps(self.session))  # applied whole or not at all
        if "output_modalities" in given:
            modalities = given["output_modalities"]
            allowed = [["audio"], ["text"]] if self.voices else [["text"]]
            if modalities not in allowed:
                raise RealtimeError(f"output_modalities must be one of {allowed}",
                                    param="session.output_modalities")
            session["output_modalities"] = modalities
        for name in ("instructions", "max_output_tokens"):
            if name in given:
                session[name] = given[name]
        audio = _object(given.get("audio", {}), "session.audio")
        inp = _object(audio.get("input", {}), "session.audio.input")
        out = _object(audio.get("output", {}), "session.audio.output")
        if "format" in inp:
            session["audio"]["input"]["format"] = _pcm(inp["format"], None,
                                                       "session.audio.input.format")
        if "turn_detection" in inp:
            session["audio"]["input"]["turn_detection"] = _turn_detection(
                inp["turn_detection"])
        if "transcription" in inp:
            session["audio"]["input"]["transcription"] = self._transcription(
                inp["transcription"])
        if "format" in out:
            session["audio"]["output"]["format"] = _pcm(out["format"], self.output_rate,
                                                        "session.audio.output.format")
        if "voice" in out:
            if out["voice"] not in self.voices:
                raise RealtimeError(f"unknown voice {out['voice']!r}; this model has "
                                    f"{self.voices}", param="session.audio.output.voice")
            session["audio"]["output"]["voice"] = out["voice"]
        sampling = dict(self.sampling)
        for name in ("temperature", "stage_sampling_params"):
            if name in given:
                sampling[name] = given[name]
        self.session, self.sampling = session, sampling
        vad = session["audio"]["input"]["turn_detection"]
        self.detector = None if vad is None else SpeechDetector(
            self._input_rate, vad["threshold"], vad["silence_duration_ms"])
        await self.send("session.updated", session=self.session)

    def _transcription(self, given: Any) -> dict | None:
        if given is None:
            return None
        given = _object(given, "session.audio.input.transcription")
        if self.transcription is None:
            raise RealtimeError("this pipeline has no text stage that hears audio to "
                                "transcribe with", param="session.audio.input.transcription")
        out = {"model": self.chat.model_name, "language": None, "prompt": None}
        for name in ("language", "prompt"):
            if given.get(name) is not None:
                if not isinstance(given[name], str):
                    raise RealtimeError(f"transcription.{name} must be a string",
                                        param=f"session.audio.input.transcription.{name}")
                out[name] = given[name]
        return out  # any model name asked for: the pipeline's own text stage hears it

    async def buffer_append(self, event: dict) -> None:
        try:
            data = base64.b64decode(event.get("audio") or "", validate=True)
        except (binascii.Error, TypeError):
            raise RealtimeError("audio must be base64 of 16-bit pcm", param="audio") from None
        if len(data) % 2:
            raise RealtimeError("audio must be whole 16-bit samples", param="audio")
        self.buffer += data
        if self.detector is not None:
            for turn in self.detector.push(data):
                await (self._speech_started if turn.started else self._speech_stopped)(turn.ms)

    async def _speech_started(self, ms: int) -> None:
        """Server VAD: a turn starts. The buffer keeps the prefix padding before it, and a
        response that is still speaking is interrupted (barge-in)."""
        vad = self.session["audio"]["input"]["turn_detection"]
        start = max(0, ms - vad["prefix_padding_ms"])
        cut = start * self._input_rate // 1000 - self.buffer_start
        if cut > 0:
            del self.buffer[:2 * cut]
            self.buffer_start += cut
        self.turn_item = _id("item")
        await self.send("input_audio_buffer.speech_started", audio_start_ms=start,
                        item_id=self.turn_item)
        if vad["interrupt_response"] and self.response is not None and not self.response.done():
            self.response.cancel()
            await asyncio.gather(self.response, return_exceptions=True)

    async def _speech_stopped(self, ms: int) -> None:
        """Server VAD: the turn ends; it is committed, and answered where asked."""
        vad = self.session["audio"]["input"]["turn_detection"]
        item_id, self.turn_item = self.turn_item or _id("item"), None
        await self.send("input_audio_buffer.speech_stopped", audio_end_ms=ms, item_id=item_id)
        end = ms * self._input_rate // 1000 - self.buffer_start
        await self._commit(bytes(self.buffer[:2 * end]), item_id)
        del self.buffer[:2 * end]
        self.buffer_start += end
        if vad["create_response"] and (self.response is None or self.response.done()):
            self.response = asyncio.create_task(self._respond({}))

    async def buffer_commit(self, event: dict) -> None:
        if not self.buffer:
            raise RealtimeError("the input audio buffer is empty",
                                "input_audio_buffer_commit_empty")
        pcm = bytes(self.buffer)
        await self.buffer_clear(None, quiet=True)
        await self._commit(pcm, _id("item"))

    async def _commit(self, pcm: bytes, item_id: str) -> None:
        audio = base64.b64encode(pcm).decode()
        item = {"id": item_id, "type": "message", "role": "user",
                "content": [{"type": "input_audio", "audio": audio, "transcript": None}]}
        previous = self.items[-1]["id"] if self.items else None
        await self.send("input_audio_buffer.committed", item_id=item["id"],
                        previous_item_id=previous)
        await self._add(item)
        if self.session["audio"]["input"]["transcription"] is not None:
            task = asyncio.create_task(self._transcribe(item, pcm))
            self.transcribing.add(task)
            task.add_done_callback(self.transcribing.discard)

    async def _transcribe(self, item: dict, pcm: bytes) -> None:
        settings = self.session["audio"]["input"]["transcription"]
        wav = _pcm_wav(pcm, self._input_rate)
        where = {"item_id": item["id"], "content_index": 0}
        try:
            text, usage = await self.transcription.transcript(
                wav, _id("transcribe"), settings["language"], settings["prompt"])
        except Exception as e:
            status, message, _ = error_status(e)
            if status >= 500:
                logger.exception("Realtime transcription of %s failed", item["id"])
            await self.send("conversation.item.input_audio_transcription.failed", **where,
                            error={"type": "transcription_error", "code": str(status),
                                   "message": message, "param": None})
            return
        item["content"][0]["transcript"] = text
        await self.send("conversation.item.input_audio_transcription.completed", **where,
                        transcript=text, usage=usage)

    async def buffer_clear(self, event: dict | None, quiet: bool = False) -> None:
        self.buffer_start += len(self.buffer) // 2
        self.buffer.clear()
        if not quiet:
            await self.send("input_audio_buffer.cleared")

    async def item_create(self, event: dict) -> None:
        item = dict(_object(event.get("item"), "item"))
        if item.get("type") != "message" or item.get("role") not in {"user", "assistant",
                                                                     "system"}:
            raise RealtimeError("an item is a message of role user, assistant or system",
                                param="item")
        parts = item.get("content")
        if not isinstance(parts, list) or not parts:
            raise RealtimeError("item.content must be a list of parts", param="item.content")
        for part in parts:
            _chat_part(part, self._input_rate)  # refuses what no chat turn can carry
        item.setdefault("id", _id("item"))
        item.update(object="realtime.item", status="completed")
        await self._add(item)

    async def item_delete(self, event: dict) -> None:
        item_id = event.get("item_id")
        kept = [i for i in self.items if i["id"] != item_id]
        if len(kept) == len(self.items):
            raise RealtimeError(f"no item {item_id!r} in the conversation", "item_not_found",
                                "item_id")
        self.items = kept
        await self.send("conversation.item.deleted", item_id=item_id)

    async def item_truncate(self, event: dict) -> None:
        """The client played only `audio_end_ms` of an answer (its user spoke over it): the
        answer keeps that share of its transcript, so the conversation holds only what was
        heard. The transcript has no timing per word; it is cut at the word boundary
        nearest that share of its length."""
        item_id, index, end = (event.get(k) for k in ("item_id", "content_index",
                                                      "audio_end_ms"))
        item = next((i for i in self.items if i["id"] == item_id), None)
        if item is None:
            raise RealtimeError(f"no item {item_id!r} in the conversation", "item_not_found",
                                "item_id")
        if item.get("status") == "in_progress":
            raise RealtimeError("the answer is still being made: cancel the response first",
                                param="item_id")
        if item_id not in self.sent or index != 0:
            raise RealtimeError("only an assistant's spoken answer (content_index 0) can be "
                                "truncated", param="content_index")
        if not isinstance(end, int) or isinstance(end, bool) or not 0 <= end:
            raise RealtimeError("audio_end_ms must be a non-negative integer",
                                param="audio_end_ms")
        sent_ms = self.sent[item_id] * 1000 / self.output_rate
        if end > sent_ms:
            raise RealtimeError(f"audio_end_ms {end} is past the {sent_ms:.0f} ms of audio "
                                "sent", param="audio_end_ms")
        part = item["content"][0]
        words = part["transcript"].split(" ")
        part["transcript"] = " ".join(words[:round(len(words) * end / sent_ms)])
        self.sent[item_id] = end * self.output_rate // 1000
        await self.send("conversation.item.truncated", item_id=item_id, content_index=0,
                        audio_end_ms=end)

    async def response_create(self, event: dict) -> None:
        if self.response is not None and not self.response.done():
            raise RealtimeError("a response is already running",
                                "conversation_already_has_active_response")
        overrides = _object(event.get("response") or {}, "response")
        self.response = asyncio.create_task(self._respond(overrides))

    async def response_cancel(self, event: dict) -> None:
        if self.response is None or self.response.done():
            raise RealtimeError("no response is running", "response_cancel_not_active")
        self.response.cancel()
        await asyncio.gather(self.response, return_exceptions=True)

    HANDLERS = {
        "session.update": session_update,
        "input_audio_buffer.append": buffer_append,
        "input_audio_buffer.commit": buffer_commit,
        "input_audio_buffer.clear": buffer_clear,
        "conversation.item.create": item_create,
        "conversation.item.delete": item_delete,
        "conversation.item.truncate": item_truncate,
        "response.create": response_create,
        "response.cancel": response_cancel,
    }

    # -- the conversation and its responses ----------------------------------------------

    @property
    def _input_rate(self) -> int:
        return int(self.session["audio"]["input"]["format"]["rate"])

    async def _add(self, item: dict, done: bool = True) -> None:
        """`item` into the conversation, announced; `done`: it is whole already (an answer
        that is still being made is announced done when it ends)."""
        previous = self.items[-1]["id"] if self.items else None
        item.setdefault("object", "realtime.item")
        item.setdefault("status", "completed")
        self.items.append(item)
        await self.send("conversation.item.added", item=dict(item), previous_item_id=previous)
        if done:
            await self.send("conversation.item.done", item=item, previous_item_id=previous)

    def chat_request(self, overrides: dict) -> OmniChatCompletionRequest:
        """The conversation so far as the chat request a response is."""
        session = {**self.session, **{k: v for k, v in overrides.items()
                                      if k in ("instructions", "output_modalities",
                                               "max_output_tokens")}}
        messages = [{"role": "system", "content": session["instructions"]}] if session[
            "instructions"] else []
        for item in self.items:
            parts = [_chat_part(p, self._input_rate) for p in item["content"]]
            if item["role"] == "user":
                messages.append({"role": "user", "content": parts})
            else:  # system and assistant turns are their text
                text = "".join(p.get("text", "") for p in parts)
                messages.append({"role": item["role"], "content": text})
        speaking = session["output_modalities"] == ["audio"]
        limit = session["max_output_tokens"]
        sampling = {**self.sampling, **{k: v for k, v in overrides.items()
                                        if k in ("temperature", "stage_sampling_params")}}
        return OmniChatCompletionRequest(
            messages=messages, stream=True,
            modalities=["text", "audio"] if speaking else ["text"],
            audio={"voice": session["audio"]["output"]["voice"], "format": "pcm16"}
            if speaking else None,
            max_tokens=None if limit == "inf" else int(limit), **sampling)

    async def _respond(self, overrides: dict) -> None:
        response_id = _id("resp")
        speaking = (overrides.get("output_modalities")
                    or self.session["output_modalities"]) == ["audio"]
        item = {"id": _id("item"), "object": "realtime.item", "type": "message",
                "role": "assistant", "status": "in_progress", "content": []}
        part = {"type": "audio", "transcript": ""} if speaking else {"type": "text",
                                                                      "text": ""}
        response = {"id": response_id, "object": "realtime.response", "status": "in_progress",
                    "output": [], "output_modalities": ["audio" if speaking else "text"],
                    "conversation_id": self.session["id"]}
        where = {"response_id": response_id, "item_id": item["id"], "output_index": 0,
                 "content_index": 0}
        await self.send("response.created", response=dict(response))
        usage = {"input_tokens": 0, "output_tokens": 0}
        try:
            outputs, usage["input_tokens"] = await self.chat.start(
                self.chat_request(overrides), response_id)
            await self.send("response.output_item.added", response_id=response_id,
                            output_index=0, item=dict(item))
            await self._add(item, done=False)
            await self.send("response.content_part.added", part=dict(part), **where)
            await self._stream(outputs, part, where, usage)
            response["status"] = "completed"
        except asyncio.CancelledError:
            response["status"] = "cancelled"
            response["status_details"] = {"type": "cancelled", "reason": "client_cancelled"}
        except Exception as e:
            status, message, _ = error_status(e)
            if status >= 500:
                logger.exception("Realtime response %s failed", response_id)
            response["status"] = "failed"
            response["status_details"] = {"type": "failed",
                                          "error": {"type": "server_error", "code": str(status),
                                                    "message": message}}
        item["status"] = "completed" if response["status"] == "completed" else "incomplete"
        item["content"] = [part]  # what was sent, and no more (a cancelled answer is cut)
        if item in self.items:
            await self._finish(item, part, where, response)
        response["output"] = [item] if item in self.items else []
        usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
        response["usage"] = usage
        await self.send("response.done", response=response)

    async def _stream(self, outputs: AsyncIterator[OmniRequestOutput], part: dict,
                      where: dict, usage: dict) -> None:
        text, pieces = TextDeltas(), AudioPieces(in_pieces=True)
        speaking = part["type"] == "audio"
        async for out in outputs:
            if out.output_type == "audio":
                new = pieces.take(out.audio.waveform, out.finished)
                if new is not None and len(new):
                    self.sent[where["item_id"]] = self.sent.get(where["item_id"], 0) + len(new)
                    data = encode_audio(new, out.audio.sample_rate, "pcm")
                    await self.send("response.output_audio.delta",
                                    delta=base64.b64encode(data).decode(), **where)
                if out.finished:
                    usage["output_tokens"] += len(out.tensors.get("codes", ()))
            elif out.output_type == "text":
                for delta in text.take(out):
                    if not delta.text:
                        continue
                    key = "transcript" if speaking else "text"
                    part[key] += delta.text
                    kind = "output_audio_transcript" if speaking else "output_text"
                    await self.send(f"response.{kind}.delta", delta=delta.text, **where)
        usage["output_tokens"] += text.generated

    async def _finish(self, item: dict, part: dict, where: dict, response: dict) -> None:
        if part["type"] == "audio":
            await self.send("response.output_audio.done", **where)
            await self.send("response.output_audio_transcript.done",
                            transcript=part["transcript"], **where)
        else:
            await self.send("response.output_text.done", text=part["text"], **where)
        await self.send("response.content_part.done", part=part, **where)
        await self.send("response.output_item.done", response_id=where["response_id"],
                        output_index=0, item=item)
        await self.send("conversation.item.done", item=item, previous_item_id=None)


def _object(value: Any, name: str) -> dict:
    if not isinstance(value, dict):
        raise RealtimeError(f"{name} must be an object", param=name)
    return value


def _turn_detection(given: Any) -> dict | None:
    """The protocol's server VAD settings with their defaults; None turns detection off."""
    if given is None:
        return None
    given = _object(given, "session.audio.input.turn_detection")
    if given.get("type") != "server_vad":
        raise RealtimeError("turn_detection: only type 'server_vad' is supported",
                            param="session.audio.input.turn_detection.type")
    vad = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
           "silence_duration_ms": 500, "create_response": True, "interrupt_response": True}
    for name, kind in (("threshold", (int, float)), ("prefix_padding_ms", int),
                       ("silence_duration_ms", int), ("create_response", bool),
                       ("interrupt_response", bool)):
        if name in given and given[name] is not None:
            if not isinstance(given[name], kind) or (kind is int and given[name] < 0):
                raise RealtimeError(f"turn_detection.{name} has the wrong type",
                                    param=f"session.audio.input.turn_detection.{name}")
            vad[name] = given[name]
    return vad


def _pcm(fmt: Any, rate: int | None, param: str) -> dict:
    """An audio format the session serves: 16-bit pcm (at `rate` where that is fixed)."""
    fmt = _object(fmt, param)
    if fmt.get("type") != PCM:
        raise RealtimeError(f"{param}: only {PCM!r} is supported", param=param)
    given = fmt.get("rate", rate or INPUT_RATE)
    if not isinstance(given, int) or given <= 0 or (rate is not None and given != rate):
        raise RealtimeError(f"{param}.rate must be {rate or 'a positive integer'}",
                            param=f"{param}.rate")
    return {"type": PCM, "rate": given}


def _pcm_wav(pcm: bytes, rate: int) -> bytes:
    """16-bit little-endian mono pcm as a wav file (what chat's audio parts carry)."""
    return encode_audio(np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768, rate, "wav")


def _chat_part(part: Any, input_rate: int) -> dict:
    """A conversation item's content part as a chat content part."""
    part = _object(part, "item.content[]")
    kind = part.get("type")
    if kind in ("input_text", "text", "output_text"):
        if not isinstance(part.get("text"), str):
            raise RealtimeError(f"a {kind} part needs its text", param="item.content")
        return {"type": "text", "text": part["text"]}
    if kind == "audio" and isinstance(part.get("transcript"), str):  # an assistant's answer
        return {"type": "text", "text": part["transcript"]}
    if kind == "input_audio":
        try:
            pcm = base64.b64decode(part.get("audio") or "", validate=True)
        except (binascii.Error, TypeError):
            raise RealtimeError("input_audio.audio must be base64 of 16-bit pcm",
                                param="item.content") from None
        if not pcm or len(pcm) % 2:
            raise RealtimeError("input_audio.audio must be whole 16-bit samples",
                                param="item.content")
        wav = _pcm_wav(pcm, input_rate)
        return {"type": "input_audio",
                "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    raise RealtimeError(f"content parts of type {kind!r} are not supported",
                        param="item.content")


class RealtimeEndpoint:
    """The socket's side: the key and the model checked before any work, a bound on open
    sessions and on a silent client, every client event handed to the session in order."""

    def __init__(self, chat: OmniServingChat, api_keys: list[str], max_sessions: int = 64,
                 idle_timeout: float = 600.0,
                 transcription: OmniServingTranscription | None = None) -> None:
        if max_sessions < 1 or idle_timeout <= 0:
            raise ValueError("the realtime session limit must be at least 1 and the idle "
                             f"timeout positive, not {max_sessions} and {idle_timeout}")
        self.chat, self.max_sessions, self.idle_timeout = chat, max_sessions, idle_timeout
        self.transcription = transcription
        self.expected = [f"Bearer {k}" for k in api_keys]
        self.open = 0

    def _authorized(self, ws: WebSocket) -> bool:
        given = ws.headers.get("authorization", "")
        return not self.expected or any(secrets.compare_digest(given, k)
                                        for k in self.expected)

    async def serve(self, ws: WebSocket) -> None:
        if not self._authorized(ws):
            await ws.close(code=1008, reason="invalid or missing API key")
            return
        model = ws.query_params.get("model")
        if model is not None and model not in self.chat.served_model_names:
            await ws.close(code=1008, reason=f"The model `{model}` does not exist.")
            return
        if self.open >= self.max_sessions:
            await ws.close(code=1013, reason=f"{self.open} realtime sessions are open, the "
                           "limit; retry later")
            return
        await ws.accept()
        self.open += 1
        lock = asyncio.Lock()

        async def send(event: dict) -> None:
            async with lock:  # a response's task and the reader both write
                await ws.send_text(json.dumps(event))

        session = RealtimeSession(self.chat, send, self.transcription)
        try:
            await session.start()
            while True:
                message = await asyncio.wait_for(ws.receive(), self.idle_timeout)
                if message["type"] == "websocket.disconnect":
                    break
                text = message.get("text")
                if text is None:  # a binary frame: events are text, but say so in kind
                    text = (message.get("bytes") or b"").decode("utf-8", "replace")
                await session.handle(text)
        except TimeoutError:
            await ws.close(code=1000, reason="idle")
        except (WebSocketDisconnect, RuntimeError):  # gone, or closed while we wrote
            pass
        finally:
            self.open -= 1
            await session.close()
