"""The finished request, as the in-process engine and the client library return it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Result:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict  # usage, latency and speculation stats (RequestStats.as_dict)
