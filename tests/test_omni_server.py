"""Qwen2.5-Omni speaking through the OpenAI API: `vllm serve FOLDER --omni` on the tiny model,
the openai client asking for text and audio, compared with HF transformers."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import openai
import pytest
import soundfile
import torch
from conftest import ServerProcess, screenshot

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

THINKER_TOKENS, TALKER_TOKENS, SEED = 12, 40, 77
CHUNKS = 3  # streamed: code2wav's default chunks of 40 codes: 12, 24, the last 4
MESSAGES = [{"role": "user", "content": "Tell me a story about a red fox."}]
SPEECH = {  # the talker and code2wav settings of the reference run
    "temperature": 0,
    "max_tokens": THINKER_TOKENS,
    "extra_body": {"stage_sampling_params": {
        "talker": {"temperature": 0, "max_tokens": TALKER_TOKENS},
        "code2wav": {"seed": SEED},
    }},
}


SPOKEN = "The red fox runs over the hill."  # what /v1/audio/speech reads


@pytest.fixture(scope="module")
def hf_model(tiny_omni):
    from conftest import hf_talker_with_attention_mask
    from transformers import AutoProcessor, Qwen2_5OmniForConditionalGeneration

    processor = AutoProcessor.from_pretrained(tiny_omni)
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(tiny_omni).eval()
    hf_talker_with_attention_mask(model)
    return processor, model


def system_prompt() -> str:
    from vllm_omni.config.loader import builtin_pipelines

    return builtin_pipelines()["qwen2_5_omni"].system_prompts["audio"]


def hf_speak(hf_model, messages: list[dict], forced: list[int] | None = None):
    """HF's text and waveform for a conversation with the voice Ethan; `forced`: the
    thinker's answer token by token (a logits processor that allows only the next one)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from vllm_omni.testing.tiny_omni import TALKER_EOS_IDS

    processor, model = hf_model
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=prompt, return_tensors="pt")
    start = inputs["input_ids"].shape[1]
    thinker = {"thinker_max_new_tokens": THINKER_TOKENS}
    if forced is not None:
        class Force(LogitsProcessor):
            def __call__(self, input_ids, scores):
                allowed = torch.full_like(scores, float("-inf"))
                allowed[:, forced[input_ids.shape[1] - start]] = 0
                return scores + allowed

        thinker = {"thinker_max_new_tokens": len(forced),
                   "thinker_logits_processor": LogitsProcessorList([Force()])}
    torch.manual_seed(SEED)
    with torch.no_grad():
        sequences, waveform = model.generate(
            **inputs, return_audio=True, speaker="Ethan", thinker_do_sample=False,
            talker_do_sample=False, talker_max_new_tokens=TALKER_TOKENS,
            talker_eos_token_id=TALKER_EOS_IDS, **thinker,
        )
    tokens = sequences[0, start:]
    return processor.tokenizer.decode(tokens, skip_special_tokens=True), waveform.numpy()


@pytest.fixture(scope="module")
def hf_answer(hf_model):
    """HF's spoken answer to MESSAGES, with the system prompt the server adds for speech."""
    return hf_speak(hf_model, [{"role": "system", "content": system_prompt()}, *MESSAGES])


@pytest.fixture(scope="module")
def hf_plain_text(hf_model):
    """HF's text answer to MESSAGES as they are (no system prompt)."""
    return hf_speak(hf_model, MESSAGES)[0]


@pytest.fixture(scope="module")
def hf_reading(hf_model):
    """HF reading SPOKEN: the conversation /v1/audio/speech builds, the thinker forced to
    answer SPOKEN (then <|im_end|>)."""
    from vllm_omni.entrypoints.openai.serving_speech import DEFAULT_INSTRUCTIONS

    tokenizer = hf_model[0].tokenizer
    forced = tokenizer.encode(SPOKEN, add_special_tokens=False)
    forced.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    messages = [{"role": "system", "content": system_prompt()},
                {"role": "user", "content": DEFAULT_INSTRUCTIONS}]
    text, waveform = hf_speak(hf_model, messages, forced)
    assert text == SPOKEN  # the tokenizer round-trips it
    return waveform


