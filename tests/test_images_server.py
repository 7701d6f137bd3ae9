"""The images API through a real server and the openai client, on tiny diffusers pipelines."""

from __future__ import annotations

import base64
import concurrent.futures
import functools
import io
import re
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from conftest import ServerProcess, wait_for
from PIL import Image

from vllm_omni.testing.tiny_lora import make_lora
from vllm_omni.testing.tiny_models import make_tiny

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = {"num_inference_steps": 4}


def served(name: str, tmp_path_factory, *flags: str):
    folder = make_tiny(name, tmp_path_factory.mktemp("img") / name)
    srv = ServerProcess([str(folder), *flags], tmp_path_factory.mktemp("log") / f"{name}.log")
    return folder, srv


@pytest.fixture(scope="module")
def flux_loras(tmp_path_factory) -> dict[str, str]:
    """Two adapters for flux-tiny, of different ranks on different layers, and a third
    loaded at run time."""
    folder = make_tiny("flux-tiny", tmp_path_factory.mktemp("img") / "flux-tiny")
    out = tmp_path_factory.mktemp("lora")
    return {
        "folder": folder,
        "ink": str(make_lora(folder, out / "ink", seed=1)),
        "clay": str(make_lora(folder, out / "clay", seed=2, rank=2,
                              targets=("to_q", "to_v", "proj_mlp", "ff.net.2"))),
        "glass": str(make_lora(folder, out / "glass", seed=3, rank=8, alpha=4)),
    }


@pytest.fixture(scope="module")
def flux_server(tmp_path_factory, flux_loras):
    # Step caching on, at threshold 0: every step still computed, images as diffusers'.
    folder = flux_loras["folder"]
    flags = ["--cache-backend", "block", "--cache-config", '{"threshold": 0}',
             "--lora-modules", f"ink={flux_loras['ink']}", f"clay={flux_loras['clay']}"]
    srv = ServerProcess([str(folder), *flags], tmp_path_factory.mktemp("log") / "flux.log")
    yield folder, srv
    assert srv.stop(), "processes of the server were still alive after SIGTERM"


def decode(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


@functools.cache
def reference_pipeline(folder):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference_pil(folder, prompt: str, seed: int, n: int = 1, **kw) -> list[Image.Image]:
    pipe = reference_pipeline(folder)
    gen = torch.Generator().manual_seed(seed)
    return pipe(prompt, generator=gen, num_images_per_prompt=n, **kw).images


def assert_same_image(got: Image.Image, want: Image.Image) -> None:
    a, b = np.asarray(got, dtype=np.int16), np.asarray(want, dtype=np.int16)
    assert a.shape == b.shape
    # 8-bit rounding of float images equal within 1e-4 can differ by one level.
    assert np.abs(a - b).max() <= 1


def test_every_endpoint_checks_the_model_and_the_stage_names(flux_server):
    folder, srv = flux_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.images.generate(model="nope", prompt="a cat", extra_body=STEPS)
    png = io.BytesIO()
    Image.new("RGB", (64, 64)).save(png, format="PNG")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.images.edit(model="nope", image=("in.png", png.getvalue()), prompt="a cat")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match=r"unknown stages \['nope'\]"):
        client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "x"}],
            extra_body={"stage_sampling_params": {"nope": {"seed": 1}}})


def test_images_generate_equals_diffusers(flux_server):
    folder, srv = flux_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
    r = client.images.generate(
        prompt="a red cat", size="96x64", n=2, extra_body={**STEPS, "seed": 5}
    )
    got = [decode(d.b64_json) for d in r.data]
    assert [im.format for im in got] == ["PNG", "PNG"]
    want = reference_pil(folder, "a red cat", 5, n=2, width=96, height=64, **STEPS)
    for g, w in zip(got, want, strict=True):
        assert_same_image(g, w)
    jpeg = client.images.generate(
        prompt="a red cat", size="64x64", output_format="jpeg", extra_body=STEPS
    )
    assert decode(jpeg.data[0].b64_json).format == "JPEG"


