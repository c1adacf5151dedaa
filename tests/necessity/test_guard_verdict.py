"""The necessity harness's rules (guard_verdict.py) on fake runs: no build, no vllm."""

from __future__ import annotations

import re
import shutil
import signal
import textwrap
from pathlib import Path

from guard_verdict import (
    CRASHED,
    FAILED,
    PASSED,
    SKIPPED,
    Run,
    classify,
    guards_to_rerun,
    read_junit,
    run_guards,
    verdict,
)
from repo_paths import TESTS

PATCH, NUMBER = "0006-cpu-attn-mask.patch", "0006"
A = "tests/kernels/test_k.py::test_a[x]"
B = "tests/kernels/test_k.py::test_b"
C = "tests/kernels/test_k.py::test_c"
SIGILL = -int(signal.SIGILL)


def _judge(selected, run, outcomes, reruns=None):
    guards = classify(selected, run, outcomes, reruns)
    return verdict(PATCH, NUMBER, run, guards, selected_known=selected is not None)


def test_normal_failing_run_needs_no_rerun_and_proves():
    run = Run(1, "1 failed, 1 skipped", "")
    outcomes = {A: FAILED, B: SKIPPED}
    assert guards_to_rerun(run, outcomes, [A, B]) == []
    v = _judge([A, B], run, outcomes)
    assert v.ok
    assert "rc=1" in v.message and "1 failed, 1 skipped" in v.message


def test_a_passing_guard_breaks_the_proof():
    run = Run(1, "", "")
    v = _judge([A, B], run, {A: FAILED, B: PASSED})
    assert not v.ok
    assert "did not fail" in v.message and B in v.message and "rc=1" in v.message


def test_no_guard():
    run = Run(5, "no tests ran", "")
    assert guards_to_rerun(run, {}, []) == []
    v = _judge([], run, {})
    assert not v.ok
    assert "no test here guards" in v.message and "needs_patch('0006')" in v.message
    assert "rc=5" in v.message and "no tests ran" in v.message


def test_only_skips_prove_nothing():
    v = _judge([A], Run(0, "", ""), {A: SKIPPED})
    assert not v.ok and "no test here guards" in v.message


def test_crashed_run_reruns_each_guard_and_a_crash_is_no_proof():
    run = Run(SIGILL, "tests/kernels/test_k.py ", "Fatal Python error: Illegal instruction")
    assert run.signal_name == "SIGILL" and run.died
    # The process died: no JUnit at all, so every selected guard is rerun.
    assert guards_to_rerun(run, {}, [A, B, C]) == [A, B, C]
    reruns = {
        A: (Run(SIGILL, "", "Illegal instruction in cpu_attention_with_kv_cache"), {}),
        B: (Run(1, "1 failed", ""), {B: FAILED}),
        C: (Run(0, "1 passed", ""), {C: PASSED}),
    }
    guards = {g.nodeid: g.outcome for g in classify([A, B, C], run, {}, reruns)}
    assert guards == {A: CRASHED, B: FAILED, C: PASSED}
    v = _judge([A, B, C], run, {}, reruns)
    assert not v.ok and C in v.message  # a pass still breaks the proof

    reruns[C] = (Run(1, "1 failed", ""), {C: FAILED})
    v = _judge([A, B, C], run, {}, reruns)
    assert v.ok  # failures prove it; the crash is reported, not counted
    assert "killed by SIGILL" in v.message and "cpu_attention_with_kv_cache" in v.message
    assert f"crashed guard {A}" in v.message


def test_every_guard_crashed_fails_with_the_report():
    run = Run(SIGILL, "", "Fatal Python error: Illegal instruction")
    reruns = {A: (Run(SIGILL, "", "boom A"), {}), B: (Run(-int(signal.SIGSEGV), "", "boom B"), {})}
    v = _judge([A, B], run, {}, reruns)
    assert not v.ok
    assert "a crash is no proof" in v.message
    assert "SIGILL" in v.message and "SIGSEGV" in v.message
    assert "boom A" in v.message and "boom B" in v.message
    assert "Fatal Python error" in v.message  # the patch's run's stderr tail too


def test_incomplete_junit_reruns_only_the_missing_guards():
    # Exit code 2 (interrupted): what was reported stands, the rest is rerun.
    run = Run(2, "", "")
    assert guards_to_rerun(run, {A: FAILED}, [A, B]) == [B]
    # A finished run that still misses a selected guard is not trusted either.
    assert guards_to_rerun(Run(1), {A: FAILED}, [A, B]) == [B]


def test_run_that_died_before_collection():
    run = Run(SIGILL, "", "died importing")
    assert guards_to_rerun(run, {}, None) == []
    v = _judge(None, run, {})
    assert not v.ok and "before its guards were collected" in v.message and "SIGILL" in v.message


def test_timeout_is_a_crash():
    run = Run(None, "", "", timeout_s=1800)
    assert run.died
    guards = classify([A], run, {}, {A: (Run(None, timeout_s=1800), {})})
    assert [g.outcome for g in guards] == [CRASHED]
    assert "timed out after 1800s" in verdict(PATCH, NUMBER, run, guards).message