@pytest.fixture(scope="module")
def server(tiny_omni, tmp_path_factory):
    srv = ServerProcess([tiny_omni, "--dtype", "float32", "--max-model-len", "1024"],
                        tmp_path_factory.mktemp("log") / "omni.log", timeout=360)
    yield srv
    assert srv.stop(), "processes of the server were still alive after SIGTERM"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def model_name(client) -> str:
    return client.models.list().data[0].id


def decode_wav(b64: str) -> tuple[np.ndarray, int]:
    data, rate = soundfile.read(io.BytesIO(base64.b64decode(b64)), dtype="float32")
    return data, rate


def test_chat_speaks_like_hf(client, hf_answer):
    text, waveform = hf_answer
    resp = client.chat.completions.create(
        model=model_name(client), messages=MESSAGES, modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "wav"}, **SPEECH,
    )
    message = resp.choices[0].message
    assert message.content is None and message.audio.transcript == text
    got, rate = decode_wav(message.audio.data)
    assert rate == 24000
    np.testing.assert_allclose(got, waveform, atol=1.5 / 32768)  # 16-bit samples


def stream_speech(client, code2wav: dict) -> tuple[str, list[bytes]]:
    """A streamed chat answer in pcm16: its transcript and its audio pieces."""
    speech = {**SPEECH, "extra_body": {"stage_sampling_params": {
        **SPEECH["extra_body"]["stage_sampling_params"], "code2wav": code2wav}}}
    stream = client.chat.completions.create(
        model=model_name(client), messages=MESSAGES, modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "pcm16"}, stream=True, **speech,
    )
    transcript, data = [], []
    for chunk in stream:
        audio = getattr(chunk.choices[0].delta, "audio", None) if chunk.choices else None
        if audio:
            transcript.append(audio.transcript or "")
            if audio.data:
                data.append(base64.b64decode(audio.data))
    return "".join(transcript), data


def pcm16(pieces: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(pieces), dtype="<i2").astype(np.float32) / 32768


def test_streamed_transcript_then_whole_audio(client, hf_answer):
    """Decoded whole (`stream: false` for code2wav), a streamed answer carries HF's audio."""
    text, waveform = hf_answer
    transcript, data = stream_speech(client, {"seed": SEED, "stream": False})
    assert transcript == text and len(data) == 1
    np.testing.assert_allclose(pcm16(data), waveform, atol=1.5 / 32768)


def test_streamed_audio_comes_in_chunks(client, hf_answer):
    """By default a streamed pcm16 answer is decoded chunk by chunk: several pieces that
    together approximate the whole decode closely (the DiT sees each chunk with context)."""
    text, waveform = hf_answer
    transcript, data = stream_speech(client, {"seed": SEED})
    assert transcript == text
    assert len(data) == CHUNKS
    got = pcm16(data)
    assert got.shape == waveform.shape
    snr = 10 * np.log10(np.sum(waveform**2) / np.sum((got - waveform) ** 2))
    assert snr > 40, f"streamed audio is {snr:.1f} dB from the whole decode"


def test_text_only_by_default(client, hf_plain_text):
    resp = client.chat.completions.create(
        model=model_name(client), messages=MESSAGES, temperature=0, max_tokens=THINKER_TOKENS
    )
    assert resp.choices[0].message.content == hf_plain_text
    assert getattr(resp.choices[0].message, "audio", None) is None


