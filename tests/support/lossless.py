"""What "lossless" means in this suite: greedy DFlash output against the
target-only output, one comparison for tests/cpu_e2e, tests/serve_load and
tests/gpu.

Why two rules. The verification step's numerics depend on the batch (which
requests share it, how many draft tokens each carries), and so do the
target-only engine's. In bfloat16/float16 that moves logits by more than the
gap between the target's top two tokens at its near-ties, so two correct
engines can legitimately part there (measured with the tiny pair through two
`vllm serve` processes, 16 concurrent copies of one chat request: bf16 parted
in 14 of 16 copies at one position whose top-2 logprobs were -0.62 vs -0.87
alone and equal under load; float32: 0 of 16). Hence:

* **exact** (model dtype float32, :data:`EXACT_DTYPES`): every token equal,
  lengths equal; a report names the first differing position.
* **near-tie** (bfloat16/float16): vLLM's own convention for comparing greedy
  outputs of two engines (upstream ``tests/models/utils.py``,
  ``check_logprobs_close``): the outputs may part at a position only where
  each side's token is among the *other* side's top-k logprobs, and the
  comparison stops at the first parting (after it, the contexts differ). This
  suite adds a margin: at the parting, each side's preference for its own
  token over the other's (``lp(own) - lp(other)`` in its own distribution)
  must be at most :data:`MARGIN_THRESHOLD` nats, else the parting is a clear
  one and fails. Every parting is reported: position, both tokens, both
  margins.

Pure python (no vLLM, no torch): logprobs are one ``{token id: logprob}``
mapping per output position (values may be floats or vLLM ``Logprob``
objects; :func:`logprob_rows` normalises them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

EXACT_DTYPES = frozenset({"float32", "float", "torch.float32"})
NEAR_TIE_DTYPES = frozenset({"bfloat16", "float16", "half", "torch.bfloat16", "torch.float16"})

# Logprobs to request (SamplingParams(logprobs=TOP_K)) for a near-tie comparison.
TOP_K = 5

# Nats. bf16 keeps 8 significant bits: the tiny pairs' logits span about
# +-16..32, where one bf16 step is 0.06-0.125, and a batch change moved a
# top-2 gap by 0.25 in the measurement above. Twice that is still far below
# the typical top-2 gap of these random targets (several nats), so a wrong
# token accepted by the verifier parts at a clear margin and fails.
MARGIN_THRESHOLD = 0.5

Row = Mapping[int, float]


def logprob_rows(sample_logprobs) -> list[dict[int, float]] | None:
    """vLLM's per-position sample logprobs (``CompletionOutput.logprobs``:
    ``{token id: Logprob}`` per position) as ``{token id: float}`` rows."""
    if sample_logprobs is None:
        return None
    return [{int(t): float(getattr(lp, "logprob", lp)) for t, lp in pos.items()} for pos in sample_logprobs]


def first_difference(got: Sequence[int], want: Sequence[int]) -> int | None:
    """First position where the two differ (a shorter one ends there); None if equal."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def mode_for(dtype: str) -> str:
    d = str(dtype)
    if d in EXACT_DTYPES:
        return "exact"
    if d in NEAR_TIE_DTYPES:
        return "near-tie"
    raise ValueError(
        f"no lossless rule for model dtype {dtype!r}: exact {sorted(EXACT_DTYPES)}, near-tie {sorted(NEAR_TIE_DTYPES)}"
    )


@dataclass(frozen=True)
class Parting:
    """Where ``got`` (e.g. DFlash) first leaves ``want`` (target only)."""

    key: str
    position: int
    got: int | None  # None: got ended here
    want: int | None  # None: want ended here
    # lp(got) - lp(want) in got's distribution, lp(want) - lp(got) in want's;
    # None where unknown (no logprobs, or the other token is not in the top-k).
    got_margin: float | None = None
    want_margin: float | None = None
    accepted: bool = False
    why: str = ""

    @property
    def margin(self) -> float | None:
        """The larger of the two margins (what the threshold applies to)."""
        known = [m for m in (self.got_margin, self.want_margin) if m is not None]
        return max(known) if known else None

    def describe(self) -> str:
        def fmt(m):
            return "n/a" if m is None else f"{m:.4f}"

        return (
            f"{self.key}: parts at position {self.position}: got {self.got}, want "
            f"{self.want}; margin in got's distribution {fmt(self.got_margin)}, in "
            f"want's {fmt(self.want_margin)} ({'accepted' if self.accepted else 'FAILS'}: "
            f"{self.why})"
        )


