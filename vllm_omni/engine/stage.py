"""What every stage kind shares: its engine's abort / health / shutdown surface."""

from __future__ import annotations

from typing import Any


class EngineStage:
    """A stage over one engine client (vLLM's AsyncLLM or AsyncDiffusionEngine), which both
    offer abort(), check_health(), errored and shutdown() under the same names."""

    engine: Any

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def check_health(self) -> None:
        await self.engine.check_health()

    @property
    def errored(self) -> bool:
        return self.engine.errored

    def shutdown(self) -> None:
        self.engine.shutdown()