@pytest.mark.parametrize("kwargs, match", [
    ({"modalities": ["text", "audio"], "audio": {"voice": "Nobody"}}, "unknown voice"),
    ({"modalities": ["text", "audio"], "audio": {"format": "ogg"}}, "not supported"),
    ({"modalities": ["audio"]}, "must also"),
    ({"modalities": ["text", "audio"], "n": 2}, "n=1"),
    # A value of the wrong type for a stage that is not the text stage: a 400, not a 500.
    ({"modalities": ["text", "audio"],
      "extra_body": {"stage_sampling_params": {"talker": {"max_tokens": "many"}}}},
     "stage 'talker': invalid sampling params"),
    ({"modalities": ["text", "audio"],
      "extra_body": {"stage_sampling_params": {"talker": {"bogus": 1}}}},
     r"stage 'talker': unknown sampling params \['bogus'\]"),
])
def test_bad_audio_requests_are_400(client, kwargs, match):
    with pytest.raises(openai.BadRequestError, match=match):
        client.chat.completions.create(model=model_name(client), messages=MESSAGES,
                                       max_tokens=4, **kwargs)


def test_image_input_answers_in_text_and_speech(client):
    png = io.BytesIO()
    from PIL import Image

    Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8)
                    ).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is this?"},
    ]}]
    # The server gives a request for speech the model's system prompt: the same answer as
    # a text request that brings it itself.
    system = [{"role": "system", "content": system_prompt()}]
    resp = client.chat.completions.create(model=model_name(client), messages=system + messages,
                                          temperature=0, max_tokens=4)
    text = resp.choices[0].message.content
    assert text
    spoken = client.chat.completions.create(
        model=model_name(client), messages=messages, temperature=0, max_tokens=4,
        modalities=["text", "audio"],
        extra_body={"stage_sampling_params": {"talker": {"max_tokens": 20}}},
    ).choices[0].message.audio
    assert spoken.transcript == text
    waveform, rate = decode_wav(spoken.data)
    assert rate == 24000 and len(waveform) > 0


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
    {"type": "image_url", "image_url": {"url": "/etc/passwd"}},
    {"type": "input_audio", "input_audio": {"data": "/etc/passwd", "format": "wav"}},
    # Broken payloads: not base64, and base64 of something that is no image or audio.
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!not*base64!!"}},
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}},
    {"type": "input_audio", "input_audio": {"data": "bm90IGF1ZGlv", "format": "wav"}},
])
def test_bad_media_parts_are_400(server, part):
    """A media part naming a file of the server's machine is refused (vLLM reads local files
    only under --allowed-local-media-path, which is unset), and nothing of it comes back; a
    payload that is not what it says is a 400 too."""
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "read it"}]}]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": "any", "messages": messages, "max_tokens": 4})
    # The model check comes first: an unknown model is a 404 before any part is read.
    assert r.status_code == 404, r.text
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": httpx.get(server.url + "/v1/models").json()["data"][0]["id"],
                         "messages": messages, "max_tokens": 4})
    assert r.status_code == 400, r.text
    assert "root:" not in r.text and r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/../../../../etc/passwd", "/playground/../../etc/passwd",
                                  "/playground/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
                                  "/playground/..%2f..%2f..%2fetc%2fpasswd"])
def test_static_files_stay_in_the_playground(server, path):
    r = httpx.get(server.url + path, timeout=10)
    assert r.status_code == 404 and "root:" not in r.text, (path, r.status_code, r.text[:200])


