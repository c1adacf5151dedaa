"""Unit tests of tests/support/lossless.py (pure python: no engine, no vLLM)."""

from __future__ import annotations

from types import SimpleNamespace

import lossless
import pytest

WANT = [5, 6, 7, 8]


def rows(*tops):
    """One {token: logprob} row per position."""
    return [dict(t) for t in tops]


# Target-only: at position 2 token 7 leads token 9 by 0.1 nats (a near-tie).
WANT_LP = rows({5: -0.1, 1: -3.0}, {6: -0.2, 2: -4.0}, {7: -0.65, 9: -0.75, 3: -3.0}, {8: -0.1, 4: -5.0})


def test_identical_outputs_are_exact_in_both_modes():
    for dtype in ("float32", "bfloat16"):
        rep = lossless.Report(dtype)
        v = rep.compare("p0", WANT, WANT, got_logprobs=WANT_LP, want_logprobs=WANT_LP)
        assert v.equal and v.ok and v.compared_tokens == 4
        assert rep.ok and rep.summary() == {
            "rule": "exact" if dtype == "float32" else "near-tie<=0.5",
            "compared": 1,
            "exact": 1,
            "parted": 0,
            "failed": 0,
        }


def test_exact_mismatch_fails_and_names_the_first_position():
    v = lossless.compare([5, 6, 9, 9], WANT, dtype="float32", key="p1", got_logprobs=WANT_LP, want_logprobs=WANT_LP)
    assert not v.ok and v.parting.position == 2
    assert (v.parting.got, v.parting.want) == (9, 7)
    assert "position 2" in v.parting.describe() and "token differs" in v.parting.why
    # in float32 even a near-tie is a failure
    rep = lossless.compare_all(["p1"], [[5, 6, 9, 9]], [WANT], dtype="float32")
    assert not rep.ok and [p.position for p in rep.failed] == [2]
    assert "1 failed" in rep.explain()


def test_exact_length_mismatch_and_prefix():
    short = lossless.compare_exact(WANT[:2], WANT, "short")
    assert not short.ok and short.parting.position == 2 and short.parting.got is None
    assert lossless.compare_exact(WANT[:2], WANT, "cut", prefix=True).ok
    assert not lossless.compare_exact([5, 9], WANT, "cut", prefix=True).ok
    assert not lossless.compare_exact(WANT + [1], WANT, "long", prefix=True).ok


def test_near_tie_parting_is_accepted_with_both_margins():
    got = [5, 6, 9, 1]
    # DFlash side: 9 leads 7 by 0.05; target side: 7 leads 9 by 0.1.
    got_lp = rows({5: -0.1}, {6: -0.2}, {9: -0.7, 7: -0.75}, {1: -0.1})
    rep = lossless.Report("bfloat16")
    v = rep.compare("p2", got, WANT, got_logprobs=got_lp, want_logprobs=WANT_LP)
    assert v.ok and not v.equal and v.compared_tokens == 2
    p = v.parting
    assert (p.position, p.got, p.want, p.accepted) == (2, 9, 7, True)
    assert p.got_margin == pytest.approx(0.05) and p.want_margin == pytest.approx(0.1)
    assert p.margin == pytest.approx(0.1)
    # the comparison stops at the parting: what follows (1 vs 8) is not judged
    assert rep.ok and rep.summary()["parted"] == 1 and rep.summary()["exact"] == 0
    assert rep.summary()["partings"] == [("p2", 2, 0.1)]


def test_clear_margin_parting_is_rejected():
    got = [5, 6, 9, 8]
    got_lp = rows({5: -0.1}, {6: -0.2}, {9: -0.1, 7: -2.5}, {8: -0.1})
    v = lossless.compare(got, WANT, dtype="bfloat16", key="p3", got_logprobs=got_lp, want_logprobs=WANT_LP)
    assert not v.ok and v.parting.margin == pytest.approx(2.4)
    assert "clear margin" in v.parting.why
    # the same parting within a wider threshold is accepted
    assert lossless.compare(got, WANT, dtype="bfloat16", got_logprobs=got_lp, want_logprobs=WANT_LP, threshold=3.0).ok
    # one side's margin is enough to fail (target clearly preferred its token)
    want_lp = rows({5: -0.1}, {6: -0.2}, {7: -0.05, 9: -3.0}, {8: -0.1})
    got_lp = rows({5: -0.1}, {6: -0.2}, {9: -0.70, 7: -0.71}, {8: -0.1})
    v = lossless.compare(got, WANT, dtype="float16", got_logprobs=got_lp, want_logprobs=want_lp)
    assert not v.ok and v.parting.want_margin == pytest.approx(2.95)


def test_token_missing_from_the_other_top_k_is_rejected():
    got = [5, 6, 9, 8]
    got_lp = rows({5: -0.1}, {6: -0.2}, {9: -0.7, 4: -0.72}, {8: -0.1})  # 7 not in got's top-k
    v = lossless.compare(got, WANT, dtype="bfloat16", got_logprobs=got_lp, want_logprobs=WANT_LP)
    assert not v.ok and "want's token 7 is not in got's top-2" in v.parting.why
    want_lp = rows({5: -0.1}, {6: -0.2}, {7: -0.65, 3: -0.7}, {8: -0.1})  # 9 not in want's
    got_lp = rows({5: -0.1}, {6: -0.2}, {9: -0.7, 7: -0.72}, {8: -0.1})
    v = lossless.compare(got, WANT, dtype="bfloat16", got_logprobs=got_lp, want_logprobs=want_lp)
    assert not v.ok and "got's token 9 is not in want's top-2" in v.parting.why
    # no logprobs at all: cannot tell a near-tie, so it fails
    assert not lossless.compare(got, WANT, dtype="bfloat16").ok


def test_near_tie_length_mismatch_without_parting_fails():
    v = lossless.compare(WANT[:3], WANT, dtype="bfloat16", got_logprobs=WANT_LP, want_logprobs=WANT_LP)
    assert not v.ok and "lengths differ" in v.parting.why


def test_logprob_rows_accepts_vllm_logprob_objects():
    lp = lambda x: SimpleNamespace(logprob=x, rank=1, decoded_token="a")  # noqa: E731
    assert lossless.logprob_rows([{7: lp(-0.5), 9: lp(-1.0)}, {1: -0.25}]) == [{7: -0.5, 9: -1.0}, {1: -0.25}]
    assert lossless.logprob_rows(None) is None


def test_unknown_dtype_is_an_error():
    with pytest.raises(ValueError, match="no lossless rule"):
        lossless.mode_for("float8")
    with pytest.raises(ValueError, match="prefix comparisons are exact only"):
        lossless.Report("bfloat16").compare("k", [1], [1], prefix=True)
