"""EngineClient: the API-process side of an engine core running in its own process.

Its surface is vLLM's AsyncLLM's: `generate()` is an async iterator of a request's outputs,
plus `abort()`, `check_health()`, `errored` and `shutdown()`. A reader thread takes the core's
outputs off the pipe and hands each to the event loop of the request it belongs to.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from vllm.v1.engine.exceptions import EngineDeadError

from vllm_omni.engine.runtime.core import CoreBase, serve
from vllm_omni.engine.runtime.messages import (
    AbortRequest,
    AddRequest,
    Control,
    CoreOutput,
    ExtendRequest,
    Ping,
    Ready,
    Shutdown,
)
from vllm_omni.transfer.connectors import SharedMemoryConnector


class EngineStartError(RuntimeError):
    """The engine core could not be built (its traceback is in the message)."""


class EngineClient:
    """Starts `core_class(model, options, conn)` in a spawned process and talks to it."""

    def __init__(self, core_class: type[CoreBase], model: str, options: Any) -> None:
        self.model = model
        self.options = options
        self.name = core_class.__name__
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=serve, args=(core_class, model, options, child_conn),
                                 name=self.name, daemon=True)
        self._proc.start()
        child_conn.close()
        self._send_lock = threading.Lock()
        self._requests: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._dead: str | None = None
        self._pings = itertools.count()
        self.info: dict[str, Any] = self._wait_ready()
        self._reader = threading.Thread(target=self._read, name=f"{self.name}-reader",
                                        daemon=True)
        self._reader.start()

    def _wait_ready(self) -> dict[str, Any]:
        # Poll so a core that dies while loading is noticed at once, not after a timeout.
        while not self._conn.poll(0.1):
            if not self._proc.is_alive():
                raise EngineStartError(f"{self.name} for {self.model!r} exited with code "
                                       f"{self._proc.exitcode} while starting (its log is above)")
        try:
            reply = self._conn.recv()
        except EOFError as e:
            raise EngineStartError(f"{self.name} for {self.model!r} died starting") from e
        if not isinstance(reply, Ready):
            self._proc.join(5)
            raise EngineStartError(f"{self.name} for {self.model!r} failed:\n{reply.traceback}")
        return reply.info

    def _read(self) -> None:
        try:
            while True:
                out: CoreOutput = self._conn.recv()
                entry = self._requests.get(out.request_id)
                if entry is not None:
                    loop, queue = entry
                    loop.call_soon_threadsafe(queue.put_nowait, out)
                elif out.handle is not None:  # its request is gone: free the segment
                    SharedMemoryConnector().discard(out.handle)
        except (EOFError, OSError):
            self._dead = f"{self.name} (pid {self._proc.pid}) is gone"
            for loop, queue in list(self._requests.values()):
                loop.call_soon_threadsafe(queue.put_nowait, None)

    def _send(self, msg: Any) -> None:
        if self._dead:
            raise EngineDeadError(self._dead)
        with self._send_lock:
            self._conn.send(msg)

    async def generate(
        self,
        request_id: str,
        prompt: Any,
        params: dict[str, Any] | None = None,
        images: list[Any] | None = None,
    ) -> AsyncIterator[CoreOutput]:
        """The request's outputs until its finished one.

        Raises ValueError for parameters the model refuses, RuntimeError when the engine
        fails the request, EngineDeadError when the core process is gone. Leaving the
        iteration early aborts the request in the core.
        """
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        queue: asyncio.Queue = asyncio.Queue()
        self._requests[request_id] = (asyncio.get_running_loop(), queue)
        finished = False
        try:
            self._send(AddRequest(request_id, prompt, params or {}, list(images or [])))
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
                self._send(AbortRequest(request_id))

    async def extend(self, request_id: str, payload: dict[str, Any]) -> None:
        """More input for a running request (a no-op once it is over)."""
        if request_id in self._requests:
            self._send(ExtendRequest(request_id, payload))

    async def abort(self, request_id: str) -> None:
        if not self._dead:
            self._send(AbortRequest(request_id))

    async def control(self, method: str, **args: Any) -> dict[str, Any]:
        """Call `method` on the core (between its steps); ValueError for a refused call."""
        call_id = f"control-{next(self._pings)}"
        queue: asyncio.Queue = asyncio.Queue()
        self._requests[call_id] = (asyncio.get_running_loop(), queue)
        try:
            self._send(Control(call_id, method, args))
            out = await queue.get()
        finally:
            self._requests.pop(call_id, None)
        if out is None:
            raise EngineDeadError(self._dead)
        if out.error is not None:
            raise (ValueError if out.error_kind == "invalid" else RuntimeError)(out.error)
        return out.result

    async def ping(self) -> None:
        """Returns once the core's loop has answered (after the step it is in)."""
        ping_id = f"ping-{next(self._pings)}"
        queue: asyncio.Queue = asyncio.Queue()
        self._requests[ping_id] = (asyncio.get_running_loop(), queue)
        try:
            self._send(Ping(ping_id))
            if await queue.get() is None:
                raise EngineDeadError(self._dead)
        finally:
            self._requests.pop(ping_id, None)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def errored(self) -> bool:
        return self._dead is not None or not self._proc.is_alive()

    async def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError(self._dead or f"{self.name} exited")

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._proc.is_alive():
            try:
                self._send(Shutdown())
            except (EngineDeadError, OSError):
                pass
            deadline = time.monotonic() + timeout
            self._proc.join(max(0.0, deadline - time.monotonic()))
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()