def test_cache_settings_and_stats(flux_server):
    folder, srv = flux_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
    r = client.images.generate(prompt="a red cat", size="64x64", extra_body={**STEPS, "seed": 1})
    assert r.cache == {"method": "block", "computed_steps": 4, "cached_steps": 0}
    # A request's settings go over the server's: reuse as often as the guards allow.
    cache = {"method": "teacache", "threshold": 1e9, "warmup_steps": 1, "max_consecutive": 2}
    r = client.images.generate(
        prompt="a red cat", size="64x64", extra_body={**STEPS, "seed": 1, "cache": cache}
    )
    assert r.cache == {"method": "teacache", "computed_steps": 2, "cached_steps": 2}
    for bad, words in [({"threshold": -1}, "cache.threshold"), ({"first_blocks": 9}, "no block")]:
        with pytest.raises(openai.BadRequestError, match=words):
            client.images.generate(prompt="x", size="64x64", extra_body={"cache": bad})


def test_concurrent_requests_get_their_own_images(flux_server):
    folder, srv = flux_server
    prompts = [f"picture number {i}" for i in range(6)]

    async def all_at_once():
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none")
        import asyncio

        return await asyncio.gather(*[
            client.images.generate(prompt=p, size="64x64", extra_body={**STEPS, "seed": i})
            for i, p in enumerate(prompts)
        ])

    import asyncio

    results = asyncio.run(all_at_once())
    for i, (p, r) in enumerate(zip(prompts, results, strict=True)):
        want = reference_pil(folder, p, i, width=64, height=64, **STEPS)[0]
        assert_same_image(decode(r.data[0].b64_json), want)


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompt": "x", "size": "63x64"}, "multiple of"),
        ({"prompt": "x", "size": "large"}, "size"),
        ({"prompt": "x", "response_format": "url"}, "response_format"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "num_inference_steps": -1}, "num_inference_steps"),
        ({"prompt": "x", "true_cfg_scale": 3.0}, "negative_prompt"),
        ({"prompt": "x", "style": "vivid"}, "style"),
    ],
)
def test_bad_image_requests_are_400(flux_server, body, field):
    _, srv = flux_server
    r = httpx.post(srv.url + "/v1/images/generations", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_chat_returns_images_and_text_routes_refuse(flux_server):
    folder, srv = flux_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "a green tree"}],
        extra_body={"stage_sampling_params": {"dit": {**STEPS, "seed": 2, "height": 64,
                                                      "width": 64}}},
    )
    (part,) = r.choices[0].message.content
    url = part["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    want = reference_pil(folder, "a green tree", 2, width=64, height=64, **STEPS)[0]
    assert_same_image(decode(url.partition(",")[2]), want)
    with pytest.raises(openai.BadRequestError, match="does not output text"):
        client.completions.create(model=model, prompt="hi")
    with pytest.raises(openai.BadRequestError, match="does not make videos"):
        client.videos.create(model=model, prompt="a cat")
    with pytest.raises(openai.BadRequestError, match="makes images, not videos"):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "a cat"}],
            extra_body={"stage_sampling_params": {"dit": {**STEPS, "num_frames": 5}}})
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "a green tree"}], stream=True,
        extra_body={"stage_sampling_params": {"dit": {**STEPS, "seed": 2, "height": 64,
                                                      "width": 64}}},
    )
    parts = [c.choices[0].delta.content for c in stream]
    assert parts[0] == "" and len(parts) == 2  # the role, then the images in one delta
    ((streamed_part,),) = parts[1:]
    assert streamed_part["image_url"]["url"] == url
    metrics = httpx.get(srv.url + "/metrics").text
    assert 'vllm_omni:diffusion_steps_total{stage="dit"}' in metrics