@pytest.mark.parametrize("model", ["/etc/passwd", "../../../etc/passwd", "~/.ssh/id_rsa"])
def test_model_names_are_names_not_paths(server, model):
    for route, body in [("/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
                        ("/v1/audio/speech", {"input": "hi", "voice": "Chelsie"})]:
        r = httpx.post(server.url + route, json={"model": model, **body}, timeout=60)
        assert r.status_code == 404 and "root:" not in r.text, (route, r.text[:200])


READING = {"talker": {"temperature": 0, "max_tokens": TALKER_TOKENS}, "code2wav": {"seed": SEED}}


def test_speech_reads_the_input_like_hf(client, hf_reading):
    """/v1/audio/speech: the talker speaks the input as the thinker's answer, as HF does
    when its thinker is made to answer exactly that text."""
    audio = client.audio.speech.create(
        model=model_name(client), voice="Ethan", input=SPOKEN, response_format="wav",
        extra_body={"stage_sampling_params": READING},
    )
    got, rate = soundfile.read(io.BytesIO(audio.content), dtype="float32")
    assert rate == 24000
    np.testing.assert_allclose(got, hf_reading, atol=1.5 / 32768)


def test_speech_streams_raw_audio_and_events(client, hf_reading):
    with client.audio.speech.with_streaming_response.create(
        model=model_name(client), voice="Ethan", input=SPOKEN, response_format="pcm",
        extra_body={"stage_sampling_params": READING},
    ) as response:
        assert response.headers["content-type"] == "audio/pcm"
        got = pcm16(list(response.iter_bytes()))
    assert got.shape == hf_reading.shape
    snr = 10 * np.log10(np.sum(hf_reading**2) / np.sum((got - hf_reading) ** 2))
    assert snr > 40, f"streamed speech is {snr:.1f} dB from HF's"

    events = client.audio.speech.create(
        model=model_name(client), voice="Ethan", input=SPOKEN, response_format="pcm",
        stream_format="sse", extra_body={"stage_sampling_params": READING},
    ).text
    payloads = [json.loads(line[len("data: "):]) for line in events.splitlines()
                if line.startswith("data: ")]
    deltas = [p for p in payloads if p["type"] == "speech.audio.delta"]
    assert len(deltas) == CHUNKS
    assert pcm16([base64.b64decode(p["audio"]) for p in deltas]).shape == hf_reading.shape
    assert payloads[-1]["type"] == "speech.audio.done"
    assert payloads[-1]["usage"]["output_tokens"] == TALKER_TOKENS


@pytest.mark.parametrize("kwargs, match", [
    ({"voice": "Nobody"}, "unknown voice"),
    ({"response_format": "opus"}, "not supported"),
    ({"speed": 2.0}, "speed"),
    ({"input": ""}, "input"),
])
def test_bad_speech_requests_are_400(client, kwargs, match):
    request = {"model": model_name(client), "voice": "Ethan", "input": "Hi.", **kwargs}
    with pytest.raises(openai.BadRequestError, match=match):
        client.audio.speech.create(**request)


def test_playground_speaks(server, browser):
    """The playground on a speaking pipeline: a Speech tab with the model's voices, and chat
    answers that play and can be downloaded."""
    page = browser.new_page(viewport={"width": 1100, "height": 900})
    page.goto(server.url + "/")
    page.get_by_role("tab", name="Speech").click()
    voices = httpx.get(server.url + "/v1/omni/info").json()["audio"]["voices"]
    assert len(voices) >= 2
    assert page.locator("#speech-voice option").all_inner_texts() == voices
    assert page.locator("#speech-stages").get_attribute("placeholder") == \
        '{"talker":{"max_tokens":100}}'
    page.get_by_label("Text to speak").fill("hello")
    stages = '{"talker": {"max_tokens": 40}}'  # a random talker speaks until its limit
    page.locator("#speech-stages").fill("{not json")
    page.get_by_role("button", name="Speak").click()
    assert "not valid JSON" in page.get_by_role("alert").inner_text()
    page.locator("#speech-stages").fill('{"nobody": {}}')
    page.get_by_role("button", name="Speak").click()
    page.get_by_text("nobody").wait_for()  # the server's 400 names the unknown stage
    page.locator("#speech-stages").fill(stages)
    page.get_by_role("button", name="Speak").click()
    audio = page.locator("#speech-out audio").first
    audio.wait_for()
    assert audio.get_attribute("src").startswith("blob:")
    size = page.evaluate("async () => (await (await fetch("
                         "document.querySelector('#speech-out audio').src)).blob()).size")
    assert size > 44  # more than a WAV header
    screenshot(page, "playground-speech")
    page.get_by_role("tab", name="Chat").click()
    assert page.get_by_label("Image", exact=True).is_visible()
    assert page.get_by_label("Audio (WAV)").is_visible()
    page.get_by_label("Answer in speech").check()
    page.get_by_label("Max tokens").fill("8")
    page.locator("#chat-stages").fill(stages)
    page.get_by_label("Message").fill("hi")
    page.get_by_role("button", name="Send").click()
    page.locator(".msg.assistant audio").wait_for()
    assert page.locator(".msg.assistant a").get_attribute("download") == "answer.wav"
    samples = page.evaluate("async () => (await (await fetch(document.querySelector("
                            "'.msg.assistant audio').src)).blob()).size")
    assert samples > 44 + 2 * 1000  # the streamed pcm16 pieces, joined into one WAV
    screenshot(page, "playground-chat-speech")
    page.close()


# -- /v1/audio/transcriptions: the thinker hears an upload -------------------------------


def spoken_file(fmt: str) -> bytes:
    """A second of a gliding tone with noise at 24 kHz (the tiny model hears no words; what
    matters is that every container gives the thinker the same samples)."""
    rng = np.random.default_rng(3)
    t = np.arange(24000) / 24000
    wave = 0.3 * np.sin(2 * np.pi * (200 + 300 * t) * t) + 0.05 * rng.standard_normal(t.size)
    buf = io.BytesIO()
    soundfile.write(buf, wave.astype(np.float32), 24000, format=fmt.upper(), subtype="PCM_16")
    return buf.getvalue()


def test_transcription_is_the_chat_answer_to_its_turn(client):
    """A transcript is what the chat endpoint answers to the same turn (the card's task
    prompt beside the audio), as JSON, as text and streamed; flac gives what wav gives, and
    chat hears a part at another rate as the model's (vLLM alone would fail on it)."""
    from vllm_omni.entrypoints.openai.serving_transcription import transcription_messages

    wav = spoken_file("wav")

    def chat_answer(messages: list[dict]) -> str:
        return client.chat.completions.create(
            model=model_name(client), messages=messages, temperature=0,
            max_tokens=THINKER_TOKENS).choices[0].message.content

    chat = chat_answer(transcription_messages(wav, 16000))
    assert chat
    # Chat resamples an input_audio part itself: the 24 kHz file as it is, the same answer.
    assert chat_answer(transcription_messages(wav, 24000)) == chat
    common = {"model": model_name(client), "extra_body": {"max_tokens": THINKER_TOKENS}}
    got = client.audio.transcriptions.create(file=("a.wav", wav), **common)
    assert got.text == chat and got.usage.output_tokens > 0
    assert client.audio.transcriptions.create(file=("a.flac", spoken_file("flac")),
                                              **common).text == chat
    assert client.audio.transcriptions.create(file=("a.wav", wav), response_format="text",
                                              **common) == chat
    events = list(client.audio.transcriptions.create(file=("a.wav", wav), stream=True,
                                                     **common))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == chat
    assert events[-1].type == "transcript.text.done" and events[-1].text == chat


@pytest.mark.parametrize("files, data, match", [
    ({"file": ("a.wav", b"not audio at all")}, {}, "not an audio file"),
    ({"file": ("a.wav", spoken_file("wav"))}, {"response_format": "srt"}, "response_format"),
    ({}, {"prompt": "hi"}, "file"),
])
def test_bad_transcriptions_are_400(server, files, data, match):
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    r = httpx.post(server.url + "/v1/audio/transcriptions", files=files or {"x": ("x", b"")},
                   data={"model": model, **data}, timeout=60)
    assert r.status_code == 400 and match in r.json()["error"]["message"], r.text


# -- WS /v1/realtime: a conversation over the openai package's realtime client -----------


def realtime_answer(conn, create: dict | None = None) -> tuple[list, str, bytes]:
    """Asks for a response; its events up to response.done, its text or transcript, and
    its audio."""
    conn.send({"type": "response.create", **({"response": create} if create else {})})
    events = []
    while not events or events[-1].type != "response.done":
        events.append(conn.recv())
    text = "".join(e.delta for e in events if e.type in (
        "response.output_text.delta", "response.output_audio_transcript.delta"))
    audio = b"".join(base64.b64decode(e.delta) for e in events
                     if e.type == "response.output_audio.delta")
    return events, text, audio


REALTIME_SPEECH = {"temperature": 0, "max_output_tokens": THINKER_TOKENS,
                   "stage_sampling_params": SPEECH["extra_body"]["stage_sampling_params"],
                   "audio": {"output": {"voice": "Ethan"}}}


def assert_no_request_runs(server, seconds: float = 10) -> None:
    """Within `seconds`, no stage's engine holds a request: what an abort everywhere leaves."""
    import re
    import time

    def running() -> float:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        return sum(float(v) for v in re.findall(
            r"^vllm:num_requests_running(?:{[^}]*})? (\S+)$", text, re.M))

    deadline = time.monotonic() + seconds
    while running() > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running() == 0


def realtime_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_realtime_text_turn_speaks_like_chat(server, client, hf_answer):
    """A text item and response.create: the transcript is HF's and the audio deltas are
    what the chat endpoint streams for the same conversation, in the protocol's order."""
    text, _ = hf_answer
    _, chat_audio = stream_speech(client, {"seed": SEED})
    with realtime_client(server).realtime.connect(model=model_name(client)) as conn:
        created = conn.recv()
        assert created.type == "session.created"
        assert created.session.output_modalities == ["audio"]
        conn.session.update(session=REALTIME_SPEECH)
        assert conn.recv().type == "session.updated"
        conn.conversation.item.create(item={
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": MESSAGES[0]["content"]}]})
        assert [conn.recv().type for _ in range(2)] == ["conversation.item.added",
                                                        "conversation.item.done"]
        events, transcript, audio = realtime_answer(conn)
    assert transcript == text
    np.testing.assert_array_equal(pcm16([audio]), pcm16(chat_audio))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.output_item.added",
                         "conversation.item.added", "response.content_part.added"]
    assert kinds.count("response.output_audio.delta") == CHUNKS
    done = events[-1].response
    assert done.status == "completed" and done.output[0].content[0].transcript == text
    assert done.usage.output_tokens == THINKER_TOKENS + TALKER_TOKENS


def test_realtime_audio_turn_answers_like_chat(server, client):
    """Input audio appended in pieces and committed: the text answer is chat's to the same
    audio (24 kHz pcm16, heard at the model's rate); the next turn keeps the history."""
    samples, _ = soundfile.read(io.BytesIO(spoken_file("wav")), dtype="int16")
    wav24 = base64.b64encode(spoken_file("wav")).decode()
    turn = {"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": wav24, "format": "wav"}}]}
    chat = client.chat.completions.create(model=model_name(client), messages=[turn],
                                          temperature=0, max_tokens=THINKER_TOKENS)
    answer = chat.choices[0].message.content
    follow = client.chat.completions.create(
        model=model_name(client), temperature=0, max_tokens=THINKER_TOKENS,
        messages=[turn, {"role": "assistant", "content": answer},
                  {"role": "user", "content": "And then?"}]).choices[0].message.content
    with realtime_client(server).realtime.connect(model=model_name(client)) as conn:
        conn.recv()
        conn.session.update(session={"output_modalities": ["text"], "temperature": 0,
                                     "max_output_tokens": THINKER_TOKENS})
        conn.recv()
        for piece in np.array_split(samples, 5):
            conn.input_audio_buffer.append(audio=base64.b64encode(piece.tobytes()).decode())
        conn.input_audio_buffer.commit()
        assert conn.recv().type == "input_audio_buffer.committed"
        conn.recv(), conn.recv()  # the user item, added and done
        assert realtime_answer(conn)[1] == answer
        conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "And then?"}]})
        conn.recv(), conn.recv()
        assert realtime_answer(conn)[1] == follow


