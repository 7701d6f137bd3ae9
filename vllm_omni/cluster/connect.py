"""Joining an existing Ray cluster, with a bounded wait.

`ray.init` to an address nobody answers on retries for minutes. Start-up must fail within
seconds instead, saying which address could not be reached: the address is probed first
(a TCP connect to the GCS port), and `ray.init` itself runs under a deadline.
"""

from __future__ import annotations

import socket
import threading
from typing import Any


class RayConnectError(RuntimeError):
    """The Ray cluster named by --ray-address cannot be joined."""


def _probe(address: str, timeout: float) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise RayConnectError(f"--ray-address {address!r}: expected 'auto' or HOST:PORT "
                              "(the head node's GCS address, port 6379 by default)")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise RayConnectError(f"--ray-address {address!r}: no Ray head node answers there "
                              f"({e}); start one with `ray start --head` or fix the "
                              "address") from None


def connect(address: str, timeout: float = 30.0) -> bool:
    """Join the cluster at `address` ('auto': the one on this machine). True when this call
    connected (the caller disconnects at shutdown); False when the process already was."""
    import ray

    if ray.is_initialized():
        return False
    if address != "auto":
        _probe(address, min(timeout, 5.0))
    outcome: dict[str, Any] = {}

    def init() -> None:
        try:
            # No log forwarding: each stage logs in its own actor's log on its node.
            outcome["info"] = ray.init(address=address, log_to_driver=False,
                                       namespace="vllm-omni")
        except BaseException as e:  # handed to the caller's thread
            outcome["error"] = e

    thread = threading.Thread(target=init, name="ray-connect", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise RayConnectError(f"--ray-address {address!r}: joining the Ray cluster took "
                              f"more than {timeout:g} s (is the address the head node's GCS "
                              "port, and reachable from this host?)")
    if "error" in outcome:
        raise RayConnectError(f"--ray-address {address!r}: {outcome['error']}") from None
    return True
