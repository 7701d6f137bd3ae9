"""Stage supervision: a stage whose engine died, or stopped answering, is restarted.

Every `interval` seconds each stage is checked: `errored` (its process is gone) or, with a
hang timeout, a `ping` its engine's loop does not answer in time (alive but stuck; the
stage is then shut down, which kills its processes). Either way the stage's in-flight
requests fail naming it (its engine client raises for them), health reports it while it
restarts, and it is started again from its config, up to `restarts` times per stage; past
that it stays down and health keeps saying so.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING

from vllm.v1.engine.exceptions import EngineDeadError

from vllm_omni.engine.stage import Stage, StartContext, start_stage
from vllm_omni.transfer.connectors import sweep_orphaned_pools

if TYPE_CHECKING:
    from vllm_omni.config.schema import StageConfig
    from vllm_omni.orchestrator.orchestrator import Orchestrator

logger = logging.getLogger(__name__)


class StageSupervisor:
    """Watches the orchestrator's stages from a task on the server's loop and restarts a
    dead or hung one in place (see the module's docstring)."""

    def __init__(self, orchestrator: Orchestrator, context: StartContext, restarts: int,
                 hang_timeout: float | None, interval: float = 1.0) -> None:
        self.orchestrator = orchestrator
        self.context = context
        self.restarts_left = {name: restarts for name in orchestrator.stages}
        self.hang_timeout = hang_timeout or None
        self.interval = interval
        self.restarting: set[str] = set()
        self.down: dict[str, str] = {}  # stage -> why, once it has no restarts left
        self.restarts: dict[str, int] = {name: 0 for name in orchestrator.stages}
        self._task: asyncio.Task | None = None
        # Set once the server shuts down: a stage that finishes starting after it is shut
        # down at once by its starting thread (that thread outlives the cancelled task).
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self._starts_done = threading.Event()  # no stage is starting
        self._starts_done.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="supervisor")

    def stop(self, start_timeout: float = 300) -> None:
        """Stop watching; a stage starting now is waited for and shut down (the server's
        process may end by a signal right after, which no thread would outlive)."""
        with self._stop_lock:
            self._stopped.set()
        if self._task is not None:
            self._task.cancel()
        if not self._starts_done.is_set():
            logger.info("Waiting for the stage being restarted to start, to shut it down")
            self._starts_done.wait(start_timeout)

    def _start(self, config: StageConfig) -> Stage | None:
        """A new engine for the stage (in a thread); None, and nothing left running, when
        the server stopped meanwhile."""
        with self._stop_lock:
            if self._stopped.is_set():
                return None
            self._starts_done.clear()
        try:
            stage = start_stage(config, self.context)
            with self._stop_lock:
                if not self._stopped.is_set():
                    return stage
            stage.shutdown()
            return None
        finally:
            self._starts_done.set()

    def problem(self) -> str | None:
        """Why the pipeline is not healthy now (None when it is)."""
        if self.down:
            return "; ".join(f"stage {n!r} is down: {why}" for n, why in self.down.items())
        if self.restarting:
            return f"restarting stages {sorted(self.restarting)}"
        return None

    def unavailable(self, names: set[str]) -> str | None:
        """Why a request needing these stages cannot run now (None when it can): a stage
        being restarted has no engine to take it, so it is refused, not half-started."""
        for name in sorted(names):
            if name in self.down:
                return f"stage {name!r} is down: {self.down[name]}"
            if name in self.restarting:
                return f"stage {name!r} is restarting"
        return None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            for name, stage in list(self.orchestrator.stages.items()):
                if name in self.restarting or name in self.down:
                    continue
                why = None
                if stage.errored:
                    why = "its engine died"
                elif self.hang_timeout is not None:
                    try:
                        await asyncio.wait_for(stage.ping(), self.hang_timeout)
                    except TimeoutError:
                        why = f"its engine did not answer for {self.hang_timeout:g} s"
                    except Exception as e:  # died while probed: the next round sees it
                        logger.debug("ping of stage %r failed: %s", name, e)
                if why is not None:
                    await self._restart(name, why)

    async def _restart(self, name: str, why: str) -> None:
        # A hung engine would never answer for them: its requests fail now, named.
        self.orchestrator.fail_stage(name, EngineDeadError(why))
        if self.restarts_left[name] <= 0:
            logger.error("Stage %r: %s; no restarts left (--stage-restarts)", name, why)
            self.down[name] = why
            await asyncio.to_thread(self.orchestrator.stages[name].shutdown)
            return
        self.restarts_left[name] -= 1
        self.restarting.add(name)
        logger.error("Stage %r: %s; restarting it (%d restarts left)", name, why,
                     self.restarts_left[name])
        try:
            # Shut down first: its memory is what the new engine's plan counts on.
            await asyncio.to_thread(self.orchestrator.stages[name].shutdown)
            sweep_orphaned_pools()  # what its killed processes' connectors held
            config = self.orchestrator.pipeline.stage(name)
            stage = await asyncio.to_thread(self._start, config)
            if stage is None:
                return
        except Exception as e:
            logger.exception("Stage %r could not be restarted", name)
            self.down[name] = f"{why}, and restarting failed: {e}"
        else:
            self.orchestrator.stages[name] = stage
            self.restarts[name] += 1
            logger.info("Stage %r restarted", name)
        finally:
            self.restarting.discard(name)
