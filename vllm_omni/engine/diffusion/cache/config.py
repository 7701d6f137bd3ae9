"""How a request's denoising steps may be cached (per server, overridable per request)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Method = Literal["none", "teacache", "block"]


class CacheConfig(BaseModel):
    """Step caching: reuse a transformer residual from an earlier step when the input barely moved.

    - `teacache`: the first block's timestep-modulated input, compared with the previous
      step's (relative L1), mapped through `coefficients` (a polynomial, highest power first;
      identity when unset) and accumulated; while the sum stays under `threshold` the whole
      block stack is skipped and its last residual reused.
    - `block`: the first `first_blocks` and the last `last_blocks` blocks always run; the
      middle ones are skipped while the residual of the first blocks differs from the one at
      the last computed step by less than `threshold` (relative L1).

    `taylor` forecasts the skipped residual to the current timestep (first order, from the
    two last computed steps) instead of reusing it as is. Guards: the first `warmup_steps`
    always compute; at most `max_consecutive` cached steps in a row; at most `max_cached`
    cached steps in all. A threshold of 0 computes every step (bitwise the uncached result).
    """

    model_config = ConfigDict(extra="forbid")

    method: Method = "none"
    threshold: float = Field(default=0.1, ge=0.0)
    first_blocks: int = Field(default=1, ge=1)
    last_blocks: int = Field(default=0, ge=0)
    warmup_steps: int = Field(default=2, ge=0)
    max_consecutive: int = Field(default=3, ge=1)
    max_cached: int | None = Field(default=None, ge=0)
    taylor: bool = False
    coefficients: list[float] | None = Field(default=None, min_length=1, max_length=8)

    @model_validator(mode="after")
    def _method_fields(self) -> CacheConfig:
        if self.coefficients is not None and self.method != "teacache":
            raise ValueError("coefficients apply to method 'teacache' only")
        return self

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def rescale(self, x: float) -> float:
        if not self.coefficients:
            return x
        out = 0.0
        for c in self.coefficients:
            out = out * x + c
        return out
