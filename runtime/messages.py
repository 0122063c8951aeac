"""Every Struct that crosses a process boundary (and the request parameters they carry)."""

from __future__ import annotations

import msgspec


class RequestError(ValueError):
    """A request the server refuses; `field` names the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # None: the server draws one
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    spec: bool = True  # False switches speculation off for this request
    num_spec_tokens: int | None = None  # None: the engine's default

    def validate(self, max_num_spec_tokens: int = 16) -> None:
        if self.max_tokens <= 0:
            raise RequestError("max_tokens", f"must be > 0, got {self.max_tokens}")
        if not self.temperature >= 0 or self.temperature > 100:  # also rejects NaN
            raise RequestError("temperature", f"must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise RequestError("top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise RequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RequestError("seed", f"must be in [0, 2^63), got {self.seed}")
        if any(not s for s in self.stop):
            raise RequestError("stop", "stop strings must be non-empty")
        if self.num_spec_tokens is not None and not 0 <= self.num_spec_tokens <= max_num_spec_tokens:
            raise RequestError("num_spec_tokens",
                               f"must be in [0, {max_num_spec_tokens}], got {self.num_spec_tokens}")