def test_images_edit(tmp_path_factory):
    folder, srv = served("sd3-img2img-tiny", tmp_path_factory)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        rng = np.random.default_rng(1)
        source = Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))
        buf = io.BytesIO()
        source.save(buf, format="PNG")
        r = client.images.edit(
            image=("in.png", buf.getvalue(), "image/png"),
            prompt="make it blue",
            extra_body={**STEPS, "seed": 4, "strength": 0.8},
        )
        want = reference_pil(folder, "make it blue", 4, image=source, strength=0.8, **STEPS)[0]
        assert_same_image(decode(r.data[0].b64_json), want)
        bad = httpx.post(srv.url + "/v1/images/edits", data={"prompt": "x"}, timeout=30)
        assert bad.status_code == 400 and "image" in bad.json()["error"]["message"]
        junk = httpx.post(srv.url + "/v1/images/edits", data={"prompt": "x"},
                          files={"image": ("a.png", b"not an image")}, timeout=30)
        assert junk.status_code == 400 and "readable" in junk.json()["error"]["message"]
    finally:
        assert srv.stop()


def lora_reference(folder, path: str, scale: float, prompt: str, seed: int,
                   **kw) -> Image.Image:
    """diffusers' pipeline with the adapter loaded at `scale` (a fresh pipeline: loading
    one changes it)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(path, adapter_name="it")
    pipe.set_adapters(["it"], adapter_weights=[scale])
    return pipe(prompt, generator=torch.Generator().manual_seed(seed), **kw).images[0]


def psnr(a: Image.Image, b: Image.Image) -> float:
    x, y = np.asarray(a, dtype=np.float64) / 255, np.asarray(b, dtype=np.float64) / 255
    return float(10 * np.log10(1 / max(((x - y) ** 2).mean(), 1e-12)))


def test_requests_with_different_adapters_share_a_batch_and_equal_diffusers(
        flux_server, flux_loras):
    """Two adapters (one at a scale) and the base model, at once: each image is diffusers'
    with that adapter loaded at that scale, and an adapter does change the image."""
    import asyncio

    folder, srv = flux_server
    base = openai.OpenAI(base_url=srv.url + "/v1", api_key="none").models.list().data[0].id
    steps = {"num_inference_steps": 8}
    asks = [("ink", 0.8, "a red cat", 3), ("clay", None, "a blue dog", 4),
            (base, None, "a green cow", 5), ("ink", None, "a red cat", 3)]

    async def all_at_once():
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none")
        return await asyncio.gather(*[client.images.generate(
            model=model, prompt=prompt, size="64x64", extra_body={
                **steps, "seed": seed, **({"lora_scale": scale} if scale else {})})
            for model, scale, prompt, seed in asks])

    results = asyncio.run(all_at_once())
    got = [decode(r.data[0].b64_json) for r in results]
    for (model, scale, prompt, seed), image in zip(asks, got, strict=True):
        if model == base:
            want = reference_pil(folder, prompt, seed, width=64, height=64, **steps)[0]
        else:
            want = lora_reference(folder, flux_loras[model], 1.0 if scale is None else scale,
                                  prompt, seed, width=64, height=64, **steps)
        assert psnr(image, want) >= 50, (model, scale)
    plain = reference_pil(folder, "a red cat", 3, width=64, height=64, **steps)[0]
    assert psnr(got[3], plain) < 40 and psnr(got[0], got[3]) < 50


def test_adapters_are_models_loaded_and_unloaded_at_run_time(flux_server, flux_loras):
    folder, srv = flux_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
    base = client.models.list().data[0].id
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {base, "ink", "clay"}
    assert listed["ink"].parent == base and listed["ink"].root == flux_loras["ink"]

    def post(route: str, body: dict) -> httpx.Response:
        return httpx.post(f"{srv.url}/v1/{route}", json=body, timeout=60)

    r = post("load_lora_adapter", {"lora_name": "glass", "lora_path": flux_loras["glass"]})
    assert r.status_code == 200, r.text
    assert "glass" in {m.id for m in client.models.list().data}
    made = client.images.generate(model="glass", prompt="a cup", size="64x64",
                                  extra_body={**STEPS, "seed": 7})
    want = lora_reference(folder, flux_loras["glass"], 1.0, "a cup", 7, width=64, height=64,
                          **STEPS)
    assert psnr(decode(made.data[0].b64_json), want) >= 50
    assert post("unload_lora_adapter", {"lora_name": "glass"}).status_code == 200
    with pytest.raises(openai.NotFoundError, match="glass"):
        client.images.generate(model="glass", prompt="a cup", size="64x64", extra_body=STEPS)

    other = make_tiny("flux-small", Path(flux_loras["glass"]).parent.parent / "flux-small")
    wrong = make_lora(other, Path(flux_loras["glass"]).parent / "wrong", seed=4)
    for body, status, words in [
        ({"lora_name": "ink", "lora_path": flux_loras["clay"]}, 400, "already served"),
        ({"lora_name": "x", "lora_path": "/nowhere"}, 400, "no LoRA adapter at"),
        # Another shape of the same family: named by the first module it does not fit.
        ({"lora_name": "x", "lora_path": str(wrong)}, 400,
         r"targets '[\w.]+', which this model does not have|does not fit '[\w.]+'"),
        ({"lora_name": "x"}, 400, "lora_path"),
    ]:
        r = post("load_lora_adapter", body)
        assert r.status_code == status, r.text
        assert re.search(words, r.json()["error"]["message"]), r.text
    r = post("unload_lora_adapter", {"lora_name": "glass"})
    assert r.status_code == 404 and "glass" in r.json()["error"]["message"], r.text
    with pytest.raises(openai.BadRequestError, match="lora_scale"):
        client.images.generate(prompt="x", size="64x64", extra_body={"lora_scale": 0.5})
    with pytest.raises(openai.BadRequestError, match="lora_scale"):
        client.images.generate(model="ink", prompt="x", size="64x64",
                               extra_body={"lora_scale": 99})
    assert {m.id for m in client.models.list().data} == {base, "ink", "clay"}


@pytest.fixture(scope="module")
def int8_server(tmp_path_factory, flux_loras):
    """flux-tiny with int8 weights, asked for by vLLM's own flag, and an adapter on them."""
    srv = ServerProcess([str(flux_loras["folder"]), "--quantization",
                         "int8_per_channel_weight_only", "--lora-modules",
                         f"ink={flux_loras['ink']}"], tmp_path_factory.mktemp("log") / "q.log")
    yield flux_loras["folder"], srv
    assert srv.stop(), "processes of the server were still alive after SIGTERM"


