"""OmniLLM: offline, synchronous batch generation; a thin facade over AsyncOmniLLM.

The AsyncOmniLLM lives on an event loop in a background thread; `generate()` submits every
prompt to it at once (so the engines batch them) and waits, with a progress bar.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm
from vllm import SamplingParams
from vllm.inputs import PromptType
from vllm.sampling_params import RequestOutputKind
from vllm.usage.usage_lib import UsageContext

from vllm_omni.entrypoints.async_omni_llm import AsyncOmniLLM, StageSampling
from vllm_omni.outputs import OmniRequestOutput


class OmniLLM:
    """Offline generation over a pipeline of stages, like vLLM's `LLM`.

    Takes the same arguments as AsyncOmniLLM. Engine stats logging is off by default, as in
    vLLM's `LLM`.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        kwargs.setdefault("disable_log_stats", True)
        kwargs.setdefault("usage_context", UsageContext.LLM_CLASS)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="omni-llm-loop", daemon=True
        )
        self._thread.start()
        self._counter = 0
        try:
            self.engine: AsyncOmniLLM = self._run(self._create(model, kwargs))
        except BaseException:
            self._stop_loop()
            raise

    @staticmethod
    async def _create(model: str, kwargs: dict[str, Any]) -> AsyncOmniLLM:
        return AsyncOmniLLM(model, **kwargs)

    @staticmethod
    async def _shutdown(engine: AsyncOmniLLM) -> None:
        engine.shutdown()

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def pipeline(self):
        return self.engine.pipeline

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params_list: Sequence[StageSampling] | SamplingParams | None = None,
        use_tqdm: bool = True,
        modalities: Sequence[str] | None = None,
    ) -> list[OmniRequestOutput]:
        """Generate for every prompt; returns the final outputs in prompt order.

        `sampling_params_list` has one entry per stage (SamplingParams, a dict of overrides,
        or None for the stage's defaults); a single SamplingParams is fine for a one-stage
        pipeline. Each prompt yields one output per final stage that `modalities` (default:
        the pipeline's default) asks for.
        """
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        params = self.engine.sampling_params_list(sampling_params_list)
        for p in params:
            if isinstance(p, SamplingParams):
                # Only whole outputs are wanted offline: no per-token deltas to process.
                p.output_kind = RequestOutputKind.FINAL_ONLY
        ids = [self._next_id() for _ in prompts]
        future = asyncio.run_coroutine_threadsafe(
            self._generate_all(prompts, params, ids, use_tqdm, modalities), self._loop
        )
        try:
            return future.result()
        except KeyboardInterrupt:
            future.cancel()  # cancels every request, which aborts it in every stage
            raise

    def _next_id(self) -> str:
        self._counter += 1
        return f"offline-{self._counter}"

    async def _generate_all(
        self,
        prompts: Sequence[PromptType],
        params: list[Any],
        ids: list[str],
        use_tqdm: bool,
        modalities: Sequence[str] | None,
    ) -> list[OmniRequestOutput]:
        bar = tqdm(total=len(prompts), desc="Requests", disable=not use_tqdm, dynamic_ncols=True)
        # Diffusion stages report denoising steps: a second bar over every request's steps,
        # its total growing as each request's step count becomes known.
        steps: tqdm | None = None

        async def one(prompt: PromptType, request_id: str) -> list[OmniRequestOutput]:
            nonlocal steps
            finals, seen, counted = [], 0, False
            async for out in self.engine.generate(prompt, params, request_id, modalities):
                if out.metrics.get("num_steps"):
                    if steps is None:
                        steps = tqdm(total=0, desc="Denoising steps", unit="step",
                                     disable=not use_tqdm, dynamic_ncols=True, position=1)
                    if not counted:
                        steps.total += out.metrics["num_steps"]
                        counted = True
                    steps.update(out.metrics["step"] - seen)
                    seen = out.metrics["step"]
                if out.finished:
                    finals.append(out)
            bar.update(1)
            return finals

        try:
            # Render all prompts first, so the engine gets them in one burst, as vLLM's LLM.
            prompts = await self.engine.render(list(prompts))
            # A TaskGroup cancels (and so aborts) the other requests if one fails.
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(p, i)) for p, i in zip(prompts, ids, strict=True)]
        except ExceptionGroup as group_error:
            raise group_error.exceptions[0] from None  # the first failure, as a caller expects
        finally:
            bar.close()
            if steps is not None:
                steps.close()
        return [out for task in tasks for out in task.result()]

    def shutdown(self) -> None:
        if self._loop.is_closed():
            return
        engine = getattr(self, "engine", None)
        if engine is not None:
            # On the loop's thread: the engines cancel their output tasks there, before their
            # processes go (from another thread, a task could see its engine die first).
            self._run(self._shutdown(engine))
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> OmniLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
