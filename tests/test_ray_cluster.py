"""Stages on a real three-node Ray cluster on this machine (`ray.cluster_utils.Cluster`:
three raylets, each with its own object store, distinct custom resources): the LLM -> LLM
-> DiT pipeline with each stage pinned to its own node gives the one-host answers, its
payload crosses nodes through the object store, a killed node fails its stage's requests
naming it, and nothing of ours is left on the cluster after shutdown."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
from conftest import MAX_MODEL_LEN, pipeline_llm
from test_pipeline_dit import assert_equals_steps_by_hand

from vllm_omni.errors import StageError
from vllm_omni.outputs import OmniRequestOutput
from vllm_omni.processors import joined_text
from vllm_omni.testing.tiny_models import make_tiny

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NODES = {"node_a": "head", "node_b": "second", "node_c": "third"}

PIPELINE = """
name: prompt-to-image-on-ray
stages:
  - name: first
    engine: ar
    sampling_params: {{temperature: 0.0, max_tokens: 6, ignore_eos: true}}
    output: text
    hidden_states: true
    placement: {{resources: {{node_a: 1}}}}
  - name: second
    engine: ar
    inputs: [first]
    input_processor: vllm_omni.processors:upstream_text
    sampling_params: {{temperature: 0.0, max_tokens: 5, ignore_eos: true}}
    output: text
    final_output: true
    placement: {{resources: {{node_b: 1}}}}
  - name: dit
    engine: diffusion
    model: {dit}
    inputs: [first, second]
    input_processor: test_ray_cluster:text_and_states
    sampling_params: {{height: 64, width: 64, num_inference_steps: 3, seed: 9}}
    output: image
    final_output: true
    placement: {{resources: {{node_c: 1}}}}
"""

PROMPTS = ["Draw me a cat", "a blue house by the sea"]


def text_and_states(upstream: dict[str, OmniRequestOutput], prompt):
    """The DiT's prompt: both texts, and the first stage's hidden states as a tensor input
    (as a DiT conditioned on an LLM's states takes them; the tiny Flux reads the text)."""
    return {**joined_text(upstream, prompt),
            "states": upstream["first"].tensor_handles["hidden_states"]}


@pytest.fixture(scope="module")
def cluster():
    """Three nodes on loopback. This machine may send traffic only to 127.0.0.0/8, and Ray
    rewrites 127.0.0.1 to the machine's interface address unless told not to."""
    env = pytest.MonkeyPatch()
    env.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"node_a": 1}, "include_dashboard": False})
    nodes = {"node_a": cluster.head_node}
    for name in ("node_b", "node_c"):
        nodes[name] = cluster.add_node(num_cpus=2, resources={name: 1})
    yield cluster, nodes
    cluster.shutdown()
    env.undo()


@pytest.fixture(scope="module")
def dit_folder(tmp_path_factory):
    return make_tiny("flux-tiny", tmp_path_factory.mktemp("dit") / "flux-tiny")


@pytest.fixture(scope="module")
def on_ray(cluster, tiny_qwen2, dit_folder, tmp_path_factory):
    with pipeline_llm(tiny_qwen2, PIPELINE.format(dit=dit_folder),
                      tmp_path_factory.mktemp("pipelines"), max_model_len=MAX_MODEL_LEN,
                      ray_address=cluster[0].address, stage_restarts=0) as llm:
        yield llm


def node_of_resource() -> dict[str, str]:
    """Ray's own view: which node id offers each custom resource."""
    import ray

    return {name: n["NodeID"] for n in ray.nodes() if n["Alive"]
            for name in NODES if name in n["Resources"]}


def test_pinned_stages_equal_the_one_host_run(on_ray, vllm_llm, dit_folder):

    outs = on_ray.generate(PROMPTS)
    # Each stage ran on the node offering its resource, as Ray reports it.
    where = {name: stage.node for name, stage in on_ray.engine.stages.items()}
    owners = node_of_resource()
    assert where == {"first": owners["node_a"], "second": owners["node_b"],
                     "dit": owners["node_c"]}
    assert_equals_steps_by_hand(outs, vllm_llm, dit_folder)
    # The DiT's tensor input came from the first stage's node through the object store.
    received = on_ray._run(on_ray.engine.stages["dit"].received())
    assert [r["from_node"] for r in received] == [owners["node_a"]] * len(PROMPTS)
    assert all(r["nbytes"] > 0 for r in received)