def test_int8_weights_draw_near_fp32_take_adapters_and_plan_less(int8_server, flux_server,
                                                                 flux_loras):
    """int8 weight-only: within 30 dB of diffusers' fp32 image, also with an adapter on the
    quantized base, and the plan holds the transformer at a byte per weight (the rest of
    the pipeline as it was)."""
    folder, srv = int8_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
    steps = {"num_inference_steps": 6, "seed": 11}
    r = client.images.generate(prompt="a red cat", size="64x64", extra_body=steps)
    want = reference_pil(folder, "a red cat", 11, width=64, height=64, num_inference_steps=6)
    assert 30 <= psnr(decode(r.data[0].b64_json), want[0]) < 100  # close, not the same
    r = client.images.generate(model="ink", prompt="a red cat", size="64x64",
                               extra_body=steps)
    want = lora_reference(folder, flux_loras["ink"], 1.0, "a red cat", 11, width=64,
                          height=64, num_inference_steps=6)
    assert psnr(decode(r.data[0].b64_json), want) >= 30

    def weights(server) -> int:
        (stage,) = httpx.get(server.url + "/v1/omni/plan", timeout=10).json()["stages"]
        return stage["weights"]

    from safetensors import safe_open

    transformer = 0
    for f in (folder / "transformer").glob("*.safetensors"):
        with safe_open(f, "pt") as weights_file:
            transformer += sum(4 * int(np.prod(weights_file.get_slice(k).get_shape()))
                               for k in weights_file.keys())  # fp32 values
    assert weights(flux_server[1]) - weights(srv) == pytest.approx(transformer * 3 / 4,
                                                                   rel=0.001)