@dataclass(frozen=True)
class OutputComparison:
    key: str
    mode: str
    compared_tokens: int  # positions compared (up to the parting, if any)
    parting: Parting | None = None

    @property
    def equal(self) -> bool:
        return self.parting is None

    @property
    def ok(self) -> bool:
        return self.parting is None or self.parting.accepted


def compare_exact(got: Sequence[int], want: Sequence[int], key: str = "", prefix: bool = False) -> OutputComparison:
    """Every token equal (``prefix``: ``got`` is a prefix of ``want``, e.g.
    what a client received before it went away)."""
    got, want = list(got), list(want)
    if prefix:
        want = want[: len(got)] if len(got) <= len(want) else want
    pos = first_difference(got, want)
    if pos is None:
        return OutputComparison(key, "exact", len(got))
    at = lambda s: s[pos] if pos < len(s) else None  # noqa: E731
    why = "lengths differ" if at(got) is None or at(want) is None else "token differs"
    why += f" ({len(got)} vs {len(want)} tokens; exact comparison: every token must be equal)"
    return OutputComparison(key, "exact", pos, Parting(key, pos, at(got), at(want), why=why))


def compare_near_tie(
    got: Sequence[int],
    want: Sequence[int],
    got_logprobs: Sequence[Row] | None,
    want_logprobs: Sequence[Row] | None,
    key: str = "",
    threshold: float = MARGIN_THRESHOLD,
) -> OutputComparison:
    """vLLM's top-k convention plus a margin (module docstring)."""
    got, want = list(got), list(want)
    pos = first_difference(got, want)
    if pos is None:
        return OutputComparison(key, "near-tie", len(got))
    if pos >= len(got) or pos >= len(want):
        a = got[pos] if pos < len(got) else None
        b = want[pos] if pos < len(want) else None
        return OutputComparison(
            key,
            "near-tie",
            pos,
            Parting(key, pos, a, b, why=f"lengths differ ({len(got)} vs {len(want)} tokens) with no parting"),
        )
    a, b = got[pos], want[pos]
    g = got_logprobs[pos] if got_logprobs is not None and pos < len(got_logprobs) else None
    w = want_logprobs[pos] if want_logprobs is not None and pos < len(want_logprobs) else None
    if g is None or w is None:
        return OutputComparison(
            key,
            "near-tie",
            pos,
            Parting(key, pos, a, b, why="no logprobs at the parting (request SamplingParams(logprobs=k))"),
        )
    g_margin = g[a] - g[b] if a in g and b in g else None
    w_margin = w[b] - w[a] if a in w and b in w else None
    missing = []
    if b not in g:
        missing.append(f"want's token {b} is not in got's top-{len(g)}")
    if a not in w:
        missing.append(f"got's token {a} is not in want's top-{len(w)}")
    if missing:
        return OutputComparison(
            key, "near-tie", pos, Parting(key, pos, a, b, g_margin, w_margin, why="; ".join(missing))
        )
    margin = max(g_margin, w_margin)
    if margin > threshold:
        return OutputComparison(
            key,
            "near-tie",
            pos,
            Parting(
                key,
                pos,
                a,
                b,
                g_margin,
                w_margin,
                why=f"clear margin {margin:.4f} > {threshold} nats: not a numerical near-tie",
            ),
        )
    return OutputComparison(
        key,
        "near-tie",
        pos,
        Parting(
            key,
            pos,
            a,
            b,
            g_margin,
            w_margin,
            accepted=True,
            why=f"near-tie: margin {margin:.4f} <= {threshold} nats, each token in the other's top-k",
        ),
    )


