"""`/v1/completions`: text completions, rendered by vLLM's own renderer and answered with
vLLM's response models, over the pipeline's text output."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from http import HTTPStatus

from vllm.entrypoints.openai.completion.protocol import (
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm.inputs import EngineInput

from vllm_omni.entrypoints.openai.protocol import (
    OmniCompletionRequest,
    OmniHTTPError,
    rendered,
)
from vllm_omni.entrypoints.openai.serving_base import (
    OmniServing,
    TextDeltas,
    error_event,
    final_outputs,
    primed,
    reject_unsupported,
    sse,
    usage_info,
)
from vllm_omni.outputs import OmniRequestOutput


class OmniServingCompletion(OmniServing):
    """Completes one prompt or several (each its own request in the pipeline, streamed
    together) with the pipeline's text stage, on pipelines whose final outputs have text."""

    async def completion(
        self, request: OmniCompletionRequest, request_id: str
    ) -> CompletionResponse | AsyncIterator[str]:
        """A CompletionResponse, or an async iterator of SSE lines when streaming."""
        self.check_model(request.model)
        reject_unsupported(request)
        if request.prompt is None:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, "'prompt' is required", "prompt")
        finals = {s.output for s in self.omni.pipeline.stages if s.final_output}
        if self.renderer is None or "text" not in finals:
            raise OmniHTTPError(
                HTTPStatus.BAD_REQUEST,
                f"pipeline {self.omni.pipeline.name!r} does not output text; "
                "use /v1/images/generations or /v1/chat/completions",
            )
        engine_inputs: list[EngineInput] = await rendered(
            self.renderer.render_completion(request)
        )
        streams = []
        prompt_lens = []
        for i, engine_input in enumerate(engine_inputs):
            prompt_len = len(engine_input["prompt_token_ids"])
            params = self.text_request_params(request, prompt_len)
            sub_id = request_id if len(engine_inputs) == 1 else f"{request_id}-{i}"
            streams.append(self.omni.generate(engine_input, params, sub_id, ["text"]))
            prompt_lens.append(prompt_len)
        if request.stream:
            try:
                streams = list(await asyncio.gather(*(primed(s) for s in streams)))
            except BaseException:
                await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
                raise
            return self._completion_stream(request, request_id, streams, sum(prompt_lens))
        texts = await asyncio.gather(*(_text_output(s) for s in streams))
        n = request.n
        choices = [
            CompletionResponseChoice(
                index=p * n + c.index,
                text=c.text,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for p, final in enumerate(texts)
            for c in final.outputs
        ]
        generated = sum(f.num_generated_tokens for f in texts)
        return CompletionResponse(
            id=request_id,
            model=request.model or self.model_name,
            choices=choices,
            usage=usage_info(sum(prompt_lens), generated),
        )

    async def _completion_stream(
        self,
        request: OmniCompletionRequest,
        request_id: str,
        streams: list[AsyncIterator[OmniRequestOutput]],
        prompt_tokens: int,
    ) -> AsyncIterator[str]:
        model = request.model or self.model_name
        created = int(time.time())
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        n = request.n
        deltas = [TextDeltas() for _ in streams]
        try:
            async for p, out in _merge(streams):
                if out.output_type != "text":
                    continue
                choices = [
                    CompletionResponseStreamChoice(
                        index=p * n + d.index, text=d.text,
                        finish_reason=d.finish_reason, stop_reason=d.stop_reason)
                    for d in deltas[p].take(out)
                ]
                if choices:
                    yield sse(
                        CompletionStreamResponse(
                            id=request_id, created=created, model=model, choices=choices
                        ).model_dump_json(exclude_unset=True)
                    )
        except Exception as e:  # headers are sent: the error goes into the stream
            yield error_event(e)
            yield sse("[DONE]")
            return
        if include_usage:
            yield sse(
                CompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=model,
                    choices=[],
                    usage=usage_info(prompt_tokens, sum(d.generated for d in deltas)),
                ).model_dump_json(exclude_unset=True)
            )
        yield sse("[DONE]")


async def _text_output(outputs: AsyncIterator[OmniRequestOutput]) -> OmniRequestOutput:
    finals = await final_outputs(outputs)
    if "text" not in finals:
        raise OmniHTTPError(HTTPStatus.INTERNAL_SERVER_ERROR, "the pipeline produced no text")
    return finals["text"]


async def _merge(streams: list[AsyncIterator[OmniRequestOutput]]):
    """Interleave several output streams as items arrive, tagged with their index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[OmniRequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out = await queue.get()
            if out is done:
                remaining -= 1
                if (exc := tasks[i].exception()) is not None:
                    raise exc
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