def test_killed_engine_core_fails_requests_and_health(flux_server):
    """Last in this module: it kills the server's diffusion engine core."""
    import os
    import signal
    import time

    import psutil

    _, srv = flux_server
    cores = [
        p for p in psutil.Process(srv.proc.pid).children(recursive=True)
        if "resource_tracker" not in " ".join(p.cmdline())
    ]
    assert len(cores) == 1, [p.cmdline() for p in cores]

    def long_request():
        body = {"prompt": "x", "size": "96x80", "num_inference_steps": 1000}
        return httpx.post(srv.url + "/v1/images/generations", json=body, timeout=120)

    def steps() -> float:
        text = httpx.get(srv.url + "/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("vllm_omni:diffusion_steps_total"))

    before = steps()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(long_request)
        wait_for(lambda: steps() > before, "the request's first steps")
        assert not pending.done()
        os.kill(cores[0].pid, signal.SIGKILL)
        start = time.monotonic()
        r = pending.result()
    assert r.status_code == 503, r.text
    assert time.monotonic() - start < 10
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 503


# A user's own scheduler, in a module of theirs: the shortest remaining work first, after
# the request's priority where the stage's policy is "priority".
FEWEST_STEPS = '''
from vllm_omni.engine.diffusion.scheduler import DiffusionScheduler


class FewestStepsFirst(DiffusionScheduler):
    def rank(self, req):
        *first, arrival = super().rank(req)
        return (*first, req.num_steps - req.step, arrival)
'''


@pytest.fixture(scope="module")
def scheduled_server(tmp_path_factory):
    """flux-tiny with the scheduler above named in its stage YAML (one image per
    transformer call, so the order requests advance in is the scheduler's alone)."""
    folder = make_tiny("flux-tiny", tmp_path_factory.mktemp("img") / "flux-tiny")
    own = tmp_path_factory.mktemp("own")
    (own / "fewest_steps.py").write_text(FEWEST_STEPS)
    (own / "pipeline.yaml").write_text(
        "name: scheduled\nstages:\n  - name: dit\n    engine: diffusion\n"
        "    output: image\n    final_output: true\n    engine_args:\n"
        "      scheduler_cls: fewest_steps:FewestStepsFirst\n"
        "      scheduling_policy: priority\n      max_batch_size: 1\n")
    srv = ServerProcess([str(folder), "--stage-configs-path", str(own / "pipeline.yaml")],
                        own / "server.log", env={"PYTHONPATH": str(own)})
    yield folder, srv
    assert srv.stop(), "processes of the server were still alive after SIGTERM"


def test_a_scheduler_of_ones_own_orders_the_requests(scheduled_server):
    """Two requests, the second sent once the first is denoising: the one the scheduler
    ranks first finishes first, whichever came first (the built-in fcfs would finish the
    first first each time), and each image is diffusers' for its seed."""
    folder, srv = scheduled_server

    def steps() -> float:
        text = httpx.get(srv.url + "/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("vllm_omni:diffusion_steps_total"))

    def finish_order(first: dict, second: dict) -> list[str]:
        done: list[str] = []

        def post(name: str, body: dict) -> Image.Image:
            r = httpx.post(srv.url + "/v1/images/generations", timeout=300,
                           json={"prompt": f"a {name} square", "size": "32x32", **body})
            assert r.status_code == 200, r.text
            done.append(name)
            return decode(r.json()["data"][0]["b64_json"])

        before = steps()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            a = pool.submit(post, "first", first)
            wait_for(lambda: steps() > before, "the first request's first steps")
            b = pool.submit(post, "second", second)
            images = {"first": (a.result(), first), "second": (b.result(), second)}
        for name, (image, body) in images.items():
            assert_same_image(image, reference_pil(
                folder, f"a {name} square", body["seed"], height=32, width=32,
                num_inference_steps=body["num_inference_steps"])[0])
        return done

    # Fewer steps left: the second request, although it came later.
    assert finish_order({"seed": 1, "num_inference_steps": 400},
                        {"seed": 2, "num_inference_steps": 2}) == ["second", "first"]
    # A lower priority value first: the OpenAI request's field, under the policy the YAML
    # sets; the first has fewer steps left when the second arrives, and still waits.
    assert finish_order({"seed": 3, "num_inference_steps": 400, "priority": 1},
                        {"seed": 4, "num_inference_steps": 400, "priority": 0}) == [
        "second", "first"]