def test_read_junit_prefers_the_nodeid_property(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        "<testsuites><testsuite>"
        '<testcase classname="tests.kernels.test_k" name="test_a[x]">'
        f'<properties><property name="nodeid" value="{A}"/></properties><failure message="m"/></testcase>'
        '<testcase classname="tests.kernels.test_k" name="test_b"><skipped/></testcase>'
        '<testcase classname="tests.kernels.test_k" name="test_c"/>'
        "</testsuite></testsuites>"
    )
    assert read_junit(junit) == {
        A: FAILED,
        "tests.kernels.test_k::test_b": SKIPPED,
        "tests.kernels.test_k::test_c": PASSED,
    }
    assert read_junit(tmp_path / "missing.xml") == {}
    (tmp_path / "cut.xml").write_text("<testsuites><testsuite><testcase")
    assert read_junit(tmp_path / "cut.xml") == {}


def _synthetic_tree(tmp_path: Path, body: str) -> Path:
    """A test tree with the suite's own conftest.py (its needs_patch selection) and one module."""
    root = tmp_path / "proj"
    (root / "tests" / "support").mkdir(parents=True)
    (root / "pytest.ini").write_text("[pytest]\npythonpath = tests/support\n")
    shutil.copy(TESTS / "conftest.py", root / "tests" / "conftest.py")
    (root / "tests" / "support" / "tiny_pair_fixtures.py").write_text("")
    # The plugins tests/conftest.py lists, and what they import.
    for module in (
        "parallel_workers",
        "no_avx512_pass",
        "necessity_plugin",
        "measured_figures",
        "patch_guards",
        "repo_paths",
    ):
        shutil.copy(TESTS / "support" / f"{module}.py", root / "tests" / "support" / f"{module}.py")
    (root / "tests" / "test_guards.py").write_text(textwrap.dedent(body))
    (tmp_path / "work").mkdir()
    return root


CRASHING_MODULE = """
    import os, signal, sys
    import pytest

    @pytest.mark.needs_patch("0042")
    def test_fails():
        assert 1 == 2

    @pytest.mark.needs_patch("0042")
    def test_crashes():
        os.kill(os.getpid(), signal.SIGILL)

    @pytest.mark.needs_patch("0042")
    def test_skips():
        pytest.skip("cannot run here")

    def test_unrelated():
        pass
"""


def test_run_guards_reruns_each_guard_after_a_real_crash(tmp_path):
    root = _synthetic_tree(tmp_path, CRASHING_MODULE)
    run, outcomes, selected, reruns = run_guards(
        [str(root / "tests")], root, "0042", tmp_path / "work", None, timeout_s=120
    )
    assert run.signal_name == "SIGILL", run.tails()
    names = [
        "tests/test_guards.py::test_fails",
        "tests/test_guards.py::test_crashes",
        "tests/test_guards.py::test_skips",
    ]
    assert selected == names
    assert sorted(reruns) == sorted(n for n in names if n not in outcomes)
    guards = classify(selected, run, outcomes, reruns)
    assert {g.nodeid: g.outcome for g in guards} == dict(zip(names, [FAILED, CRASHED, SKIPPED]))
    v = verdict("0042-x.patch", "0042", run, guards)
    assert v.ok, v.message  # test_fails proves it; the crash is reported, not counted
    # The crashed guard by name, its signal, and faulthandler's stack of the test that died.
    assert f"crashed guard {names[1]}: its process rc=-4 (killed by SIGILL)" in v.message
    assert "Fatal Python error: Illegal instruction" in v.message
    assert re.search(r'test_guards.py", line \d+ in test_crashes', v.message)


def test_run_guards_all_crashed_fails(tmp_path):
    root = _synthetic_tree(
        tmp_path, CRASHING_MODULE.replace('"0042")\n    def test_fails', '"0043")\n    def test_fails')
    )
    run, outcomes, selected, reruns = run_guards(
        [str(root / "tests")], root, "0042", tmp_path / "work", None, timeout_s=120
    )
    v = verdict("0042-x.patch", "0042", run, classify(selected, run, outcomes, reruns))
    assert not v.ok and "a crash is no proof" in v.message and "SIGILL" in v.message


def test_run_guards_normal_path_is_one_process(tmp_path):
    root = _synthetic_tree(tmp_path, CRASHING_MODULE.replace("os.kill(os.getpid(), signal.SIGILL)", "assert False"))
    run, outcomes, selected, reruns = run_guards(
        [str(root / "tests")], root, "0042", tmp_path / "work", None, timeout_s=120
    )
    assert run.returncode == 1 and reruns == {}
    assert outcomes == {
        "tests/test_guards.py::test_fails": FAILED,
        "tests/test_guards.py::test_crashes": FAILED,
        "tests/test_guards.py::test_skips": SKIPPED,
    }
    v = verdict("0042-x.patch", "0042", run, classify(selected, run, outcomes, reruns))
    assert v.ok and "rc=1" in v.message


EXTENDED_GUARD_MODULE = """
    import pytest

    @pytest.mark.needs_patch("0042")
    def test_every_commit():
        assert False

    @pytest.mark.extended
    @pytest.mark.needs_patch("0042")
    def test_extended():
        assert False
"""


def test_extended_guards_join_a_proof_only_when_asked(tmp_path):
    root = _synthetic_tree(tmp_path, EXTENDED_GUARD_MODULE)
    every_commit = "tests/test_guards.py::test_every_commit"
    _run, outcomes, selected, _ = run_guards([str(root / "tests")], root, "0042", tmp_path / "work", None)
    assert selected == [every_commit] and outcomes == {every_commit: FAILED}
    (tmp_path / "work2").mkdir()
    _run, outcomes, selected, _ = run_guards(
        [str(root / "tests")], root, "0042", tmp_path / "work2", None, ("--necessity-with-extended",)
    )
    assert selected == [every_commit, "tests/test_guards.py::test_extended"]
    assert set(outcomes.values()) == {FAILED}
