from vllm_omni.engine.ar.stage import ARStage

__all__ = ["ARStage"]
