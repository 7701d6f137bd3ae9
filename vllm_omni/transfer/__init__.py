"""Tensor transfer between stages: connectors put named tensors where the consumer can read
them and hand back a small handle; only the handle travels through the orchestrator."""

from vllm_omni.transfer.connectors import (
    Connector,
    InProcessConnector,
    SharedMemoryConnector,
    ShmHandle,
)

__all__ = ["Connector", "InProcessConnector", "SharedMemoryConnector", "ShmHandle"]
