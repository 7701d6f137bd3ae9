"""`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's routes and bodies): LoRA
adapters added to and removed from the stages that serve them, while the server runs."""

from __future__ import annotations

from http import HTTPStatus

from vllm_omni.entrypoints.openai.protocol import (
    LoadLoraAdapterRequest,
    OmniHTTPError,
    UnloadLoraAdapterRequest,
)
from vllm_omni.entrypoints.openai.serving_base import OmniServing


class OmniServingLora(OmniServing):
    async def load(self, request: LoadLoraAdapterRequest, request_id: str) -> dict:
        name = request.lora_name
        if name in self.served_model_names or name in self.omni.adapters:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, f"lora_name: the model {name!r} is "
                                "already served", "lora_name")
        try:
            await self.omni.load_adapter(name, request.lora_path)
        except ValueError as e:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, f"lora_path: {e}", "lora_path") from None
        return {"object": "lora_adapter", "id": name, "parent": self.model_name,
                "message": f"LoRA adapter {name!r} added"}

    async def unload(self, request: UnloadLoraAdapterRequest, request_id: str) -> dict:
        name = request.lora_name
        if name not in self.omni.adapters:
            raise OmniHTTPError(HTTPStatus.NOT_FOUND, f"no LoRA adapter named {name!r} is "
                                "loaded", "lora_name")
        try:
            await self.omni.unload_adapter(name)
        except ValueError as e:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST, f"lora_name: {e}", "lora_name") from None
        return {"object": "lora_adapter", "id": name, "deleted": True,
                "message": f"LoRA adapter {name!r} removed"}