def test_realtime_cancel_stops_every_stage_and_errors_keep_the_socket(server, client):
    """Bad events are `error` events on an open socket; response.cancel ends a long spoken
    answer as cancelled, with no request left in any stage, and the next one runs."""
    with realtime_client(server).realtime.connect(model=model_name(client)) as conn:
        conn.recv()
        for raw, code in [("{not json", "invalid_json"), ('{"type": "nothing.here"}',
                                                          "unknown_event"),
                          ('{"type": "input_audio_buffer.commit"}',
                           "input_audio_buffer_commit_empty"),
                          ('{"type": "input_audio_buffer.append", "audio": "!!"}',
                           "invalid_value"),
                          ('{"type": "response.cancel"}', "response_cancel_not_active")]:
            conn.send_raw(raw)
            event = conn.recv()
            assert event.type == "error" and event.error.code == code, (raw, event)
        conn.session.update(session={"audio": {"output": {"voice": "Nobody"}}})
        event = conn.recv()
        assert event.type == "error" and "unknown voice" in event.error.message
        conn.session.update(session={"stage_sampling_params": {
            "talker": {"max_tokens": 600, "stop_token_ids": [], "ignore_eos": True}}})
        conn.recv()
        conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Tell me everything."}]})
        conn.recv(), conn.recv()
        conn.response.create()
        while (event := conn.recv()).type != "response.output_audio.delta":
            pass
        conn.response.cancel()
        while (event := conn.recv()).type != "response.done":
            pass
        assert event.response.status == "cancelled"
        assert_no_request_runs(server)
        # The client played only part of the cancelled answer: it truncates the item.
        answer = event.response.output[0].id
        for bad, code in [({"item_id": "item_none", "audio_end_ms": 0}, "item_not_found"),
                          ({"item_id": answer, "audio_end_ms": 10 ** 7}, "invalid_value")]:
            conn.send({"type": "conversation.item.truncate", "content_index": 0, **bad})
            event = conn.recv()
            assert event.type == "error" and event.error.code == code, (bad, event)
        conn.send({"type": "conversation.item.truncate", "item_id": answer,
                   "content_index": 0, "audio_end_ms": 10})
        event = conn.recv()
        assert event.type == "conversation.item.truncated" and event.audio_end_ms == 10
        _, text, _ = realtime_answer(conn, {"output_modalities": ["text"]})
        assert text


