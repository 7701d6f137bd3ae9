"""Step caching for DiT stages: per-request state that survives step-level batching."""

from vllm_omni.engine.diffusion.cache.config import CacheConfig
from vllm_omni.engine.diffusion.cache.manager import CacheSlot, DiTCacheManager

__all__ = ["CacheConfig", "CacheSlot", "DiTCacheManager"]
