"""`/v1/videos`: OpenAI's Videos API over the pipeline's video output. A request becomes a
job that runs in the background; clients poll its status and progress, then download the
MP4. Deleting a running job aborts it in the engine."""

from __future__ import annotations

import asyncio
import base64
import logging
from http import HTTPStatus
from typing import Any

from vllm_omni.engine.diffusion.params import DiffusionParams
from vllm_omni.engine.stage import StageInfo
from vllm_omni.entrypoints.openai.images import decode_image
from vllm_omni.entrypoints.openai.protocol import OmniHTTPError, VideoCreateRequest, parse_size
from vllm_omni.entrypoints.openai.serving_base import OmniServing, error_status
from vllm_omni.entrypoints.openai.video import encode_mp4, encode_png
from vllm_omni.entrypoints.openai.video_jobs import VideoJob, VideoJobs
from vllm_omni.outputs import OmniRequestOutput

logger = logging.getLogger(__name__)

VARIANTS = {"video": "video/mp4", "thumbnail": "image/png"}


class OmniServingVideos(OmniServing):
    """Checks a video request against what the model takes (size, frame count, length), runs
    it as a job and answers OpenAI's video objects."""

    def __init__(self, omni, served_model_names: list[str], jobs: VideoJobs,
                 max_seconds: float = 20.0) -> None:
        super().__init__(omni, served_model_names)
        self.jobs = jobs
        self.max_seconds = max_seconds

    def stage(self):
        stage = self.omni.video_stage
        if stage is None:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST,
                                f"model {self.model_name!r} (pipeline "
                                f"{self.omni.pipeline.name!r}) does not make videos", "model")
        return stage

    # -- create --------------------------------------------------------------------------

    async def create(self, request: VideoCreateRequest, request_id: str) -> dict[str, Any]:
        self.check_model(request.model, adapters=True)
        stage = self.stage()
        info = stage.info
        prompt: Any = request.prompt
        if request.input_reference is not None:
            if not info.takes_images:
                raise OmniHTTPError(HTTPStatus.BAD_REQUEST, "input_reference: this model makes "
                                    "videos from text only", "input_reference")
            image = decode_image(reference_bytes(request.input_reference), "input_reference")
            prompt = {"prompt": request.prompt, "multi_modal_data": {"image": [image]}}
        params = {**self.diffusion_params(request, info),
                  **self.adapter_params(request.model, request.lora_scale)}
        job = VideoJob(id=self.jobs.new_id(), model=request.model or self.model_name,
                       prompt=request.prompt, size=f"{params['width']}x{params['height']}",
                       num_frames=params["num_frames"], fps=params["fps"],
                       seed=params.get("seed"))
        overrides = self.stage_overrides(None, {stage.name: params})
        self.jobs.add(job, lambda j: self._run(j, prompt, self.in_stage_order(overrides)))
        return job.as_object(self.jobs.ttl)

    def diffusion_params(self, request: VideoCreateRequest, info: StageInfo) -> dict[str, Any]:
        """The stage's parameters, every size and length filled in and checked here, so a
        job that starts is one the model can make."""
        defaults = info.defaults
        width, height = defaults.get("width"), defaults.get("height")
        if request.size is not None:
            width, height = parse_size(request.size)
        multiple = info.limits.get("size_multiple")
        if multiple and (width % multiple or height % multiple):
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, f"size: width and height must be "
                                f"multiples of {multiple} for this model, got {width}x{height}",
                                "size")
        if width is None or height is None:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, "size is needed: this model has no "
                                "default size", "size")
        limit = info.limits.get("max_image_pixels")
        if limit and width * height > limit:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, f"size: {width}x{height} is over this "
                                f"model's limit of {limit} pixels per frame", "size")
        fps = request.fps or defaults.get("fps") or 16
        step = info.limits.get("frame_step")
        frames = request.num_frames
        if frames is None and request.seconds is not None:
            # The frame count the model takes nearest to the asked length.
            frames = max(round(request.seconds * fps), 1)
            if step:
                frames = step * round((frames - 1) / step) + 1
        frames = frames or defaults.get("num_frames")
        if frames is None:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, "num_frames (or seconds) is needed: "
                                "this model has no default length", "num_frames")
        if step and step > 1 and frames % step != 1:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, f"num_frames must be {step}k+1 for this "
                                f"model (1, {step + 1}, {2 * step + 1}, ...), got {frames}",
                                "num_frames")
        if frames / fps > self.max_seconds:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, f"seconds: {frames} frames at {fps} fps "
                                f"is {frames / fps:g} s, over this server's limit of "
                                f"{self.max_seconds:g} s (--max-video-seconds)", "seconds")
        params = request.model_dump(
            include={"num_inference_steps", "guidance_scale", "negative_prompt", "seed",
                     "cache", "priority"},
            exclude_none=True)
        params.update(width=width, height=height, num_frames=frames, fps=fps)
        try:
            DiffusionParams.parse(params)
        except ValueError as e:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, str(e)) from None
        return params

    async def _run(self, job: VideoJob, prompt: Any, params: list[Any]) -> None:
        """The job's work: denoise (progress per step), then encode the MP4."""
        try:
            final: OmniRequestOutput | None = None
            job.status = "in_progress"
            async for out in self.omni.generate(prompt, params, job.id, ["video"]):
                job.steps_done = out.metrics.get("step", job.steps_done)
                job.num_steps = out.metrics.get("num_steps", job.num_steps)
                job.seed = out.metrics.get("seed") or job.seed
                if out.finished and out.video is not None:
                    final = out
            if final is None:
                raise RuntimeError("the video stage finished without a video")
            video = final.video
            job.cache = final.metrics.get("cache")
            contents = await asyncio.to_thread(
                lambda: {"video": encode_mp4(video.frames, video.fps),
                         "thumbnail": encode_png(video.frames[0])})
            self.jobs.complete(job, contents)
        except asyncio.CancelledError:
            raise  # deleted: generate() closing aborts it in the engine
        except Exception as e:
            status, message, _ = error_status(e)
            if status >= 500:
                logger.exception("video job %s failed", job.id)
            self.jobs.fail(job, "invalid_request" if status < 500 else "internal_error",
                           message)

    # -- the other routes ----------------------------------------------------------------

    def retrieve(self, video_id: str) -> dict[str, Any]:
        return self.jobs.get(video_id).as_object(self.jobs.ttl)

    def content(self, video_id: str, variant: str | None) -> tuple[bytes, str]:
        variant = variant or "video"
        if variant not in VARIANTS:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, f"variant: {variant!r} is not "
                                f"supported; choose one of {sorted(VARIANTS)}", "variant")
        return self.jobs.content(self.jobs.get(video_id), variant), VARIANTS[variant]

    async def delete(self, video_id: str) -> dict[str, Any]:
        job = await self.jobs.delete(video_id)
        return {"id": job.id, "object": "video.deleted", "deleted": True}

    def list(self, after: str | None, limit: str | None, order: str | None) -> dict[str, Any]:
        try:
            count = 20 if limit is None else int(limit)
        except ValueError:
            count = 0
        if not 1 <= count <= 100:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST,
                                f"limit: must be an integer from 1 to 100, got {limit!r}", "limit")
        order = order or "desc"
        if order not in ("asc", "desc"):
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST,
                                f"order: must be 'asc' or 'desc', got {order!r}", "order")
        jobs, more = self.jobs.list(after, count, order)
        data = [j.as_object(self.jobs.ttl) for j in jobs]
        return {"object": "list", "data": data, "has_more": more,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None}


def reference_bytes(value: Any) -> bytes:
    """An uploaded file's bytes, or the image in {"image_url": "data:image/...;base64,..."}."""
    if isinstance(value, bytes):
        return value
    url = value.get("image_url") if isinstance(value, dict) else value
    head, _, data = url.partition(";base64,") if isinstance(url, str) else ("", "", "")
    if not head.startswith("data:image/"):
        raise OmniHTTPError(HTTPStatus.BAD_REQUEST, "input_reference: an image file, or "
                            "{'image_url': a base64 data URL}", "input_reference")
    try:
        return base64.b64decode(data, validate=True)
    except ValueError:
        raise OmniHTTPError(HTTPStatus.BAD_REQUEST, "input_reference: invalid base64",
                            "input_reference") from None
