"""AsyncDiffusionEngine: the async client of a diffusion engine core in its own process.

Its surface mirrors vLLM's AsyncLLM: `generate()` is an async iterator of outputs (progress,
then the result), `abort()`, `check_health()`, `errored`, `shutdown()`. A reader thread
takes the core's outputs off the pipe and hands each to the event loop of its request.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from vllm.v1.engine.exceptions import EngineDeadError

from vllm_omni.engine.diffusion.core import DiffusionOutput, EngineOptions, run_engine_core
from vllm_omni.engine.diffusion.params import DiffusionParams
from vllm_omni.orchestrator.connectors import SharedMemoryConnector


class DiffusionStartError(RuntimeError):
    pass


class AsyncDiffusionEngine:
    """Also the client of other non-AR engine cores that speak the same protocol over the
    pipe (`target(model, options, conn)`; messages add / extend / abort / shutdown; outputs with
    request_id, finished, error, error_kind, latents), such as code2wav's."""

    def __init__(
        self,
        model: str,
        options: Any = None,
        target: Callable[[str, Any, Any], None] = run_engine_core,
        process_name: str = "DiffusionEngineCore",
    ) -> None:
        self.model = model
        self.options = options or EngineOptions()
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(
            target=target,
            args=(model, self.options, child_conn),
            name=process_name,
            daemon=True,
        )
        self._proc.start()
        child_conn.close()
        self._send_lock = threading.Lock()
        self._requests: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._dead: str | None = None
        self.info = self._wait_ready()
        self._reader = threading.Thread(target=self._read, name="diffusion-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> dict[str, Any]:
        # Poll so a core that dies while loading is noticed at once, not after a timeout.
        while not self._conn.poll(0.1):
            if not self._proc.is_alive():
                raise DiffusionStartError(
                    f"diffusion engine for {self.model!r} exited with code "
                    f"{self._proc.exitcode} while starting (its log is above)"
                )
        try:
            kind, payload = self._conn.recv()
        except EOFError as e:
            raise DiffusionStartError(f"diffusion engine for {self.model!r} died starting") from e
        if kind != "ready":
            self._proc.join(5)
            raise DiffusionStartError(f"diffusion engine for {self.model!r} failed:\n{payload}")
        return payload

    def _read(self) -> None:
        try:
            while True:
                out: DiffusionOutput = self._conn.recv()
                entry = self._requests.get(out.request_id)
                if entry is not None:
                    loop, queue = entry
                    loop.call_soon_threadsafe(queue.put_nowait, out)
                elif out.latents is not None:  # its request is gone: free the segment
                    SharedMemoryConnector().discard(out.latents)
        except (EOFError, OSError):
            self._dead = f"diffusion engine core (pid {self._proc.pid}) is gone"
            for loop, queue in list(self._requests.values()):
                loop.call_soon_threadsafe(queue.put_nowait, None)

    def _send(self, msg: tuple) -> None:
        if self._dead:
            raise EngineDeadError(self._dead)
        with self._send_lock:
            self._conn.send(msg)

    async def generate(
        self,
        request_id: str,
        prompt: str,
        params: DiffusionParams | dict[str, Any] | None = None,
        images: list[Any] | None = None,
    ) -> AsyncIterator[DiffusionOutput]:
        """Progress outputs (step / num_steps), then the finished one with images, or with
        latents as a shared-memory handle (`SharedMemoryConnector().get(out.latents)`).

        Raises ValueError for parameters the model refuses, RuntimeError when the engine
        fails the request, EngineDeadError when the core process is gone.
        """
        if isinstance(params, DiffusionParams):
            params = params.model_dump(exclude_unset=True)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        queue: asyncio.Queue = asyncio.Queue()
        self._requests[request_id] = (asyncio.get_running_loop(), queue)
        finished = False
        try:
            self._send(("add", request_id, prompt, params or {}, list(images or [])))
            while True:
                out = await queue.get()
                if out is None:
                    raise EngineDeadError(self._dead)
                if out.error is not None:
                    finished = True
                    cls = ValueError if out.error_kind == "invalid" else RuntimeError
                    raise cls(out.error)
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._requests.pop(request_id, None)
            if not finished and not self._dead:
                self._send(("abort", request_id))

    async def extend(self, request_id: str, *payload: Any) -> None:
        """More input for a running request (a core that takes streamed input)."""
        if request_id in self._requests:
            self._send(("extend", request_id, *payload))

    async def abort(self, request_id: str) -> None:
        if not self._dead:
            self._send(("abort", request_id))

    @property
    def errored(self) -> bool:
        return self._dead is not None or not self._proc.is_alive()

    async def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError(self._dead or "diffusion engine core exited")

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._proc.is_alive():
            try:
                self._send(("shutdown",))
            except (EngineDeadError, OSError):
                pass
            deadline = time.monotonic() + timeout
            self._proc.join(max(0.0, deadline - time.monotonic()))
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()
