"""Stages on a real three-node Ray cluster on this machine (`ray.cluster_utils.Cluster`:
three raylets, each with its own object store, distinct custom resources): Qwen2.5-Omni's
thinker, talker and code2wav, and an LLM -> LLM -> DiT pipeline, each stage pinned to its
own node, give the one-host answers (streamed speech still streams), their payloads cross
nodes through the object store, a killed node fails its stage's requests naming it, and
nothing of ours is left on the cluster after shutdown."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import yaml
from conftest import MAX_MODEL_LEN, SERVER_MAX_MODEL_LEN, ServerProcess, pipeline_llm
from test_pipeline_dit import assert_equals_steps_by_hand
from vllm import SamplingParams

from vllm_omni.config.loader import BUILTIN_DIR
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
    sampling_params: {{height: 64, width: 64, num_inference_steps: 3, seed: 9,
                      float_output: true}}
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


OMNI_NODES = {"thinker": "node_a", "talker": "node_b", "code2wav": "node_c"}
OMNI_PROMPTS = ["Tell me a story about a red fox.", "Sing."]
OMNI_SEED = 1234


def omni_on_three_nodes() -> str:
    """The built-in Qwen2.5-Omni pipeline, each stage pinned to its own node."""
    pipeline = yaml.safe_load((BUILTIN_DIR / "qwen2_5_omni.yaml").read_text())
    pipeline["name"] = "qwen2_5_omni-on-ray"
    for stage in pipeline["stages"]:
        stage["placement"] = {"resources": {OMNI_NODES[stage["name"]]: 1}}
    return yaml.safe_dump(pipeline)


def omni_params(talker_tokens: int, **code2wav) -> list:
    # The talker runs to its token cap (a random talker may say eos at any point).
    return [SamplingParams(temperature=0, max_tokens=8),
            {"temperature": 0, "max_tokens": talker_tokens, "stop_token_ids": []},
            {"seed": OMNI_SEED, **code2wav}]


def speak(llm, prompts: list[str]) -> dict:
    """What the tests compare: per prompt the thinker's tokens, the talker's codes and the
    waveform decoded whole; and one prompt streamed, as the caller got it."""
    outs = llm.generate(prompts, omni_params(24), modalities=["text", "audio"],
                        use_tqdm=False)
    by_stage = {s: [o for o in outs if o.stage == s] for s in ("thinker", "code2wav")}

    async def streamed() -> list:
        params = llm.engine.sampling_params_list(omni_params(96, stream=True))
        return [out async for out in llm.engine.generate(prompts[0], params, "streamed",
                                                         ["text", "audio"])
                if out.stage == "code2wav"]

    return {"tokens": [o.token_ids for o in by_stage["thinker"]],
            "codes": [o.tensors["codes"].tolist() for o in by_stage["code2wav"]],
            "waveforms": [o.audio.waveform for o in by_stage["code2wav"]],
            "chunks": llm._run(streamed())}


def group_nodes(stages: dict) -> dict[str, str]:
    """Ray's own record (the GCS's placement group table) of the node each stage's placement
    group, which holds its actor, was placed on."""
    import ray

    return {name: ray.util.placement_group_table(stage.group)["bundles_to_node_id"][0]
            for name, stage in stages.items()}


def test_omni_on_three_nodes_equals_one_host(cluster, tiny_omni, tmp_path):
    """Thinker, talker and code2wav each on its own node: the thinker's hidden states reach
    the talker through the object store, the talker's codes stream to code2wav across nodes,
    and the caller gets the one-host run's text, codes and waveforms, streamed audio in
    several chunks. First in the module, so the LLM pipeline of the tests below is not
    holding the nodes' CPUs yet."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_omni)
    prompts = [processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": p}]}],
        add_generation_prompt=True, tokenize=False) for p in OMNI_PROMPTS]
    kwargs = {"dtype": "float32", "max_model_len": 1024}
    with pipeline_llm(tiny_omni, omni_on_three_nodes(), tmp_path, **kwargs) as one_host:
        assert one_host.engine.launcher is None  # placement resources mean nothing here
        here = speak(one_host, prompts)
    with pipeline_llm(tiny_omni, omni_on_three_nodes(), tmp_path,
                      ray_address=cluster[0].address, stage_restarts=0, **kwargs) as on_ray:
        stages = on_ray.engine.stages
        owners = node_of_resource()
        asked = {name: owners[node] for name, node in OMNI_NODES.items()}
        assert len(set(asked.values())) == 3
        assert group_nodes(stages) == asked  # where Ray placed each stage's group
        assert {name: stage.node for name, stage in stages.items()} == asked  # the actors
        there = speak(on_ray, prompts)
        received = on_ray._run(stages["talker"].received())
    # Every request's thinker states came to the talker from the thinker's node.
    assert [r["from_node"] for r in received] == [asked["thinker"]] * (len(prompts) + 1)
    assert all(r["nbytes"] > 0 for r in received)

    # Same stages, same CPU, same threads per stage: the runs measured bit-identical here
    # (max |difference| 0.0, peaks ~0.15). The tolerance leaves room only for float
    # reassociation should a stage's thread count differ between an actor and this process;
    # a wrong code, seed, voice or chunking moves samples by 1e-3 and more.
    assert there["tokens"] == here["tokens"] and all(here["tokens"])
    assert there["codes"] == here["codes"]
    for got, want in zip(there["waveforms"], here["waveforms"], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)

    chunks, want = there["chunks"], here["chunks"]
    whole = chunks[-1].audio.waveform
    assert len(chunks) > 1 and [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
    # Audio began before the talker's last code reached code2wav: the edge streamed.
    assert not chunks[0].metrics["input_complete"]
    pieces = [c.audio.waveform[c.metrics["samples"] - c.metrics["new_samples"]:] for c in chunks]
    assert all(len(p) for p in pieces)
    np.testing.assert_array_equal(np.concatenate(pieces), whole)
    assert [c.metrics["samples"] for c in chunks] == [c.metrics["samples"] for c in want]
    assert chunks[-1].tensors["codes"].tolist() == want[-1].tensors["codes"].tolist()
    np.testing.assert_allclose(whole, want[-1].audio.waveform, atol=1e-6, rtol=0)


CHAT_TO_IMAGE = """
name: chat-to-image-on-ray
stages:
  - name: llm
    engine: ar
    output: text
    final_output: true
    placement: {{resources: {{node_a: 1}}}}
  - name: dit
    engine: diffusion
    model: {dit}
    inputs: [llm]
    input_processor: vllm_omni.processors:upstream_text
    sampling_params: {{num_inference_steps: 4}}
    output: image
    final_output: true
    placement: {{resources: {{node_b: 1}}}}
"""


def test_served_over_http_on_two_nodes(cluster, tiny_qwen2, tmp_path):
    """`vllm serve --omni --ray-address`: an LLM -> DiT pipeline, each stage on its own
    node, answers what a one-host server answers: the pipeline's info (read from the stages'
    StageInfo, made by their actors), the playground, chat rendered in the API process
    (streamed and not) and images, each image the one diffusers draws for its text and seed.
    Before the module's LLM pipeline starts, so the nodes' resources are free."""
    from test_chat_images import BODY, digits_image, pixels, streamed

    from vllm_omni.testing.digits import DIGITS_MODEL

    (tmp_path / "pipeline.yaml").write_text(CHAT_TO_IMAGE.format(dit=DIGITS_MODEL))
    srv = ServerProcess([tiny_qwen2, "--stage-configs-path", str(tmp_path / "pipeline.yaml"),
                         "--max-model-len", str(SERVER_MAX_MODEL_LEN), "--ray-address",
                         cluster[0].address, "--stage-restarts", "0"],
                        tmp_path / "server.log", timeout=300)
    try:
        info = httpx.get(srv.url + "/v1/omni/info", timeout=30).json()
        assert [s["name"] for s in info["stages"]] == ["llm", "dit"]
        assert info["image"]["family"] == "flux" and info["image"]["step_level"]
        assert info["max_model_len"] == SERVER_MAX_MODEL_LEN and info["inputs"] == ["text"]
        assert "<html" in httpx.get(srv.url + "/", timeout=30).text.lower()
        assert "Ray" in srv.log_path.read_text()  # the stages did start as actors

        whole = httpx.post(srv.url + "/v1/chat/completions",
                           json={**BODY, "modalities": ["text", "image"]}, timeout=120)
        assert whole.status_code == 200, whole.text
        text_part, image_part = whole.json()["choices"][0]["message"]["content"]
        drawn = pixels(image_part["image_url"]["url"])
        assert np.abs(drawn - digits_image(text_part["text"], 5)).max() <= 1

        deltas = streamed(srv, BODY)
        text = "".join(d["content"] for d in deltas if isinstance(d.get("content"), str))
        assert text == text_part["text"]
        assert np.array_equal(pixels(deltas[-1]["content"][0]["image_url"]["url"]), drawn)

        # An image request's prompt goes through the LLM too: the DiT draws its completion.
        prompt, llm = "a handwritten digit seven", {"temperature": 0, "max_tokens": 6}
        r = httpx.post(srv.url + "/v1/images/generations", timeout=120, json={
            "prompt": prompt, "seed": 3, "stage_sampling_params": {"llm": llm}})
        assert r.status_code == 200, r.text
        got = pixels("data:image/png;base64," + r.json()["data"][0]["b64_json"])
        completion = httpx.post(srv.url + "/v1/completions", timeout=120,
                                json={"prompt": prompt, **llm}).json()
        assert np.abs(got - digits_image(completion["choices"][0]["text"], 3)).max() <= 1
    finally:
        assert srv.stop(), "processes of the server were still alive after SIGTERM"


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
    from vllm_omni.config.schema import StageConfig
    from vllm_omni.engine.stage import StartContext

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
