"""vLLM-omni: serve multi-stage, multi-modality pipelines on vLLM."""

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["AsyncOmniLLM", "OmniLLM", "OmniRequestOutput"]

if TYPE_CHECKING:
    from vllm_omni.entrypoints.async_omni_llm import AsyncOmniLLM
    from vllm_omni.entrypoints.omni_llm import OmniLLM
    from vllm_omni.outputs import OmniRequestOutput


def __getattr__(name: str):
    # Lazy, so `import vllm_omni` (e.g. by vLLM's plugin loader) does not import vLLM's engine.
    if name == "OmniLLM":
        from vllm_omni.entrypoints.omni_llm import OmniLLM

        return OmniLLM
    if name == "AsyncOmniLLM":
        from vllm_omni.entrypoints.async_omni_llm import AsyncOmniLLM

        return AsyncOmniLLM
    if name == "OmniRequestOutput":
        from vllm_omni.outputs import OmniRequestOutput

        return OmniRequestOutput
    raise AttributeError(name)
