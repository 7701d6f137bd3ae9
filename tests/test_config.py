"""Pipeline config: validation errors name the file, the stage and the field."""

from __future__ import annotations

import json
import re

import pytest

from vllm_omni.config import PipelineConfigError, load_pipeline, parse_pipeline, resolve_pipeline
from vllm_omni.config.loader import builtin_pipelines

TWO_STAGE = """
name: chain
stages:
  - name: first
    engine: ar
    output: text
  - name: second
    engine: ar
    inputs: [first]
    input_processor: my_pkg.processors:text_to_prompt
    sampling_params: {temperature: 0.0, max_tokens: 8}
    engine_args: {max_model_len: 512}
    output: text
    final_output: true
"""


def write(tmp_path, text: str):
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    return path


def test_valid_pipeline_loads_in_topological_order(tmp_path):
    pipeline = load_pipeline(write(tmp_path, TWO_STAGE))
    assert [s.name for s in pipeline.topological_order()] == ["first", "second"]
    second = pipeline.stage("second")
    assert second.engine_args == {"max_model_len": 512}
    assert second.sampling_params["max_tokens"] == 8
    assert [s.name for s in pipeline.consumers("first")] == ["second"]


@pytest.mark.parametrize(
    "edit, expected",
    [
        # unknown field in a stage: names the file, the stage and the field
        (
            ("output: text\n  - name: second", "output: text\n    colour: red\n  - name: second"),
            ["stage 'first' (stages[0])", "colour", "Extra inputs are not permitted"],
        ),
        (
            ("engine: ar\n    inputs", "engine: magic\n    inputs"),
            ["stage 'second' (stages[1])", "field engine"],
        ),
        (
            ("{max_model_len: 512}", "{max_model_length: 512}"),
            ["stage 'second'", "engine_args", "unknown vLLM engine args ['max_model_length']"],
        ),
        (
            ("{temperature: 0.0, max_tokens: 8}", "{temprature: 0.0}"),
            ["stage 'second'", "sampling_params", "unknown sampling params ['temprature']"],
        ),
        (
            ("my_pkg.processors:text_to_prompt", "not-a-dotted-path"),
            ["stage 'second'", "input_processor", "package.module:function"],
        ),
        (("inputs: [first]", "inputs: [zeroth]"), ["unknown stages ['zeroth']"]),
        (("name: second", "name: first"), ["stage names must be unique", "first"]),
        (("final_output: true", "final_output: false"), ["no stage has final_output"]),
        (
            ("output: text\n    final_output: true", "output: image\n    final_output: true"),
            ["stage 'second'", "cannot output 'image'"],
        ),
        (("name: chain\n", "name: chain\nversion: 2\n"), ["field version", "Extra inputs"]),
        (
            ("name: chain\n", "name: chain\ndefault_modalities: [image]\n"),
            ["default_modalities ['image'] are not final outputs ['text']"],
        ),
        (
            ("inputs: [first]", "inputs: [first]\n    stream_inputs: {first: 12}"),
            ["stage 'second'", "only code2wav stages take streamed input"],
        ),
    ],
)
def test_invalid_pipelines_name_file_stage_and_field(tmp_path, edit, expected):
    old, new = edit
    assert old in TWO_STAGE
    path = write(tmp_path, TWO_STAGE.replace(old, new, 1))
    with pytest.raises(PipelineConfigError) as err:
        load_pipeline(path)
    message = str(err.value)
    assert str(path) in message
    for part in expected:
        assert part in message


def test_cycle_is_rejected():
    data = {
        "name": "loop",
        "stages": [
            {"name": "a", "inputs": ["b"], "input_processor": "m:f", "final_output": True},
            {"name": "b", "inputs": ["a"], "input_processor": "m:f"},
        ],
    }
    with pytest.raises(PipelineConfigError, match="cycle"):
        parse_pipeline(data, "inline")


def test_stage_with_inputs_needs_input_processor():
    data = {
        "name": "p",
        "stages": [{"name": "a"}, {"name": "b", "inputs": ["a"], "final_output": True}],
    }
    with pytest.raises(PipelineConfigError, match="needs an input_processor"):
        parse_pipeline(data, "inline")


def test_yaml_syntax_and_missing_file_errors(tmp_path):
    with pytest.raises(PipelineConfigError, match="not valid YAML"):
        load_pipeline(write(tmp_path, "name: [unclosed"))
    with pytest.raises(PipelineConfigError, match="cannot read"):
        load_pipeline(tmp_path / "missing.yaml")


def test_builtin_pipelines_are_valid_and_llm_is_default(tmp_path):
    pipelines = builtin_pipelines()
    assert "llm" in pipelines
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    assert resolve_pipeline(model).name == "llm"


def test_builtin_pipeline_is_picked_by_architecture(tmp_path, monkeypatch):
    from vllm_omni.config import loader

    builtin = tmp_path / "builtin"
    builtin.mkdir()
    (builtin / "llm.yaml").write_text("name: llm\nstages: [{name: llm, final_output: true}]\n")
    (builtin / "special.yaml").write_text(
        "name: special\narchitectures: [SpecialForCausalLM]\n"
        "stages: [{name: only, final_output: true}]\n"
    )
    monkeypatch.setattr(loader, "BUILTIN_DIR", builtin)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["SpecialForCausalLM"]}))
    assert resolve_pipeline(model).name == "special"
    # --stage-configs-path wins over the built-in choice
    override = write(tmp_path, TWO_STAGE)
    assert resolve_pipeline(model, override).name == "chain"


def _dit_stage(**fields) -> dict:
    return {"name": "pipeline", "stages": [
        {"name": "dit", "engine": "diffusion", "output": "image", "final_output": True, **fields}
    ]}


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"engine_args": {"max_model_len": 5}}, "unknown diffusion engine options"),
        ({"sampling_params": {"num_inference_steps": 0}}, "num_inference_steps"),
        ({"sampling_params": {"temperature": 0.5}}, "temperature"),
        ({"output": "text"}, "engine 'diffusion' cannot output 'text'"),
    ],
)
def test_diffusion_stage_fields_are_checked(fields, expected):
    with pytest.raises(PipelineConfigError, match=re.escape(expected)):
        parse_pipeline(_dit_stage(**fields), "p.yaml")
    ok = parse_pipeline(
        _dit_stage(engine_args={"max_batch_size": 4}, sampling_params={"seed": 1}), "p.yaml"
    )
    assert ok.stages[0].engine == "diffusion"


def test_diffusers_folder_gets_the_diffusion_pipeline(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    pipeline = resolve_pipeline(tmp_path)
    assert pipeline.name == "diffusion"
    assert [(s.engine, s.output) for s in pipeline.stages] == [("diffusion", "image")]


def test_streamed_edges_must_name_the_one_input():
    speech = builtin_pipelines()["qwen2_5_omni"].model_dump()
    code2wav = speech["stages"][2]
    assert code2wav["stream_inputs"] == {"talker": 12}
    for wrong, message in [({"thinker": 12}, "the stage's one input"),
                           ({"talker": 0}, "at least 1 token")]:
        code2wav["stream_inputs"] = wrong
        with pytest.raises(ValueError, match=message):
            parse_pipeline(speech, "speech.yaml")