def test_realtime_transcribes_committed_turns_like_the_endpoint(server, client):
    """`audio.input.transcription` on: a committed turn gets the transcript that
    /v1/audio/transcriptions gives for the same audio, as its item's event."""
    expected = client.audio.transcriptions.create(
        model=model_name(client), file=("turn.wav", spoken_file("wav"))).text
    samples, _ = soundfile.read(io.BytesIO(spoken_file("wav")), dtype="int16")
    with realtime_client(server).realtime.connect(model=model_name(client)) as conn:
        conn.recv()
        conn.session.update(session={"output_modalities": ["text"], "audio": {
            "input": {"transcription": {"model": "any", "language": 7}}}})
        event = conn.recv()
        assert event.type == "error" and "language" in event.error.message
        conn.session.update(session={"output_modalities": ["text"], "audio": {
            "input": {"transcription": {"model": "any"}}}})
        assert conn.recv().session.audio.input.transcription is not None
        append_pcm(conn, samples)
        conn.input_audio_buffer.commit()
        committed = conn.recv()
        assert committed.type == "input_audio_buffer.committed"
        while (event := conn.recv()).type != (
                "conversation.item.input_audio_transcription.completed"):
            pass
        assert event.item_id == committed.item_id and event.transcript == expected


def voiced(seconds: float, rate: int = 24000) -> np.ndarray:
    """A sung vowel: harmonics of a wavering 120 Hz pitch, which voice detectors take for
    speech (the tiny model understands none of it)."""
    t = np.arange(int(rate * seconds)) / rate
    phase = 2 * np.pi * np.cumsum(120 + 20 * np.sin(2 * np.pi * 3 * t)) / rate
    wave = sum(np.sin(k * phase) / k for k in range(1, 30))
    return (0.2 * wave / np.abs(wave).max() * 32767).astype("<i2")


