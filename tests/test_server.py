"""The OpenAI-compatible server, as a real `vllm serve MODEL --omni` process, through the
openai client and raw HTTP."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import openai
import psutil
import pytest
from conftest import API_KEY, SERVED_NAME, SERVER_MAX_MODEL_LEN
from vllm import SamplingParams

MESSAGES = [{"role": "user", "content": "Tell me a story about a cat"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def raw_post(server, path: str, body: bytes | str, key: str = API_KEY) -> httpx.Response:
    return httpx.post(
        server.url + path,
        content=body,
        timeout=60,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )


KEY_HEADER = {"Authorization": f"Bearer {API_KEY}"}


def metric(server, name: str, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10, headers=KEY_HEADER).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [SERVED_NAME]


def test_chat_greedy_equals_vllm_and_reports_usage(client, vllm_llm):
    resp = client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, temperature=0, max_tokens=12
    )
    ref = vllm_llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12))[0]
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.model == SERVED_NAME


def test_chat_streaming_equals_non_streaming(client):
    kwargs = dict(model=SERVED_NAME, messages=MESSAGES, temperature=0, max_tokens=12)
    reply = client.chat.completions.create(**kwargs)
    full = reply.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert len({c.id for c in chunks}) == 1
    # Extension: how long each stage took, in the body and in the stream's usage chunk.
    assert set(reply.stage_seconds) == set(chunks[-1].stage_seconds) == {"llm"}
    assert 0 < chunks[-1].stage_seconds["llm"] < 60


def test_completions_greedy_equals_vllm_and_streams(client, vllm_llm):
    prompts = ["Hello, my name is", "The capital of France is"]
    resp = client.completions.create(
        model=SERVED_NAME, prompt=prompts, temperature=0, max_tokens=10
    )
    ref = vllm_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10))
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == [
        r.outputs[0].text for r in ref
    ]
    assert resp.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in ref)
    streamed = ["", ""]
    for chunk in client.completions.create(
        model=SERVED_NAME, prompt=prompts, temperature=0, max_tokens=10, stream=True
    ):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [r.outputs[0].text for r in ref]


def test_per_stage_sampling_override(client):
    base = dict(model=SERVED_NAME, messages=MESSAGES, temperature=1.0, max_tokens=30)
    resp = client.chat.completions.create(
        **base, extra_body={"stage_sampling_params": {"llm": {"max_tokens": 3}}}
    )
    assert resp.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError, match="unknown stages"):
        client.chat.completions.create(
            **base, extra_body={"stage_sampling_params": {"talker": {"temperature": 0}}}
        )


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)


# `"messages": false` reaches a vLLM validator that iterates it before pydantic checks it.
@pytest.mark.parametrize("body", ['{"messages": [', "[1, 2]", "\xff\xfe", '{"messages": false}'])
def test_malformed_json_is_400(server, body):
    resp = raw_post(server, "/v1/chat/completions", body)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["code"] == 400 and err["message"]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": "many"}, "n"),
        ({"messages": "not a list"}, "messages"),
        ({"logprobs": True}, "logprobs"),
        # An openai-harmony message (gpt-oss's format), which vLLM's union admits and its
        # chat renderer cannot read: found by tests/test_fuzz.py as a 500.
        ({"messages": [{"author": {"role": "user"}, "content": []}]}, "messages[0]"),
    ],
)
def test_invalid_parameters_are_400(client, extra, param):
    body = {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**body)
    assert param in str(err.value)


def test_prompt_longer_than_context_is_400(client):
    long_prompt = "one two three four " * SERVER_MAX_MODEL_LEN  # ~4 tokens per repeat
    with pytest.raises(openai.BadRequestError, match=r"(?i)context|max_model_len|too long"):
        client.chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": long_prompt}], max_tokens=4
        )
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=SERVED_NAME, prompt=long_prompt, max_tokens=4)


def test_api_key_is_required(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_health_and_metrics(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=2)
    assert httpx.get(server.url + "/metrics").status_code == 401  # the key guards it too
    text = httpx.get(server.url + "/metrics", headers=KEY_HEADER).text
    assert re.search(r'vllm_omni:http_requests_total\{endpoint="chat",status="200"\} [1-9]', text)
    assert "vllm:generation_tokens_total" in text  # vLLM's own engine metrics are exported too


def engine_process(server) -> psutil.Process:
    return next(
        p for p in psutil.Process(server.proc.pid).children(recursive=True)
        if "EngineCore" in " ".join(p.cmdline()) or p.name().startswith("VLLM::Engine")
    )


def _hang_up_on_a_stalled_stream(server, body: dict, headers: dict, engine: psutil.Process) -> bool:
    """Stream `body`, freeze the engine after the first lines, and read what the server had
    already sent. True: the stream stalled (the request is in flight) and the client hung up.
    False: the request had already finished (a loaded machine can delay this process that long)."""
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers=headers,
        timeout=httpx.Timeout(60, read=5),
    ) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for _ in range(3):
            next(lines)
        os.kill(engine.pid, signal.SIGSTOP)
        try:
            for line in lines:
                if line == "data: [DONE]":
                    return False
        except httpx.ReadTimeout:
            return True  # leaving the block closes the connection
    return False


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request(server, stream):
    body = {
        "model": SERVED_NAME,
        "messages": MESSAGES,
        "stream": stream,
        "max_tokens": 900,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    # The tiny model writes 900 tokens in well under a second, so the engine is frozen while the
    # client hangs up: the server must notice the disconnect itself, before the request can end.
    engine = engine_process(server)
    for _attempt in range(5):
        generated_before = metric(server, "vllm:generation_tokens_total")
        finished_before = metric(server, "vllm:request_success_total")
        gone_before = metric(
            server, "vllm_omni:http_requests_total", endpoint="chat", status="499"
        )
        try:
            if stream:
                hung_up = _hang_up_on_a_stalled_stream(server, body, headers, engine)
            else:
                os.kill(engine.pid, signal.SIGSTOP)
                with pytest.raises(httpx.ReadTimeout):  # the client gives up and hangs up
                    httpx.post(
                        server.url + "/v1/chat/completions",
                        json=body,
                        headers=headers,
                        timeout=httpx.Timeout(60, read=0.3),
                    )
                hung_up = True
            deadline = time.monotonic() + 30
            while hung_up and (
                metric(server, "vllm_omni:http_requests_total", endpoint="chat", status="499")
                <= gone_before
            ):
                assert time.monotonic() < deadline, "the server never saw the disconnect"
                time.sleep(0.2)
            at_hang_up = metric(server, "vllm:generation_tokens_total")  # engine still frozen
        finally:
            os.kill(engine.pid, signal.SIGCONT)
        if hung_up:
            break
    else:
        pytest.fail("every streamed request finished before the engine could be frozen")
    deadline = time.monotonic() + 30
    while metric(server, "vllm:num_requests_running") > 0:
        assert time.monotonic() < deadline, "the engine kept running the request"
        time.sleep(0.2)
    time.sleep(1)
    # Stopped: at most a few steps after the engine resumed (how far it got before the freeze
    # depends on the machine's load), short of the 900 tokens asked, never finished as done.
    generated = metric(server, "vllm:generation_tokens_total")
    assert generated - at_hang_up < 50
    assert generated - generated_before < 900
    assert metric(server, "vllm:request_success_total") == finished_before


def test_modalities(client):
    resp = client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, max_tokens=3, modalities=["text"]
    )
    assert resp.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError, match=r"cannot output \['audio'\]"):
        client.chat.completions.create(
            model=SERVED_NAME,
            messages=MESSAGES,
            max_tokens=3,
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "wav"},
        )


def test_speech_on_a_pipeline_that_does_not_speak_is_400(client):
    with pytest.raises(openai.BadRequestError, match="does not speak"):
        client.audio.speech.create(model=SERVED_NAME, voice="Ethan", input="Hello.")
