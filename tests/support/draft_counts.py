"""vLLM's speculative-decoding counters and the mean acceptance length they give.

Each draft step yields the draft tokens the target accepted plus one token of
the target's own, so the mean acceptance length is 1 + accepted / drafts.
`LLM.get_metrics()` names the counters `vllm:spec_decode_num_drafts` and so
on; a server's /metrics page (parsed by prometheus_text.parse_metrics) adds
Prometheus' `_total`. DraftCounts.read takes either.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

_PREFIX = "vllm:spec_decode_num_"


def _counter(metrics: Mapping[str, float], name: str) -> float:
    key = _PREFIX + name
    return metrics.get(key, metrics.get(key + "_total", 0))


@dataclasses.dataclass(frozen=True)
class DraftCounts:
    drafts: float
    draft_tokens: float
    accepted: float

    @classmethod
    def read(cls, metrics: Mapping[str, float]) -> DraftCounts:
        """The counters in `metrics`, 0 where one is missing (no draft yet)."""
        return cls(*(_counter(metrics, name) for name in ("drafts", "draft_tokens", "accepted_tokens")))

    @classmethod
    def between(cls, before: Mapping[str, float], after: Mapping[str, float]) -> DraftCounts:
        """What was counted from one metrics read to a later one."""
        start, end = cls.read(before), cls.read(after)
        return cls(end.drafts - start.drafts, end.draft_tokens - start.draft_tokens, end.accepted - start.accepted)

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts; NaN without drafts (so any comparison with it fails)."""
        return 1 + self.accepted / self.drafts if self.drafts else math.nan
