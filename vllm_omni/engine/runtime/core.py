"""The engine-core side of the runtime: the loop in the core's process and the base class
every core extends.

The loop takes the client's messages from the pipe, blocking only while the core has
nothing to do, and runs one `step()` of work between them, so an abort lands at once or
right after the step in progress. A core supplies what is its own: `add` (admit one
request), `step`, `has_work`, `drop` (forget a request) and `info`; `extend` where it takes
streamed input.
"""

from __future__ import annotations

import logging
import os
import secrets
import traceback
from multiprocessing.connection import Connection
from typing import Any

from vllm_omni.engine.runtime.messages import (
    AbortRequest,
    AddRequest,
    Control,
    ControlOutput,
    CoreOutput,
    ErrorKind,
    ExtendRequest,
    Ping,
    Ready,
    Shutdown,
    StartFailed,
)

logger = logging.getLogger(__name__)


class CoreBase:
    """Message handling, failure reporting, seeding and thread set-up shared by cores."""

    def __init__(self, conn: Connection, num_threads: int | None = None) -> None:
        if num_threads:
            import torch

            torch.set_num_threads(num_threads)
        self.conn = conn
        self.running = True

    # -- what a core supplies ----------------------------------------------------------

    def info(self) -> dict[str, Any]:
        raise NotImplementedError

    def add(self, msg: AddRequest) -> None:
        raise NotImplementedError

    def extend(self, msg: ExtendRequest) -> None:
        raise ValueError(f"{type(self).__name__} takes no streamed input")

    def control(self, method: str, args: dict[str, Any]) -> dict[str, Any]:
        """A call on the core (ValueError: the caller's mistake)."""
        raise ValueError(f"{type(self).__name__} has no call {method!r}")

    def drop(self, request_id: str) -> None:
        """Forget a request (aborted, or failed)."""
        raise NotImplementedError

    @property
    def has_work(self) -> bool:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    # -- shared ------------------------------------------------------------------------

    def handle(self, msg: Any) -> None:
        if isinstance(msg, AddRequest):
            self.add(msg)
        elif isinstance(msg, ExtendRequest):
            self.extend(msg)
        elif isinstance(msg, AbortRequest):
            self.drop(msg.request_id)
        elif isinstance(msg, Control):
            self._control(msg)
        elif isinstance(msg, Ping):
            self.send(CoreOutput(msg.request_id, finished=True))
        elif isinstance(msg, Shutdown):
            self.running = False
        else:
            logger.error("%s ignores a message it does not know: %r", type(self).__name__, msg)

    def _control(self, msg: Control) -> None:
        try:
            result = self.control(msg.method, msg.args)
        except ValueError as e:
            self.send(ControlOutput(msg.request_id, finished=True, error=str(e),
                                    error_kind="invalid"))
        except Exception as e:
            logger.error("%s failed:\n%s", msg.method, "".join(traceback.format_exception(e)))
            self.send(ControlOutput(msg.request_id, finished=True, error=repr(e),
                                    error_kind="internal"))
        else:
            self.send(ControlOutput(msg.request_id, finished=True, result=result))

    def send(self, out: CoreOutput) -> None:
        self.conn.send(out)

    def fail(self, request_ids: list[str], error: BaseException | str, kind: ErrorKind) -> None:
        """End requests with an error: `invalid` for the caller's mistakes, `internal` (with
        the traceback in this process's log) for the engine's."""
        if kind == "internal" and isinstance(error, BaseException):
            logger.error("requests %s failed:\n%s", request_ids,
                         "".join(traceback.format_exception(error)))
        message = repr(error) if kind == "internal" else str(error)
        for request_id in request_ids:
            self.drop(request_id)
            self.send(CoreOutput(request_id, finished=True, error=message, error_kind=kind))

    @staticmethod
    def new_seed() -> int:
        """A seed for a request that brings none; returned with its outputs, so the result
        can be made again."""
        return secrets.randbits(63)


def serve(core_class: type[CoreBase], model: str, options: Any, conn: Connection) -> None:
    """Process entry point: build the core, report ready (or why not), serve until shutdown
    or until the client goes away."""
    import setproctitle

    name = core_class.__name__
    # Named in `ps` and `top`, as vLLM names its own engine processes.
    setproctitle.setproctitle(f"vllm-omni::{name}")
    logging.basicConfig(level=logging.INFO, format=f"({name} pid={os.getpid()}) %(message)s")
    try:
        core = core_class(model, options, conn)
    except BaseException:
        conn.send(StartFailed(traceback.format_exc()))
        return
    conn.send(Ready(core.info()))
    try:
        _loop(core, conn)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the client went away: nothing left to serve


def _loop(core: CoreBase, conn: Connection) -> None:
    import torch

    with torch.inference_mode():  # every step below runs without autograd
        while core.running:
            if not core.has_work:
                conn.poll(None)
            while core.running and conn.poll(0):
                core.handle(conn.recv())
            if core.running:
                core.step()