def test_unplaceable_stage_fails_naming_it(on_ray, cluster, dit_folder, tmp_path):
    from vllm_omni import OmniLLM

    (tmp_path / "p.yaml").write_text(f"""
name: nowhere
stages:
  - name: painter
    engine: diffusion
    model: {dit_folder}
    output: image
    final_output: true
    placement: {{resources: {{node_z: 1}}}}
""")
    start = time.monotonic()
    with pytest.raises(Exception, match=r"stage 'painter'.*no live node offers \{node_z: 1\}"):
        OmniLLM(str(dit_folder), stage_configs_path=str(tmp_path / "p.yaml"),
                ray_address=cluster[0].address, ray_placement_timeout=3)
    assert time.monotonic() - start < 60


def test_unreachable_address_is_a_clear_error(tiny_qwen2):
    start = time.monotonic()
    proc = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", tiny_qwen2, "--omni",
         "--ray-address", "127.0.0.1:9"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--ray-address '127.0.0.1:9': no Ray head node answers there" in proc.stderr
    assert time.monotonic() - start < 60


def test_without_ray_address_ray_is_never_imported():
    code = ("import sys\n"
            "import vllm_omni.entrypoints.openai.api_server, vllm_omni.entrypoints.omni_llm\n"
            "import vllm_omni.orchestrator.orchestrator, vllm_omni.outputs\n"
            "assert 'ray' not in sys.modules, 'ray was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_killed_node_fails_its_stage_and_leaves_nothing(on_ray, cluster):
    """Last in the module: it takes the DiT's node down."""
    import ray

    engine = on_ray.engine

    async def long_image():
        slow = {"num_inference_steps": 1000}  # seconds of denoising: killed midway
        return [o async for o in engine.generate(PROMPTS[0], [None, None, slow])]

    async def kill_mid_request():
        task = asyncio.create_task(long_image())
        while not any("dit" in run.started for run in engine.orchestrator.runs):
            assert not task.done(), task.exception()
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
        killed = time.monotonic()
        await asyncio.to_thread(cluster[0].remove_node, cluster[1]["node_c"], False)
        with pytest.raises(StageError) as failure:
            await task
        return failure.value, time.monotonic() - killed

    error, seconds = on_ray._run(kill_mid_request())
    assert error.stage == "dit" and "stage 'dit'" in str(error)
    assert seconds < 30

    async def health():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                await engine.check_health()
            except Exception as e:
                return str(e)
            await asyncio.sleep(0.5)
        return None

    assert "stage 'dit'" in (on_ray._run(health()) or "")
    # The stages the DiT's node did not hold still answer requests that do not need it.
    (text,) = on_ray.generate(PROMPTS[0], modalities=["text"])
    assert text.stage == "second" and text.finished

    on_ray.shutdown()
    ray.init(address=cluster[0].address, namespace="vllm-omni")
    try:
        ours = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("vllm-omni:")]
        assert ours == []
        groups = ray.util.placement_group_table().values()
        assert all(g["state"] == "REMOVED" for g in groups if g["name"].startswith("vllm-omni"))
    finally:
        ray.shutdown()


def test_a_stage_bundle_follows_device_ranks_and_resources():
    from pydantic import ValidationError

    from vllm_omni.cluster.placement import shortfall, stage_bundle
    from vllm_omni.config.kinds import StartContext
    from vllm_omni.config.schema import StageConfig

    def bundle(**stage):
        return stage_bundle(StageConfig(name="s", **stage), StartContext("m"))

    assert bundle() == {"CPU": 1.0}
    assert bundle(engine_args={"tensor_parallel_size": 2},
                  placement={"resources": {"node_b": 1}}) == {"CPU": 2.0, "node_b": 1}
    assert bundle(engine="diffusion", output="image",
                  placement={"device": "cuda"}) == {"CPU": 1.0, "GPU": 1.0}
    with pytest.raises(ValidationError, match="CPU / GPU follow"):
        bundle(placement={"resources": {"GPU": 2}})
    nodes = [{"Alive": True, "Resources": {"CPU": 4, "node_a": 1}},
             {"Alive": False, "Resources": {"CPU": 4, "node_b": 1}}]
    assert shortfall({"CPU": 2, "node_b": 1}, nodes) == "no live node offers {node_b: 1}"
