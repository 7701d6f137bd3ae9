"""Wan text-to-video against diffusers' WanPipeline, offline and through OpenAI's Videos API
(the real openai client against a real server), with the job store's bounds and folder."""

from __future__ import annotations

import asyncio
import functools
import io
import re
import time

import av
import httpx
import numpy as np
import openai
import pytest
import torch
from conftest import ServerProcess, screenshot, settles
from PIL import Image

from vllm_omni.entrypoints.openai.protocol import OmniHTTPError
from vllm_omni.entrypoints.openai.video_jobs import VideoJob, VideoJobs
from vllm_omni.testing.tiny_lora import make_lora
from vllm_omni.testing.tiny_models import make_tiny

pytestmark = [pytest.mark.timeout(600)]

KEY = "video-key"
# Small enough to be quick, with several latent frames and guidance on (Wan's default 5.0).
SHAPE = {"height": 32, "width": 48, "num_frames": 9}


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    return make_tiny("wan-tiny", tmp_path_factory.mktemp("wan") / "wan-tiny")


@pytest.fixture(scope="module")
def reference(wan):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(wan)
    pipe.set_progress_bar_config(disable=True)

    def frames(prompt: str, seed: int, lora: tuple[str, float] | None = None,
               **kw) -> np.ndarray:
        """diffusers' frames; with `lora` (file, scale), from a pipeline with it loaded."""
        run = pipe
        if lora is not None:
            run = DiffusionPipeline.from_pretrained(wan)
            run.set_progress_bar_config(disable=True)
            run.load_lora_weights(lora[0], adapter_name="it")
            run.set_adapters(["it"], adapter_weights=[lora[1]])
        gen = torch.Generator().manual_seed(seed)
        return run(prompt, generator=gen, output_type="np", **{**SHAPE, **kw}).frames[0]

    return frames


# -- the adapter: one engine, requests batched step by step ------------------------------


async def _video(engine, rid: str, prompt: str, **params):
    steps = []
    async for out in engine.generate(rid, prompt, {**SHAPE, "float_output": True, **params},
                                     None):
        steps.append(out.step)
    return out, steps


@pytest.mark.slow
def test_engine_batches_videos_equal_to_diffusers(wan, reference):
    """Requests with other prompts, seeds, step counts and guidance run in one batch; each
    video equals its own WanPipeline run. Wrong frame counts and sizes are ValueErrors."""
    from vllm_omni.engine.diffusion import AsyncDiffusionEngine, EngineOptions

    requests = [
        ("a red cat", {"seed": 3, "num_inference_steps": 4}),
        ("a blue dog", {"seed": 5, "num_inference_steps": 6, "negative_prompt": "ugly"}),
        ("green", {"seed": 7, "num_inference_steps": 4, "guidance_scale": 1.0}),
        # Step caching at threshold 0 decides every step and reuses none: still equal.
        ("a red cat", {"seed": 9, "num_inference_steps": 4,
                       "cache": {"method": "teacache", "threshold": 0}}),
    ]
    # A LoRA adapter on some rows of the batch (both guidance branches of its request).
    lora = str(make_lora(wan, wan.parent / "lora", seed=5))
    requests.append(("a red cat", {"seed": 3, "num_inference_steps": 4, "lora": "ink",
                                   "lora_scale": 0.7}))
    # A cache that reuses steps, in the same batch: its rows skip blocks, the others do not.
    cached = ("a red cat", {"seed": 3, "num_inference_steps": 4,
                            "cache": {"method": "block", "threshold": 100, "warmup_steps": 1}})
    engine = AsyncDiffusionEngine(str(wan), EngineOptions(progress_interval=0,
                                                          lora_modules={"ink": lora}))
    try:
        assert engine.info["family"] == "wan" and engine.info["step_level"]

        async def together():
            return await asyncio.gather(*(_video(engine, f"r{i}", p, **kw)
                                          for i, (p, kw) in enumerate([*requests, cached])))

        *results, (skipping, _) = asyncio.run(together())
        for bad, message in [({"num_frames": 8}, "4k\\+1"), ({"height": 40}, "multiple of 16"),
                             ({"true_cfg_scale": 2.0}, "guidance_scale")]:
            with pytest.raises(ValueError, match=message):
                asyncio.run(_video(engine, "bad", "x", **bad))
    finally:
        engine.shutdown()
    for (prompt, kw), (out, steps) in zip(requests, results, strict=True):
        assert steps == list(range(1, kw["num_inference_steps"] + 1))
        assert out.images is None and out.fps == 16 and out.video.shape == (9, 32, 48, 3)
        assert out.video.dtype == np.uint8  # 8-bit frames, the floats beside them as asked
        kw = dict(kw)
        kw.pop("cache", None)
        if kw.pop("lora", None):
            want = reference(prompt, kw.pop("seed"), lora=(lora, kw.pop("lora_scale")), **kw)
            assert np.abs(want - results[0][0].float_video).max() > 0.05  # it does change
        else:
            want = reference(prompt, kw.pop("seed"), **kw)
        np.testing.assert_allclose(out.float_video, want, atol=1e-4, rtol=0, err_msg=prompt)
        assert np.abs(out.video.astype(np.int16) - np.round(want * 255)).max() <= 1
    assert results[3][0].cache == {"method": "teacache", "computed_steps": 8, "cached_steps": 0}
    assert skipping.cache["cached_steps"] > 0 and np.isfinite(skipping.float_video).all()
    # it did skip work
    assert np.abs(skipping.float_video - results[0][0].float_video).max() > 1e-4