def append_pcm(conn, samples: np.ndarray, piece_ms: int = 100) -> None:
    for piece in np.array_split(samples, max(1, len(samples) * 1000 // 24000 // piece_ms)):
        conn.input_audio_buffer.append(audio=base64.b64encode(piece.tobytes()).decode())


def test_realtime_server_vad_takes_turns_and_is_interrupted(server, client):
    """Server VAD: speech then silence is a turn (started, stopped, committed, answered),
    twice; speech while an answer is speaking cancels it within a chunk, the answer's item
    keeps what was sent, and no stage holds the request."""
    silence = np.zeros(24000, dtype="<i2")
    with realtime_client(server).realtime.connect(model=model_name(client)) as conn:
        conn.recv()
        conn.session.update(session={
            "output_modalities": ["text"], "temperature": 0, "max_output_tokens": 4,
            "audio": {"input": {"turn_detection": {"type": "server_vad",
                                                   "silence_duration_ms": 300}}}})
        assert conn.recv().session.audio.input.turn_detection.type == "server_vad"
        starts = []
        for _ in range(2):
            append_pcm(conn, np.concatenate([voiced(0.8), silence]))
            kinds = []
            while not kinds or kinds[-1] != "response.done":
                event = conn.recv()
                kinds.append(event.type)
                if event.type == "input_audio_buffer.speech_started":
                    starts.append(event.audio_start_ms)
                if event.type == "response.done":
                    assert event.response.status == "completed"
            assert [k for k in kinds if k.startswith("input_audio_buffer")] == [
                "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                "input_audio_buffer.committed"], kinds
        assert starts[0] == 0 and abs(starts[1] - (1800 - 300)) <= 60, starts

        conn.session.update(session={"output_modalities": ["audio"], "stage_sampling_params": {
            "talker": {"max_tokens": 600, "stop_token_ids": [], "ignore_eos": True}}})
        conn.recv()
        append_pcm(conn, np.concatenate([voiced(0.8), silence]))
        while (event := conn.recv()).type != "response.output_audio.delta":
            pass
        transcript = []
        append_pcm(conn, voiced(0.5))
        after = []
        while (event := conn.recv()).type != "response.done":
            if event.type == "response.output_audio_transcript.delta":
                transcript.append(event.delta)
            if after or event.type == "input_audio_buffer.speech_started":
                after.append(event.type)
        assert after.count("response.output_audio.delta") <= 1, after
        assert event.response.status == "cancelled"
        (item,) = event.response.output
        assert item.status == "incomplete"
    assert_no_request_runs(server)


def test_a_dead_code2wav_is_restarted_and_speaks_again(server, client, hf_answer):
    """Last in this module: its server's code2wav is killed mid-answer. That answer ends with
    an error naming the stage, /health is 503 until the stage is back (the default
    --stage-restarts), and the next spoken answer is HF's again."""
    import os
    import signal
    import time

    import psutil

    (core,) = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
               if p.name() == "vllm-omni::Code2WavCore"]
    body = {"model": model_name(client), "messages": MESSAGES, "stream": True,
            "modalities": ["text", "audio"], "audio": {"format": "pcm16"},
            "stage_sampling_params": {"talker": {"max_tokens": 600, "stop_token_ids": [],
                                                 "ignore_eos": True}}}
    events = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                delta = (events[-1].get("choices") or [{}])[0].get("delta", {})
                if delta.get("audio", {}).get("data") and core.is_running():
                    os.kill(core.pid, signal.SIGKILL)
    error = events[-1]["error"]
    assert error["code"] == 503 and "stage 'code2wav'" in error["message"]

    def health_becomes(status: int, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while httpx.get(server.url + "/health", timeout=5).status_code != status:
            assert time.monotonic() < deadline, f"/health never answered {status}"
            time.sleep(0.2)

    health_becomes(503, 30)
    health_becomes(200, 180)
    text, waveform = hf_answer
    transcript, data = stream_speech(client, {"seed": SEED, "stream": False})
    assert transcript == text
    np.testing.assert_allclose(pcm16(data), waveform, atol=1.5 / 32768)
