"""One request's run through the pipeline's stages.

Each planned stage runs as its own task, as soon as its inputs are there: the finished
outputs of the stages feeding it, or, on a streamed edge, the upstream's first chunk (later
chunks follow through the stage's `add_input`). Outputs of the stages whose results the
request returns go to one queue, which `outputs()` yields from. When the caller stops
reading, a stage fails, or the request ends, every stage still holding it is aborted and
every tensor payload nobody read is freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from vllm_omni.config import PipelineConfig, StageConfig
from vllm_omni.engine.stage import Stage
from vllm_omni.errors import StageError
from vllm_omni.outputs import OmniRequestOutput
from vllm_omni.processors import PromptGroup

logger = logging.getLogger(__name__)

TENSOR_OUTPUTS = {"hidden_states", "latent"}
InputProcessor = Callable[[dict[str, OmniRequestOutput], Any, Stage, dict[str, Any]], Any]


def stage_request_id(request_id: str, stage: str) -> str:
    """The id a request has in one stage's engine."""
    return f"{request_id}-{stage}"


@dataclasses.dataclass
class StreamedEdge:
    """A streamed edge as its upstream sees it: every `every` tokens (and at the end) the
    upstream's output so far goes to the consumer's queue."""

    queue: asyncio.Queue
    every: int
    forwarded: int = 0

    def offer(self, out: OmniRequestOutput) -> None:
        if out.finished or out.num_generated_tokens - self.forwarded >= self.every:
            self.forwarded = out.num_generated_tokens
            self.queue.put_nowait(out)