@pytest.fixture(scope="module")
def wan_i2v(tmp_path_factory):
    return make_tiny("wan-i2v-tiny", tmp_path_factory.mktemp("wan-i2v") / "wan-i2v-tiny")


def input_image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (32, 48, 3), np.uint8))


I2V = {"prompt": "a cat", "seed": 1, "num_inference_steps": 3}


@pytest.fixture(scope="module")
def i2v_reference(wan_i2v):
    """diffusers' video for `input_image(image_seed)` and the I2V request, made once each."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(wan_i2v)
    pipe.set_progress_bar_config(disable=True)

    @functools.cache
    def frames(image_seed: int) -> np.ndarray:
        return pipe(image=input_image(image_seed), prompt=I2V["prompt"], output_type="np",
                    num_inference_steps=I2V["num_inference_steps"],
                    generator=torch.Generator().manual_seed(I2V["seed"]), **SHAPE).frames[0]

    return frames


@pytest.mark.slow
def test_image_to_video_runs_whole_requests_equal_to_diffusers(wan_i2v, i2v_reference):
    """Wan 2.1 image-to-video (no step adapter yet) runs `pipeline(...)` per request and
    returns a video; its frame count is checked like text-to-video's."""
    from vllm_omni.config.loader import resolve_pipeline
    from vllm_omni.engine.diffusion import AsyncDiffusionEngine

    assert resolve_pipeline(wan_i2v).name == "video"
    image = input_image(0)
    engine = AsyncDiffusionEngine(str(wan_i2v))
    try:
        assert engine.info["takes_images"] and engine.info["makes_video"]
        assert engine.info["frame_step"] == 4 and not engine.info["step_level"]

        async def i2v(**params):
            outs = [o async for o in engine.generate("i2v", I2V["prompt"],
                                                     {**SHAPE, "float_output": True, **params},
                                                     [image])]
            return outs[-1]

        out = asyncio.run(i2v(seed=I2V["seed"], num_inference_steps=I2V["num_inference_steps"]))
        with pytest.raises(ValueError, match="4k\\+1"):
            asyncio.run(i2v(num_frames=6))
    finally:
        engine.shutdown()
    want = i2v_reference(0)
    assert out.fps == 16 and out.video.shape == (9, 32, 48, 3)
    np.testing.assert_allclose(out.float_video, want, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_image_to_video_over_the_videos_api(wan_i2v, i2v_reference, tmp_path):
    """`input_reference`, uploaded as the openai client sends it, conditions an
    image-to-video model's job: the video is diffusers' for that image and seed."""
    srv = ServerProcess([str(wan_i2v), "--api-key", KEY], tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
        png = io.BytesIO()
        input_image(0).save(png, format="PNG")  # lossless: the server decodes these pixels
        video = client.videos.create_and_poll(
            prompt=I2V["prompt"], size="48x32", poll_interval_ms=100,
            input_reference=("ref.png", png.getvalue(), "image/png"),
            extra_body={"num_frames": 9, "num_inference_steps": I2V["num_inference_steps"],
                        "seed": I2V["seed"]})
        assert video.status == "completed", video.error
        got = decode_mp4(client.videos.download_content(video.id).content)
        thumb = client.videos.download_content(video.id, variant="thumbnail").content
    finally:
        assert srv.stop(), "processes of the server were still alive after SIGTERM"
    want8 = np.round(i2v_reference(0) * 255)
    first = np.asarray(Image.open(io.BytesIO(thumb)), dtype=np.int16)
    assert np.abs(first - want8[0]).max() <= 1  # 8-bit rounding of diffusers' first frame
    assert got.shape == (9, 32, 48, 3) and psnr(got, want8) > 28  # H.264 is lossy
    # Another input image makes another video: the upload is what conditioned this one.
    other = np.round(i2v_reference(1) * 255)
    assert np.abs(first - other[0]).max() > 8


# -- offline: OmniLLM returns frames (PIL and float) with a progress bar over steps --------


@pytest.mark.slow
def test_offline_generate_returns_the_video(wan, reference, capsys):
    from vllm_omni import OmniLLM
    from vllm_omni.engine.diffusion import DiffusionParams

    with OmniLLM(str(wan)) as llm:
        assert llm.pipeline.name == "video"
        outs = llm.generate(["a red cat", "a blue dog"],
                            DiffusionParams(seed=3, num_inference_steps=4, float_output=True,
                                            **SHAPE))
    for prompt, out in zip(["a red cat", "a blue dog"], outs, strict=True):
        assert out.output_type == "video" and out.video.fps == 16
        assert len(out.video.frames) == 9 and out.video.frames[0].size == (48, 32)
        want = reference(prompt, 3, num_inference_steps=4)
        np.testing.assert_allclose(out.tensors["video"].numpy(), want, atol=1e-4, rtol=0)
        first = np.asarray(out.video.frames[0], dtype=np.int16)
        assert np.abs(first - np.round(want[0] * 255)).max() <= 1
    assert "Denoising steps" in capsys.readouterr().err


# -- the Videos API: the openai client, unchanged, against a real server -------------------


@pytest.fixture(scope="module")
def server(wan, tmp_path_factory):
    root = tmp_path_factory.mktemp("video-server")
    srv = ServerProcess([str(wan), "--api-key", KEY, "--video-dir", str(root / "videos"),
                         "--max-video-seconds", "4"], root / "server.log")
    yield srv
    assert srv.stop(), "processes of the server were still alive after SIGTERM"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def decode_mp4(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return 10 * np.log10(255**2 / mse)


@pytest.mark.slow
def test_create_poll_download_delete(client, server, reference):
    video = client.videos.create(
        prompt="a red cat", size="48x32",
        extra_body={"num_frames": 9, "num_inference_steps": 40, "seed": 3,
                    "cache": {"method": "teacache", "threshold": 0}})  # computes every step
    assert video.object == "video" and video.status in ("queued", "in_progress")
    assert video.size == "48x32" and video.seconds == "0.5625"  # 9 frames at 16 fps
    seen = []
    deadline = time.monotonic() + 300
    while video.status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, "the video job did not finish"
        seen.append(video.progress)
        time.sleep(0.05)
        video = client.videos.retrieve(video.id)
    assert video.status == "completed", video.error
    assert video.progress == 100 and video.completed_at >= video.created_at
    assert seen == sorted(seen), seen  # progress never goes back
    assert video.model_extra["denoising_steps"] == {"done": 40, "total": 40}
    assert video.model_extra["cache"]["computed_steps"] == 80  # both guidance branches

    want = reference("a red cat", 3, num_inference_steps=40)
    want8 = np.round(want * 255)
    got = decode_mp4(client.videos.download_content(video.id).content)
    assert got.shape == (9, 32, 48, 3)  # the frames and size asked for
    # H.264 is lossy (and 4:2:0 halves the colour resolution); another seed scores far lower.
    other = np.round(reference("a red cat", 4, num_inference_steps=40) * 255)
    assert psnr(got, want8) > 28 and psnr(got, other) < psnr(got, want8) - 4
    # The first frame without a codec: 8-bit rounding of diffusers' frame.
    thumb = client.videos.download_content(video.id, variant="thumbnail").content
    first = np.asarray(Image.open(io.BytesIO(thumb)), dtype=np.int16)
    assert np.abs(first - want8[0]).max() <= 1

    assert video.id in [v.id for v in client.videos.list()]
    deleted = client.videos.delete(video.id)
    assert deleted.deleted and deleted.id == video.id
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)


def steps_counted(server) -> float:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm_omni:diffusion_steps_total"))


@pytest.mark.slow
def test_deleting_a_running_job_aborts_it(client, server):
    video = client.videos.create(prompt="a long one", size="48x32",
                                 extra_body={"num_frames": 9, "num_inference_steps": 1000})
    deadline = time.monotonic() + 120
    while (running := client.videos.retrieve(video.id)).model_extra["denoising_steps"]["done"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # Progress counts the steps done while the job runs (a short job may finish unseen).
    steps = running.model_extra["denoising_steps"]
    assert running.status == "in_progress" and steps["total"] == 1000
    assert 0 < steps["done"] < 1000 and running.progress == steps["done"] // 10
    before_delete = steps_counted(server)
    assert client.videos.delete(video.id).deleted
    # No step runs for the deleted job: its counter stops (its last progress may still
    # arrive), far short of its 1000 steps.
    done = settles(lambda: steps_counted(server), quiet=1.5, timeout=20)
    assert done - before_delete < 200
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)


@pytest.mark.slow
@pytest.mark.parametrize("fields, status, message", [
    ({"size": "50x32"}, 400, "multiples of 16"),
    ({"size": "big"}, 400, "WIDTHxHEIGHT"),
    ({"num_frames": "8"}, 400, "4k\\+1"),
    ({"seconds": "12"}, 400, "over this server's limit of 4 s"),
    ({"seconds": "-1"}, 400, "seconds"),
    ({"num_inference_steps": "0"}, 400, "num_inference_steps"),
    ({"model": "sora-2"}, 404, "does not exist"),
    ({"colour": "red"}, 400, "colour"),
])
def test_bad_video_requests_are_4xx(server, fields, status, message):
    r = httpx.post(server.url + "/v1/videos", headers={"Authorization": f"Bearer {KEY}"},
                   data={"prompt": "a cat", "size": "48x32", **fields}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and re.search(message, error["message"]), error


@pytest.mark.slow
def test_missing_ids_and_unsupported_inputs_are_4xx(client):
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("video_missing")
    with pytest.raises(openai.NotFoundError):
        client.videos.delete("video_missing")
    with pytest.raises(openai.NotFoundError):
        client.videos.download_content("video_missing")
    png = io.BytesIO()
    Image.new("RGB", (48, 32)).save(png, format="PNG")
    with pytest.raises(openai.BadRequestError, match="text only"):
        client.videos.create(prompt="a cat", size="48x32",
                             input_reference=("ref.png", png.getvalue(), "image/png"))


# -- the job store: bounded count and age, and the folder ----------------------------------


def _job(store: VideoJobs) -> VideoJob:
    return VideoJob(id=store.new_id(), model="m", prompt="p", size="48x32", num_frames=9,
                    fps=16)


def test_jobs_are_bounded_and_survive_in_their_folder(tmp_path):
    async def scenario():
        store = VideoJobs(max_jobs=2, ttl=3600, folder=tmp_path)
        never = asyncio.Event()
        a, b = _job(store), _job(store)
        store.add(a, lambda j: never.wait())
        store.add(b, lambda j: never.wait())
        with pytest.raises(OmniHTTPError) as full:  # both still running
            store.add(_job(store), lambda j: never.wait())
        assert full.value.status == 429
        await store.delete(a.id)  # cancels its task
        store.complete(b, {"video": b"mp4", "thumbnail": b"png"})
        c = store.add(_job(store), lambda j: never.wait())
        d = store.add(_job(store), lambda j: never.wait())  # evicts b, the finished one
        with pytest.raises(OmniHTTPError):
            store.get(b.id)
        assert not (tmp_path / f"{b.id}.mp4").exists()
        store.fail(c, "invalid_request", "bad")
        store.complete(d, {"video": b"mp4-d", "thumbnail": b"png-d"})
        store.shutdown()
        return c, d

    c, d = asyncio.run(scenario())
    again = VideoJobs(max_jobs=2, ttl=3600, folder=tmp_path)  # a restarted server
    assert again.get(c.id).status == "failed" and again.get(c.id).error["message"] == "bad"
    assert again.content(again.get(d.id), "video") == b"mp4-d"
    aged = VideoJobs(max_jobs=2, ttl=0, folder=tmp_path)
    time.sleep(1.1)
    with pytest.raises(OmniHTTPError) as gone:
        aged.get(d.id)
    assert gone.value.status == 404 and not (tmp_path / f"{d.id}.mp4").exists()


# -- the playground's Videos tab, in a real browser ----------------------------------------


@pytest.mark.slow
def test_the_playground_makes_a_video(browser, server):
    context = browser.new_context(viewport={"width": 1100, "height": 900})
    page = context.new_page()
    try:
        page.goto(server.url + "/")
        page.get_by_label("This server needs an API key").fill(KEY)
        page.get_by_role("button", name="Connect").click()
        page.get_by_role("tab", name="Videos").wait_for()
        assert page.get_by_role("tab").all_inner_texts() == ["Videos", "Pipeline"]
        page.get_by_role("tab", name="Videos").click()
        page.get_by_label("Video width").fill("48")
        page.get_by_label("Video height").fill("32")
        page.get_by_label("Frames").fill("9")
        page.get_by_label("Video steps").fill("4")
        page.get_by_label("Video seed").fill("3")
        page.get_by_role("button", name="Make video").click()
        page.locator("#videos video").wait_for(timeout=120_000)
        caption = page.locator("#videos figcaption").inner_text()
        assert "48x32" in caption and "9 frames at 16 fps" in caption and "seed 3" in caption
        # The browser can play what the server encoded: it reads the MP4's length.
        duration = page.locator("#videos video").evaluate(
            "v => new Promise(done => v.readyState >= 1 ? done(v.duration)"
            " : v.addEventListener('loadedmetadata', () => done(v.duration)))")
        assert abs(duration - 9 / 16) < 0.1
        assert page.locator("#error").is_hidden()
        screenshot(page, "videos-tab")
    finally:
        context.close()
