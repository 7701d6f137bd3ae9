"""The stage contract: a kind registered from outside runs in a pipeline beside the built-in
ones, configs check through the kind, and the schema imports no engine."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import pytest
import yaml
from vllm.outputs import CompletionOutput

from vllm_omni.config import PipelineConfigError, parse_pipeline
from vllm_omni.config.kinds import register_stage_kind
from vllm_omni.engine.memory import StagePlan
from vllm_omni.engine.stage import EngineStage, Stage, StageInfo, StartContext
from vllm_omni.entrypoints.async_omni_llm import AsyncOmniLLM
from vllm_omni.outputs import OmniRequestOutput


class ShoutStage(EngineStage):
    """A stage kind with no engine process: it answers its prompt in capitals, one word per
    output, and counts what it was asked to abort."""

    outputs: ClassVar[frozenset[str]] = frozenset({"text"})
    aborted: ClassVar[list[str]] = []

    @classmethod
    def check_engine_args(cls, args: dict[str, Any]) -> None:
        if set(args) - {"suffix"}:
            raise ValueError(f"unknown shout options {sorted(set(args) - {'suffix'})}")

    @classmethod
    def check_sampling_params(cls, params: dict[str, Any]) -> None:
        if set(params) - {"repeat"}:
            raise ValueError("shout takes only 'repeat'")

    @classmethod
    def memory_needs(cls, config, context: StartContext, device: str) -> StagePlan:
        return StagePlan(stage=config.name, engine=config.engine, device=device, weights=0,
                         kv_cache=0, activations=0, runtime=0)

    @classmethod
    def start(cls, config, context: StartContext) -> ShoutStage:
        return cls(config)

    def __init__(self, config) -> None:
        self.config, self.name = config, config.name
        self.suffix = config.engine_args.get("suffix", "!")
        self.info = StageInfo(name=config.name, engine=config.engine, output=config.output,
                              defaults={"repeat": 1})

    @classmethod
    def request_params(cls, info: StageInfo, given: dict[str, Any] | None) -> dict[str, Any]:
        params = {**info.defaults, **(given or {})}
        cls.check_sampling_params(params)
        return params

    async def generate(self, request_id: str, prompt: Any, params: dict[str, Any], *,
                       input_complete: bool = True, keep_hidden_states: bool = False
                       ) -> AsyncIterator[OmniRequestOutput]:
        text = prompt["prompt"] if isinstance(prompt, dict) else prompt
        words = (text.upper() + self.suffix).split() * params["repeat"]
        try:
            for i in range(len(words)):
                await asyncio.sleep(0)
                last = i == len(words) - 1
                yield OmniRequestOutput(request_id, self.name, "text", last, outputs=[
                    CompletionOutput(0, " ".join(words[:i + 1]), [], None, None,
                                     "stop" if last else None)])
        except GeneratorExit:
            self.aborted.append(request_id)
            raise

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def check_health(self) -> None:
        return None

    async def ping(self) -> None:
        return None

    @property
    def errored(self) -> bool:
        return False

    def shutdown(self) -> None:
        return None


register_stage_kind("shout", f"{__name__}:ShoutStage")


def pipeline(text: str):
    return parse_pipeline(yaml.safe_load(text), "test pipeline")

PIPELINE = """
name: shouting
stages:
  - name: first
    engine: shout
    output: text
  - name: second
    engine: shout
    engine_args: {suffix: "?"}
    inputs: [first]
    input_processor: vllm_omni.processors:upstream_text
    output: text
    final_output: true
"""


def test_a_registered_kind_runs_a_pipeline():
    async def main() -> list[OmniRequestOutput]:
        omni = AsyncOmniLLM("unused", pipeline=pipeline(PIPELINE))
        try:
            assert isinstance(omni.stages["first"], Stage)
            outs = [o async for o in omni.generate("hello there", [None, {"repeat": 2}], "r1")]
            # Stopping a request halfway aborts it in the stage still holding it.
            stream = omni.generate("one two three four", None, "r2")
            await anext(stream)
            await stream.aclose()
            return outs
        finally:
            omni.shutdown()

    outs = asyncio.run(main())
    # The second stage shouts what the first one shouted, twice: one output per word.
    assert [o.stage for o in outs] == ["second"] * 4
    assert outs[-1].finished and outs[-1].text == "HELLO THERE!? HELLO THERE!?"
    assert set(outs[-1].metrics["stage_seconds"]) == {"first", "second"}
    assert "r2-second" in ShoutStage.aborted


def test_configs_are_checked_by_their_kind():
    with pytest.raises(PipelineConfigError, match=r"unknown shout options \['loud'\]"):
        pipeline(PIPELINE.replace('{suffix: "?"}', "{loud: true}"))
    with pytest.raises(PipelineConfigError, match="cannot output 'image'"):
        pipeline(PIPELINE.replace("output: text\n    final", "output: image\n    final"))
    with pytest.raises(PipelineConfigError, match=r"unknown stage kind 'whisper'.*'shout'"):
        pipeline(PIPELINE.replace("engine: shout\n    output", "engine: whisper\n    output"))


def test_the_schema_imports_no_engine():
    code = ("import sys, vllm_omni.config.schema, vllm_omni.config.kinds; "
            "print(sorted(m for m in sys.modules if m.startswith('vllm_omni.engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