def compare(
    got: Sequence[int],
    want: Sequence[int],
    *,
    dtype: str,
    key: str = "",
    got_logprobs: Sequence[Row] | None = None,
    want_logprobs: Sequence[Row] | None = None,
    threshold: float = MARGIN_THRESHOLD,
) -> OutputComparison:
    """The rule for the engines' model ``dtype`` (exact in float32)."""
    if mode_for(dtype) == "exact":
        return compare_exact(got, want, key)
    return compare_near_tie(got, want, got_logprobs, want_logprobs, key, threshold)


@dataclass
class Report:
    """Verdicts over many outputs, with the counts a test prints.

    ``compared``: keys compared; ``exact``: keys equal token for token;
    ``parted``: every parting found (accepted near-ties and failures);
    ``ok``: no parting failed."""

    dtype: str
    threshold: float = MARGIN_THRESHOLD
    compared: list[str] = field(default_factory=list)
    exact: list[str] = field(default_factory=list)
    parted: list[Parting] = field(default_factory=list)

    @property
    def mode(self) -> str:
        return mode_for(self.dtype)

    def add(self, verdict: OutputComparison) -> OutputComparison:
        self.compared.append(verdict.key)
        if verdict.equal:
            self.exact.append(verdict.key)
        else:
            self.parted.append(verdict.parting)
        return verdict

    def compare(
        self,
        key: str,
        got: Sequence[int],
        want: Sequence[int],
        *,
        got_logprobs: Sequence[Row] | None = None,
        want_logprobs: Sequence[Row] | None = None,
        prefix: bool = False,
    ) -> OutputComparison:
        if prefix or self.mode == "exact":
            if prefix and self.mode != "exact":
                raise ValueError("prefix comparisons are exact only (float32)")
            return self.add(compare_exact(got, want, key, prefix=prefix))
        return self.add(compare_near_tie(got, want, got_logprobs, want_logprobs, key, self.threshold))

    @property
    def accepted(self) -> list[Parting]:
        return [p for p in self.parted if p.accepted]

    @property
    def failed(self) -> list[Parting]:
        return [p for p in self.parted if not p.accepted]

    @property
    def ok(self) -> bool:
        return not self.failed

    def summary(self) -> dict:
        """Counts for a test's figures: compared, exact, parted (accepted), failed, margins."""
        out = {
            "rule": self.mode if self.mode == "exact" else f"near-tie<={self.threshold}",
            "compared": len(self.compared),
            "exact": len(self.exact),
            "parted": len(self.accepted),
            "failed": len(self.failed),
        }
        if self.parted:
            out["partings"] = [
                (p.key, p.position, None if p.margin is None else round(p.margin, 4)) for p in self.parted
            ]
        return out

    def explain(self, limit: int = 10) -> str:
        lines = [
            f"{len(self.compared)} outputs compared ({self.mode}, model dtype {self.dtype}): "
            f"{len(self.exact)} equal, {len(self.accepted)} parted at a near-tie, "
            f"{len(self.failed)} failed"
        ]
        lines += [p.describe() for p in (self.failed + self.accepted)[:limit]]
        return "\n".join(lines)


def compare_all(
    keys: Iterable[str],
    got: Sequence[Sequence[int]],
    want: Sequence[Sequence[int]],
    *,
    dtype: str,
    got_logprobs=None,
    want_logprobs=None,
    threshold: float = MARGIN_THRESHOLD,
) -> Report:
    """One :class:`Report` over parallel lists of outputs (and logprob rows)."""
    keys = list(keys)
    if not len(keys) == len(got) == len(want):
        raise ValueError(f"{len(keys)} keys, {len(got)} outputs, {len(want)} references")
    report = Report(dtype, threshold)
    for i, key in enumerate(keys):
        report.compare(
            key,
            got[i],
            want[i],
            got_logprobs=None if got_logprobs is None else got_logprobs[i],
            want_logprobs=None if want_logprobs is None else want_logprobs[i],
        )
    return report
