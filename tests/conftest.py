"""Shared fixtures. Engines are expensive to start (20-40 s on CPU), so each kind is started
once per session and shared."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Spawn, as `vllm serve` uses, for engine processes. No memory setting: vllm-omni plans each
# stage's budget itself (vLLM's own reference engines below are given one explicitly).
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MAX_MODEL_LEN = 2048
SERVER_MAX_MODEL_LEN = 1024
# vLLM's own engine on CPU reserves 92% of the machine unless told a KV cache size.
REFERENCE_KV_BYTES = 1 << 30


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    from vllm_omni.testing.tiny_models import make_tiny

    return str(make_tiny("qwen2-tiny", tmp_path_factory.mktemp("models") / "qwen2-tiny"))


@pytest.fixture(scope="session")
def tiny_omni(tmp_path_factory) -> str:
    """The tiny Qwen2.5-Omni folder (thinker, talker, token2wav, voices)."""
    from vllm_omni.compat.torchvision_free import install
    from vllm_omni.testing.tiny_models import make_tiny

    install()  # in this process too: HF references use the same processors as vLLM
    return str(make_tiny("qwen2_5-omni-tiny", tmp_path_factory.mktemp("models") / "omni"))


def hf_talker_with_attention_mask(model) -> None:
    """Make HF's Qwen2.5-Omni talker run the way its code is written.

    transformers 5.19's `generate` hands the talker no attention_mask, and the talker computes
    its multimodal RoPE positions (and adds the codec pad / bos embeddings to its prompt) only
    when it gets one; without, it runs plain positions and leaves those out. An all-ones mask
    is what the talker expects for one unpadded request."""
    import torch

    def add_mask(_module, args, kwargs):
        if kwargs.get("attention_mask") is None:
            cache = kwargs.get("past_key_values")
            past = cache.get_seq_length() if cache is not None else 0
            new = kwargs.get("inputs_embeds")
            new = kwargs["input_ids"] if new is None else new
            kwargs["attention_mask"] = torch.ones(1, past + new.shape[1], dtype=torch.long)
        return args, kwargs

    model.talker.register_forward_pre_hook(add_mask, with_kwargs=True)


@pytest.fixture(scope="session")
def vllm_llm(tiny_qwen2):
    """vLLM's own offline LLM on the tiny model: the reference."""
    from vllm import LLM

    llm = LLM(tiny_qwen2, max_model_len=MAX_MODEL_LEN, disable_log_stats=True,
              kv_cache_memory_bytes=REFERENCE_KV_BYTES)
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="session")
def omni_llm(tiny_qwen2):
    from vllm_omni import OmniLLM

    llm = OmniLLM(tiny_qwen2, max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.shutdown()


@contextlib.contextmanager
def pipeline_llm(model: str, pipeline_yaml: str, folder: Path, **kwargs):
    """An OmniLLM over a pipeline written to `folder` as YAML; shut down on exit."""
    from vllm_omni import OmniLLM

    path = folder / "pipeline.yaml"
    path.write_text(pipeline_yaml)
    llm = OmniLLM(model, stage_configs_path=str(path), **kwargs)
    try:
        yield llm
    finally:
        llm.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A real `vllm serve MODEL --omni` process on a free port."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        timeout: float = 240,
        env: dict[str, str] | None = None,
    ) -> None:
        self.log_path = log_path
        for attempt in range(3):
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            vllm_cli = str(Path(sys.executable).parent / "vllm")
            self.proc = subprocess.Popen(
                [vllm_cli, "serve", *args, "--omni", "--host", "127.0.0.1", "--port",
                 str(self.port)],
                stdout=open(log_path, "w"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
            try:
                self._wait_ready(timeout)
                return
            except RuntimeError:
                # The free port was taken while the stages started (Ray's workers bind
                # ports of their own): another one.
                if attempt == 2 or "address already in use" not in log_path.read_text():
                    raise

    def _wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_path.read_text()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"server not ready:\n{self.log_path.read_text()[-4000:]}")

    def stop(self) -> bool:
        """SIGTERM, as a process manager would; True if the server and every process it
        started (engine core, workers) were gone within a minute."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if not live_processes_in_group(self.proc.pid):
                return True
            time.sleep(0.5)
        os.killpg(self.proc.pid, 9)
        return False


def live_processes_in_group(pgid: int) -> list[int]:
    """Processes (not zombies) in a process group: what a server left running."""
    import psutil

    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return found


def wait_for(condition, what: str, timeout: float = 30, interval: float = 0.1) -> None:
    """Poll `condition` until it is true; fail naming `what` after `timeout` seconds.
    A fixed sleep is too short on a loaded machine and too long on an idle one."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout:.0f} s"
        time.sleep(interval)


def settles(read, quiet: float, timeout: float = 30, interval: float = 0.1):
    """`read()` once it has not changed for `quiet` seconds (fails after `timeout`): work
    that should stop, seen stopping."""
    deadline = time.monotonic() + timeout
    value, since = read(), time.monotonic()
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, f"still changing after {timeout:.0f} s: {value}"
        time.sleep(interval)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
    return value


API_KEY = "test-key"
SERVED_NAME = "tiny-chat"


@pytest.fixture(scope="session")
def server(tiny_qwen2, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = ServerProcess(
        [
            tiny_qwen2,
            "--served-model-name",
            SERVED_NAME,
            "--max-model-len",
            str(SERVER_MAX_MODEL_LEN),
            "--api-key",
            API_KEY,
        ],
        log,
    )
    yield srv
    assert srv.stop(), "processes of the server were still alive after SIGTERM"


DEMO_KEY = "demo-key"
DEMO_AUTH = {"Authorization": f"Bearer {DEMO_KEY}"}


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory):
    """The README's first command (`vllm serve --omni`, the built-in demo) with an API key and
    a short context (so a fuzzed max_tokens cannot make one request take minutes). One server
    for the modules that fuzz it, load it and drive its playground: each start is a minute."""
    srv = ServerProcess(["--api-key", DEMO_KEY, "--max-model-len", "256",
                         "--max-pending-requests", "16"],
                        tmp_path_factory.mktemp("demo") / "server.log")
    yield srv
    assert srv.stop(), "processes of the server were still alive after SIGTERM"


CHROMIUM = "/usr/bin/chromium"  # Debian's package; scripts/test.sh installs it


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium driven by Playwright, with the flags a closed network needs (no
    background connections to Google's hosts)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--autoplay-policy=no-user-gesture-required"],
        )
        yield chromium
        chromium.close()


def screenshot(page, name: str) -> Path:
    """Save a screenshot of the page under the test run's screenshots folder."""
    folder = Path(os.environ.get("PYTEST_SCREENSHOTS", "/tmp/vllm-omni-screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


@pytest.fixture(scope="session")
def tiny_qwen3_omni(tmp_path_factory) -> str:
    """The tiny Qwen3-Omni folder (MoE thinker, MoE talker + code predictor, code2wav)."""
    from vllm_omni.compat.torchvision_free import install
    from vllm_omni.testing.tiny_models import make_tiny

    install()
    return str(make_tiny("qwen3-omni-tiny", tmp_path_factory.mktemp("models") / "qwen3-omni"))
