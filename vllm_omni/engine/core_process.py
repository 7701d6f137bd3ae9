"""The process side shared by vllm-omni's own engine cores (diffusion, code2wav).

A core is built in its own process and then driven by one loop: take the client's messages
(add / abort / shutdown) from the pipe, blocking only while the core has nothing to do, and
run one step of work between them. The core supplies `info()`, `handle(msg)`, `step()`,
`has_work` and `running`.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any


def serve_core(make_core: Callable[[], Any], conn: Connection, name: str) -> None:
    """Process entry point: build the core, report ready (or why not), serve until shutdown
    or until the client goes away."""
    logging.basicConfig(level=logging.INFO, format=f"({name} pid={os.getpid()}) %(message)s")
    try:
        core = make_core()
    except BaseException:
        conn.send(("start_failed", traceback.format_exc()))
        return
    conn.send(("ready", core.info()))
    try:
        _loop(core, conn)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the client went away: nothing left to serve


def _loop(core: Any, conn: Connection) -> None:
    import torch

    with torch.inference_mode():  # every step below runs without autograd
        while core.running:
            if not core.has_work:
                conn.poll(None)
            while core.running and conn.poll(0):
                core.handle(conn.recv())
            if core.running:
                core.step()
