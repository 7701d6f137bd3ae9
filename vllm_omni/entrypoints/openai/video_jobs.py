"""The video jobs of /v1/videos: in memory, bounded in number and age, and written to a
folder when one is configured (`--video-dir`: finished jobs survive a restart)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

from vllm_omni.entrypoints.openai.protocol import OmniHTTPError

logger = logging.getLogger(__name__)

_ID = re.compile(r"^video_[0-9a-f]{32}$")
FINISHED = ("completed", "failed")


@dataclass
class VideoJob:
    """One video job; `as_object` is OpenAI's video object (plus extension fields)."""

    id: str
    model: str
    prompt: str
    size: str
    num_frames: int
    fps: int
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "queued"
    steps_done: int = 0
    num_steps: int = 0
    completed_at: int | None = None
    seed: int | None = None
    error: dict[str, Any] | None = None
    cache: dict[str, Any] | None = None  # step-cache statistics of a finished video

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    @property
    def progress(self) -> int:
        """Percent of the denoising steps done (100 only once the MP4 is ready)."""
        if self.status == "completed":
            return 100
        if not self.num_steps:
            return 0
        return min(99, 100 * self.steps_done // self.num_steps)

    def as_object(self, ttl: float) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "video",
            "model": self.model,
            "status": self.status,
            "progress": self.progress,
            "created_at": self.created_at,
            "completed_at": self.completed_at,
            "expires_at": self.completed_at and int(self.created_at + ttl),
            "prompt": self.prompt,
            "seconds": f"{self.num_frames / self.fps:g}",
            "size": self.size,
            "error": self.error,
            "remixed_from_video_id": None,
            # Extensions: what OpenAI's object leaves out.
            "num_frames": self.num_frames,
            "fps": self.fps,
            "seed": self.seed,
            "denoising_steps": {"done": self.steps_done, "total": self.num_steps},
            "cache": self.cache,
        }


class VideoJobs:
    """Jobs by id, oldest first. At most `max_jobs` are kept: a new job evicts the oldest
    finished one, and is refused (429) when all are still running; finished jobs older than
    `ttl` seconds go. Contents (MP4, first-frame PNG) live in memory, or in `folder`."""

    def __init__(self, max_jobs: int = 64, ttl: float = 3600.0,
                 folder: str | Path | None = None) -> None:
        self.max_jobs, self.ttl = max_jobs, ttl
        self.folder = Path(folder) if folder else None
        self._jobs: dict[str, VideoJob] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._contents: dict[str, dict[str, bytes]] = {}
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._load()

    @staticmethod
    def new_id() -> str:
        return f"video_{uuid.uuid4().hex}"

    # -- the jobs ------------------------------------------------------------------------

    def add(self, job: VideoJob, task_factory) -> VideoJob:
        """Keep `job` and start its work (`task_factory(job)`, a coroutine)."""
        self._expire()
        if len(self._jobs) >= self.max_jobs:
            oldest = next((j for j in self._jobs.values() if j.finished), None)
            if oldest is None:
                raise OmniHTTPError(
                    HTTPStatus.TOO_MANY_REQUESTS,
                    f"{len(self._jobs)} video jobs are still running, this server's limit "
                    "(--max-video-jobs); retry later")
            self._forget(oldest.id)
        self._jobs[job.id] = job
        task = asyncio.ensure_future(task_factory(job))
        self._tasks[job.id] = task
        task.add_done_callback(lambda _: self._tasks.pop(job.id, None))
        return job

    def get(self, video_id: str) -> VideoJob:
        self._expire()
        job = self._jobs.get(video_id)
        if job is None:
            raise OmniHTTPError(HTTPStatus.NOT_FOUND, f"no video with id {video_id!r}",
                                "video_id")
        return job

    async def delete(self, video_id: str) -> VideoJob:
        """Forget a job; a running one is cancelled first, which aborts it in the engine."""
        job = self.get(video_id)
        task = self._tasks.pop(video_id, None)
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._forget(video_id)
        return job

    def list(self, after: str | None, limit: int, order: str) -> tuple[list[VideoJob], bool]:
        self._expire()
        jobs = list(self._jobs.values())  # oldest first: the order they were added in
        if order == "desc":
            jobs.reverse()
        if after is not None:
            ids = [j.id for j in jobs]
            if after not in ids:
                raise OmniHTTPError(HTTPStatus.NOT_FOUND, f"no video with id {after!r}", "after")
            jobs = jobs[ids.index(after) + 1:]
        return jobs[:limit], len(jobs) > limit

    def shutdown(self) -> None:
        for task in self._tasks.values():
            task.cancel()

    # -- contents ------------------------------------------------------------------------

    def complete(self, job: VideoJob, contents: dict[str, bytes]) -> None:
        """A job's MP4 ("video") and first frame ("thumbnail") are ready."""
        job.status, job.completed_at = "completed", int(time.time())
        if self.folder is None:
            self._contents[job.id] = contents
        else:
            for variant, data in contents.items():
                self._path(job.id, variant).write_bytes(data)
        self._save(job)

    def fail(self, job: VideoJob, code: str, message: str) -> None:
        job.status, job.completed_at = "failed", int(time.time())
        job.error = {"code": code, "message": message}
        self._save(job)

    def content(self, job: VideoJob, variant: str) -> bytes:
        if job.status != "completed":
            raise OmniHTTPError(HTTPStatus.CONFLICT,
                                f"video {job.id} is {job.status}: no content yet", "video_id")
        if self.folder is None:
            return self._contents[job.id][variant]
        return self._path(job.id, variant).read_bytes()

    # -- bounds and the folder -----------------------------------------------------------

    def _expire(self) -> None:
        now = time.time()
        for job in [j for j in self._jobs.values() if j.finished]:
            if job.created_at + self.ttl < now:
                self._forget(job.id)

    def _forget(self, video_id: str) -> None:
        self._jobs.pop(video_id, None)
        self._contents.pop(video_id, None)
        if self.folder is not None:
            for variant in ("video", "thumbnail", "job"):
                self._path(video_id, variant).unlink(missing_ok=True)

    def _path(self, video_id: str, variant: str) -> Path:
        suffix = {"video": ".mp4", "thumbnail": ".png", "job": ".json"}[variant]
        return self.folder / f"{video_id}{suffix}"

    def _save(self, job: VideoJob) -> None:
        if self.folder is not None:
            self._path(job.id, "job").write_text(json.dumps(asdict(job)))

    def _load(self) -> None:
        """The finished jobs a previous server left in the folder, oldest first."""
        found = []
        for path in self.folder.glob("video_*.json"):
            if not _ID.match(path.stem):
                continue
            try:
                job = VideoJob(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError) as e:
                logger.warning("skipping unreadable video job %s: %s", path, e)
                continue
            if job.finished:
                found.append(job)
        found.sort(key=lambda j: j.created_at)
        for job in found[-self.max_jobs:]:
            self._jobs[job.id] = job
        for job in found[:-self.max_jobs]:  # beyond the bound: as if evicted
            self._forget(job.id)
        self._expire()