class RequestRun:
    """A request over `planned` stages (in topological order), returning the outputs of
    the stages named in `returned`. `prompt` is the rendered prompt input processors see;
    `params` the request's parameters per stage name."""

    def __init__(
        self,
        request_id: str,
        pipeline: PipelineConfig,
        stages: dict[str, Stage],
        processors: dict[str, InputProcessor],
        planned: list[StageConfig],
        returned: set[str],
        prompt: Any,
        params: dict[str, Any],
    ) -> None:
        self.request_id = request_id
        self.pipeline = pipeline
        self.stages = stages
        self.processors = processors
        self.planned = planned
        self.returned = returned
        self.prompt = prompt
        self.params = params
        names = {s.name for s in planned}
        # Hidden states are kept only when a stage of this plan reads them.
        self.keep_hidden = {
            s.name: s.output == "hidden_states" or (
                s.hidden_states and any(c.name in names for c in pipeline.consumers(s.name)))
            for s in planned
        }
        self.done = {s.name: asyncio.Event() for s in planned}
        self.edges = {s.name: asyncio.Queue() for s in planned if s.stream_inputs}
        self.finished: dict[str, OmniRequestOutput] = {}
        self.started: set[str] = set()
        # The engine request ids each started stage holds for this request.
        self.engine_ids: dict[str, list[str]] = {}
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: dict[str, asyncio.Task] = {}
        # Seconds each stage took, filled as stages finish; every output carries this one
        # dict, so a caller that read the whole request sees every stage's.
        self.stage_seconds: dict[str, float] = {}

    # -- the run ---------------------------------------------------------------------------

    async def outputs(self) -> AsyncIterator[OmniRequestOutput]:
        """The returned stages' outputs as they come; raises StageError for a failed stage."""
        # Independent stages (fan-out branches, or the inputs of a fan-in) run concurrently.
        self.tasks = {s.name: asyncio.create_task(self.run_stage(s)) for s in self.planned}
        remaining = len(self.tasks)
        try:
            while remaining:
                item = await self.queue.get()
                if isinstance(item, StageError):
                    raise item from item.cause
                if isinstance(item, str):  # a stage finished
                    remaining -= 1
                else:
                    yield item
        finally:
            await self.stop()

    async def run_stage(self, config: StageConfig) -> None:
        """One stage of this request, from its input to its finished output."""
        name, feeder = config.name, None
        streams = [StreamedEdge(self.edges[c.name], c.stream_inputs[name])
                   for c in self.pipeline.consumers(name) if c.name in self.edges]
        try:
            prompt, complete = await self.stage_input(config)
            if isinstance(prompt, PromptGroup):
                await self.run_group(config, prompt)
            else:
                if not complete:
                    # It first runs when generate() below first waits, after the stage has
                    # sent the request to its engine: no chunk overtakes the start.
                    feeder = asyncio.create_task(self.feed(config))
                self.started.add(name)
                self.engine_ids[name] = [stage_request_id(self.request_id, name)]
                start = time.perf_counter()
                async for out in self.stages[name].generate(
                    self.engine_ids[name][0], prompt, self.params[name],
                    input_complete=complete, keep_hidden_states=self.keep_hidden[name],
                ):
                    out.request_id = self.request_id
                    out.metrics["stage_seconds"] = self.stage_seconds
                    if out.finished:
                        self.stage_seconds[name] = round(time.perf_counter() - start, 6)
                        self.finished[name] = out
                    for edge in streams:
                        edge.offer(out)
                    if name in self.returned:
                        self.queue.put_nowait(self.for_caller(out))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.queue.put_nowait(StageError(name, e))
        else:
            self.done[name].set()
            self.queue.put_nowait(name)
        finally:
            if feeder is not None:
                feeder.cancel()

    async def run_group(self, config: StageConfig, group: PromptGroup) -> None:
        """Several prompts of this request through one stage, concurrently; the first
        prompt's finished output, with all of them as its `parts`, is the stage's."""
        name = config.name
        if name in self.returned or any(c.name in self.edges
                                        for c in self.pipeline.consumers(name)):
            raise ValueError(f"stage {name!r}: a prompt group feeds whole outputs to "
                             "other stages; it cannot be a final output or stream")
        base = stage_request_id(self.request_id, name)
        self.engine_ids[name] = [base] + [f"{base}.{i}" for i in range(1, len(group.prompts))]
        self.started.add(name)
        start = time.perf_counter()

        async def one(engine_id: str, prompt: Any) -> OmniRequestOutput:
            last = None
            async for out in self.stages[name].generate(
                engine_id, prompt, self.params[name],
                keep_hidden_states=self.keep_hidden[name],
            ):
                last = out
                if out.finished:
                    parts[engine_id] = out
            assert last is not None and last.finished, f"stage {name!r} ended unfinished"
            return last

        parts: dict[str, OmniRequestOutput] = {}
        try:
            outs = await asyncio.gather(*(one(i, p) for i, p in
                                          zip(self.engine_ids[name], group.prompts,
                                              strict=True)))
        except BaseException:
            for out in parts.values():  # finished parts nobody will read
                out.discard_tensors()
            raise
        self.stage_seconds[name] = round(time.perf_counter() - start, 6)
        first = outs[0]
        first.request_id = self.request_id
        first.metrics["stage_seconds"] = self.stage_seconds
        first.parts = list(outs)
        self.finished[name] = first

    async def stage_input(self, config: StageConfig) -> tuple[Any, bool]:
        """The stage's prompt, and whether it is the whole input. A first stage with an
        input processor gets the request's prompt through it."""
        name = config.name
        if config.stream_inputs:
            (upstream,) = config.inputs
            first = await self.edges[name].get()
            return self.process(name, {upstream: first}), first.finished
        if not config.inputs:
            if config.input_processor:
                return self.process(name, {}), True
            return self.prompt, True
        for upstream in config.inputs:
            await self.done[upstream].wait()
        return self.process(name, {n: self.finished[n] for n in config.inputs}), True

    async def feed(self, config: StageConfig) -> None:
        """Hand a streamed edge's later chunks to the running consumer."""
        (upstream,) = config.inputs
        name = config.name
        try:
            while True:
                out = await self.edges[name].get()
                stage_input = self.process(name, {upstream: out})
                await self.stages[name].add_input(stage_request_id(self.request_id, name),
                                                  stage_input, out.finished)
                if out.finished:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.queue.put_nowait(StageError(name, e))

    def process(self, name: str, upstream: dict[str, OmniRequestOutput]) -> Any:
        return self.processors[name](upstream, self.prompt, self.stages[name], self.params)

    @staticmethod
    def for_caller(out: OmniRequestOutput) -> OmniRequestOutput:
        """The output as the caller gets it: tensors read out of their connector, or, for
        payloads kept only for downstream stages, without their handles."""
        if out.output_type in TENSOR_OUTPUTS:
            out.resolve_tensors()
            return out
        return dataclasses.replace(out, tensor_handles={})

    def fail_stage(self, name: str, error: BaseException) -> None:
        """End the request with `error` as the stage's, if that stage still holds it (its
        engine is gone, and may never answer for it)."""
        task = self.tasks.get(name)
        if task is not None and not task.done():
            task.cancel()
            self.queue.put_nowait(StageError(name, error))

    async def stop(self) -> None:
        """Cancelled, closed, failed or done: stop every stage still holding the request."""
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        for name in self.started - {n for n, e in self.done.items() if e.is_set()}:
            for engine_id in self.engine_ids.get(name, []):
                try:
                    await self.stages[name].abort(engine_id)
                except Exception as e:  # a dead engine holds nothing to abort
                    logger.debug("abort of %r in stage %r: %s", engine_id, name, e)
        # Payloads no stage read (a consumer failed or was cancelled first) are freed.
        for out in self.finished.values():
            out.discard_tensors()
