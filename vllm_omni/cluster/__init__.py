"""Stages as actors on a Ray cluster (`--ray-address`).

Nothing here imports Ray at import time, and nothing imports this package unless a Ray
address is given: Ray stays an optional dependency (`pip install "vllm-omni[ray]"`).
See docs/design/ray.md.
"""
