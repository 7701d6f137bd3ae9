"""Bad input, generated: schemathesis reads the served app's own /openapi.json and sends each
route a bounded, seeded set of bodies (valid ones and ones that break the schema). Whatever
comes in, the server answers it without a 5xx, every 4xx is OpenAI-shaped, and it stays up."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from conftest import DEMO_AUTH
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


# Every route of the API, as the schema lists it: a new route fails the first test below
# until it is fuzzed too.
ROUTES = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/images/generations"),
    ("POST", "/v1/images/edits"),
    ("POST", "/v1/audio/speech"),
    ("POST", "/v1/audio/transcriptions"),
    ("POST", "/v1/videos"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
    ("GET", "/v1/videos"),
    ("GET", "/v1/videos/{video_id}"),
    ("DELETE", "/v1/videos/{video_id}"),
    ("GET", "/v1/videos/{video_id}/content"),
    ("GET", "/v1/models"),
    ("GET", "/v1/omni/info"),
    ("GET", "/v1/omni/plan"),
    ("GET", "/health"),
    ("GET", "/metrics"),
]
EXAMPLES = 25  # per route and mode


@pytest.fixture(scope="module")
def api_schema(demo_server):
    return schemathesis.openapi.from_url(demo_server.url + "/openapi.json", headers=DEMO_AUTH)


def test_the_schema_lists_every_route(api_schema):
    listed = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert listed == set(ROUTES)


def assert_openai_error(response, where: str) -> None:
    body = response.json()
    assert set(body) == {"error"}, where
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"], where
    assert error["code"] == response.status_code, where
    assert isinstance(error["type"], str), where


# Positive: requests the schema allows; negative: bodies that break it (a GET route takes no
# input, so nothing can break its schema).
CASES = [(method, path, mode) for method, path in ROUTES
         for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
         if method == "POST" or mode == GenerationMode.POSITIVE]


@pytest.mark.parametrize("method, path, mode", CASES)
def test_no_generated_request_is_a_server_error(demo_server, api_schema, method, path, mode):
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    def send(case):
        response = case.call(headers=DEMO_AUTH, timeout=120)
        where = f"{response.status_code}: {response.text[:400]}\n{case.as_curl_command()}"
        assert response.status_code < 500, where
        if response.status_code >= 400:
            assert_openai_error(response, where)

    send()
    assert httpx.get(demo_server.url + "/health", timeout=10).status_code == 200
