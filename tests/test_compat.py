"""The torchvision-free fallback for transformers' Qwen2-VL image processor."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest

from vllm_omni.compat.torchvision_free import torchvision_works


def run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_plugin_is_registered_for_every_vllm_process():
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert "vllm_omni.plugin:register" in [p.value for p in plugins]


@pytest.mark.skipif(torchvision_works(), reason="torchvision works here: nothing to fall back")
def test_vllm_qwen2_vl_models_import_through_the_plugin():
    without = run_python("import vllm.model_executor.models.qwen2_vl")
    assert without.returncode != 0 and "torchvision" in without.stderr

    with_plugin = run_python("""
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        import vllm.model_executor.models.qwen2_vl
        import vllm.model_executor.models.qwen2_5_omni_thinker
        from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
            Qwen2VLImageProcessor, smart_resize)
        for h, w in [(28, 28), (300, 500), (1080, 1920), (56, 4000)]:
            assert smart_resize(h, w) == pil.smart_resize(h, w), (h, w)
        import numpy as np
        image = (np.random.default_rng(0).random((60, 90, 3)) * 255).astype("uint8")
        out = Qwen2VLImageProcessor()(images=[image], return_tensors="pt")
        ref = pil.Qwen2VLImageProcessorPil()(images=[image], return_tensors="pt")
        assert (out["pixel_values"] == ref["pixel_values"]).all()
        assert out["image_grid_thw"].tolist() == ref["image_grid_thw"].tolist()
        print("ok")
    """)
    assert with_plugin.returncode == 0, with_plugin.stderr[-3000:]
    assert with_plugin.stdout.strip().endswith("ok")


def test_does_nothing_where_torchvision_works(tmp_path):
    # A stand-in torchvision that imports cleanly (the real CUDA build cannot load here).
    fake = tmp_path / "torchvision" / "transforms" / "v2"
    fake.mkdir(parents=True)
    for d in (tmp_path / "torchvision", tmp_path / "torchvision" / "transforms", fake):
        (d / "__init__.py").write_text("")
    (fake / "functional.py").write_text("")
    result = run_python(
        """
        import sys
        from vllm_omni.compat.torchvision_free import IMAGE_MODULE, TorchvisionFreeFinder, install
        install()
        assert TorchvisionFreeFinder().find_spec(IMAGE_MODULE) is None
        print("ok")
    """,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
