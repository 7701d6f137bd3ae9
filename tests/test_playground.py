"""The web playground at / in a real browser (headless Chromium via Playwright), against the
demo server of the README's first command, with an API key."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from conftest import DEMO_AUTH, DEMO_KEY, screenshot
from PIL import Image

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def open_page(browser, demo_server, width: int = 1100, height: int = 900):
    context = browser.new_context(viewport={"width": width, "height": height})
    page = context.new_page()
    page.goto(demo_server.url + "/")
    # The key is asked for (the info route needs it) and sent from then on.
    page.get_by_label("This server needs an API key").fill(DEMO_KEY)
    page.get_by_role("button", name="Connect").click()
    page.get_by_role("tab", name="Chat").wait_for()
    assert not page.get_by_label("This server needs an API key").is_visible()
    return context, page


@pytest.fixture
def page(browser, demo_server):
    context, page = open_page(browser, demo_server)
    yield page
    context.close()


def api(demo_server, path: str, body: dict) -> httpx.Response:
    return httpx.post(demo_server.url + path, json=body, timeout=120, headers=DEMO_AUTH)


def test_the_page_is_public_and_the_api_is_not(demo_server):
    assert httpx.get(demo_server.url + "/").status_code == 200
    assert "vLLM-omni" in httpx.get(demo_server.url + "/").text
    assert httpx.get(demo_server.url + "/playground/app.js").status_code == 200
    assert httpx.get(demo_server.url + "/v1/omni/info").status_code == 401
    info = httpx.get(demo_server.url + "/v1/omni/info", headers=DEMO_AUTH).json()
    assert info["outputs"] == ["image", "text"] and info["audio"] is None
    assert info["image"]["defaults"]["height"] == 32
    # The demo's short served name, not its cache folder's path.
    assert info["model"] == "omni-demo"
    models = httpx.get(demo_server.url + "/v1/models", headers=DEMO_AUTH).json()["data"]
    assert [m["id"] for m in models] == ["omni-demo"]


def test_tabs_follow_the_pipeline_and_the_keyboard(page):
    tabs = page.get_by_role("tab")
    assert tabs.all_inner_texts() == ["Chat", "Images", "Pipeline"]  # no speech in the demo
    assert page.locator("#model-line").inner_text().startswith("omni-demo · pipeline demo")
    # The stage-settings example names one of the demo's own stages.
    assert page.locator("#chat-stages").get_attribute("placeholder") == \
        '{"llm":{"max_tokens":100}}'
    page.get_by_role("tab", name="Chat").focus()
    page.keyboard.press("ArrowRight")
    assert page.get_by_role("tab", name="Images").get_attribute("aria-selected") == "true"
    assert page.get_by_label("Prompt", exact=True).is_visible()
    assert not page.get_by_label("Message").is_visible()


def test_chat_streams_text(page):
    page.get_by_label("Message").fill("hello there")
    page.get_by_label("Message").press("Enter")
    answer = page.locator(".msg.assistant")
    answer.wait_for()
    page.wait_for_function(
        "() => document.querySelector('.msg.assistant span').textContent.length > 0")
    page.wait_for_function("() => !document.getElementById('chat-send').disabled")
    assert page.locator(".msg.user").inner_text() == "hello there"
    assert answer.inner_text().strip()
    screenshot(page, "playground-chat")


def test_an_image_of_a_seven_lands_in_the_gallery(page, demo_server):
    page.get_by_role("tab", name="Images").click()
    page.get_by_label("Prompt", exact=True).fill("a handwritten digit seven")
    page.get_by_label("Seed", exact=True).fill("7")
    page.get_by_label("Steps", exact=True).fill("8")
    page.get_by_role("button", name="Generate").click()
    image = page.locator("#gallery figure img").first
    image.wait_for()
    src = image.get_attribute("src")
    shown = Image.open(io.BytesIO(base64.b64decode(src.partition(",")[2])))
    assert shown.size == (32, 32)
    assert page.evaluate("() => document.querySelector('#gallery img').naturalWidth") == 32
    # The same request through the API gives the same picture.
    direct = api(demo_server, "/v1/images/generations",
                 {"prompt": "a handwritten digit seven", "seed": 7, "num_inference_steps": 8,
                  "size": "32x32"}).json()
    assert direct["data"][0]["b64_json"] == src.partition(",")[2]
    caption = page.locator("#gallery figcaption").first.inner_text()
    assert "seed 7" in caption and "32x32" in caption
    screenshot(page, "playground-images")
    # The stages that ran and their time show in the pipeline tab.
    page.get_by_role("tab", name="Pipeline").click()
    page.locator("#plan tr").nth(2).wait_for()
    timings = page.locator("#timings").inner_text()
    assert "digits" in timings and "llm" not in timings
    plan = page.locator("#plan").inner_text()
    assert "llm" in plan and "digits" in plan and "usable" in plan
    screenshot(page, "playground-pipeline")


def test_a_bad_parameter_shows_the_servers_error(page, demo_server):
    page.get_by_role("tab", name="Images").click()
    page.get_by_label("Steps", exact=True).fill("0")
    page.get_by_role("button", name="Generate").click()
    error = page.get_by_role("alert")
    error.wait_for()
    want = api(demo_server, "/v1/images/generations",
               {"prompt": "a handwritten digit seven", "num_inference_steps": 0, "size": "32x32"})
    assert want.status_code == 400
    assert error.inner_text() == want.json()["error"]["message"]


def test_phone_width(browser, demo_server):
    context, page = open_page(browser, demo_server, 390, 844)
    page.get_by_role("tab", name="Images").click()
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 390
    screenshot(page, "playground-phone")
    context.close()
