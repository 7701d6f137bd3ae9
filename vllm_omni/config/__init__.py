from vllm_omni.config.loader import (
    PipelineConfigError,
    load_pipeline,
    parse_pipeline,
    resolve_pipeline,
)
from vllm_omni.config.schema import PipelineConfig, StageConfig

__all__ = [
    "PipelineConfig",
    "PipelineConfigError",
    "StageConfig",
    "load_pipeline",
    "parse_pipeline",
    "resolve_pipeline",
]
