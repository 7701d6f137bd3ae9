"""Qwen2-VL image and video processing without torchvision.

transformers' `qwen2_vl.image_processing_qwen2_vl` (and so vLLM's Qwen2-VL, Qwen2.5-VL and
Qwen2.5-Omni model files, which import `smart_resize` from it) needs torchvision, whose PyPI
builds do not load beside the CPU build of torch. transformers also ships a PIL backend of
the same processor. Where torchvision cannot be imported, this serves that module name from
the PIL backend, and Qwen2-VL's video processor from `qwen2_vl_video`. Where torchvision works it
does nothing.

It is installed from vLLM's `vllm.general_plugins` entry point, so it is active in every
process vLLM starts (API server, engine core, workers, model inspection).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from functools import cache
from types import ModuleType

IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
VIDEO_MODULE = "transformers.models.qwen2_vl.video_processing_qwen2_vl"


@cache
def torchvision_works() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision.transforms.v2.functional  # noqa: F401
    except Exception:  # a CUDA build beside CPU torch fails with RuntimeError/OSError
        return False
    return True


def _fill_image_module(module: ModuleType) -> None:
    pil = importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    module.smart_resize = pil.smart_resize
    module.Qwen2VLImageProcessorKwargs = pil.Qwen2VLImageProcessorKwargs
    # Same processor, same outputs; only the resize backend differs.
    module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
    module.__all__ = ["Qwen2VLImageProcessor"]


def _fill_video_module(module: ModuleType) -> None:
    from vllm_omni.compat.qwen2_vl_video import Qwen2VLVideoProcessor

    module.Qwen2VLVideoProcessor = Qwen2VLVideoProcessor
    module.__all__ = ["Qwen2VLVideoProcessor"]


_FILLERS = {IMAGE_MODULE: _fill_image_module, VIDEO_MODULE: _fill_video_module}


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module: ModuleType) -> None:
        _FILLERS[module.__name__](module)


class TorchvisionFreeFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _FILLERS or torchvision_works():
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(), origin="vllm_omni.compat")


def install() -> bool:
    """Install the finder and the video processor once; returns whether they are installed
    (False where torchvision works and nothing is needed)."""
    if torchvision_works():
        return False
    if not any(isinstance(f, TorchvisionFreeFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, TorchvisionFreeFinder())
        # transformers resolves the video processor by name through its lazy package, which
        # hands out a placeholder without torchvision; its auto registry is asked first.
        from vllm_omni.compat.qwen2_vl_video import register

        register()
    return True
