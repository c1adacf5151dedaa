"""Proof of necessity: for every patch, a build without it fails the tests that guard it.

Each case builds the fork minus one patch from the cached base, unpacks it (hard
links to the files it shares with the full build: tests/support/unpacked_builds.py),
puts it ahead of the installed wheel on PYTHONPATH, and runs the tests marked
needs_patch(N) in one pytest subprocess. None of them may pass and at least one
must fail (a guard that cannot run on this machine, like tests/gpu without CUDA,
skips); a patch no test guards fails here too, so nobody can drop a fix (or add
one) without a test noticing.

A crash is a result, not a proof. If that subprocess dies (killed by a signal,
an exit code other than pytest's finished ones, or a JUnit file that misses
some selected guard), each guard without an outcome is rerun in its own pytest
subprocess, so one crash cannot hide the others, and every guard ends up
passed, failed, skipped or crashed (its own process died from a signal, or
gave no JUnit outcome). A guard that CRASHES on the build without the patch
does NOT count as proof: a crash can come from something unrelated to the
patch (a CPU-feature fault such as SIGILL from an instruction the process was
not allowed to use). The proof needs at least one guard that fails by
assertion or error, and no guard may pass; crashed guards are reported by
name with their signal and stderr tail, and if every guard crashed the case
fails with that report. Every report (assertion message and printed output)
names the subprocess's return code, the signal if one killed it, and the tails
of its stdout and stderr. When nothing crashes, a patch costs one subprocess,
as before. The rules themselves are in guard_verdict.py (unit-tested without a
build in test_guard_verdict.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import patch_guards
import pytest
import unpacked_builds
from guard_verdict import classify, run_guards, verdict
from necessity_plugin import WITH_EXTENDED_OPTION, proof_marks
from repo_paths import REPO

from forkbuild import assemble, build_request, config, patching

CFG = config.load(REPO)
SERIES = patching.read_series(CFG.patches_dir)


@pytest.fixture(scope="session")
def full_build(tmp_path_factory) -> tuple[Path, Path]:
    """The whole series built once per process, unpacked and compiled: the
    builds without one patch share its unchanged files."""
    root = tmp_path_factory.mktemp("full-build")
    wheel = assemble.build_wheel(build_request.resolve(REPO, "cpu"), root / "wheel")
    return wheel, unpacked_builds.unpack_compiled(wheel, root / "site")


@pytest.mark.slow
@pytest.mark.parametrize("patch", [pytest.param(p, id=p.number, marks=proof_marks(p.number)) for p in SERIES])
def test_build_without_patch_fails_its_tests(patch, full_build, tmp_path, monkeypatch, request):
    monkeypatch.setenv(config.SKIP_PATCHES_ENV, patch.number)
    wheel = assemble.build_wheel(build_request.resolve(REPO, "cpu"), tmp_path / "wheel")
    unpacked = unpacked_builds.unpack_next_to(wheel, *full_build, tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(unpacked), os.environ.get("PYTHONPATH")]))}
    env.pop(config.SKIP_PATCHES_ENV)

    # CUDA-only tests skip on the CPU build this harness makes (a module skip
    # would count as "did not fail"); a GPU necessity run is
    # `pytest tests/gpu --needs-patch N` against a CUDA build without N.
    excluded = (REPO / "tests" / "necessity", REPO / "tests" / "gpu")
    paths = [f for f in patch_guards.guard_files(patch.number) if not any(Path(f).is_relative_to(d) for d in excluded)]
    if not paths:  # no guard: the whole suite, so that the verdict says so
        paths = [str(REPO / "tests")] + [arg for d in excluded for arg in ("--ignore", str(d))]
    extra = (WITH_EXTENDED_OPTION,) if request.config.getoption(WITH_EXTENDED_OPTION) else ()
    run, outcomes, selected, reruns = run_guards(paths, REPO, patch.number, tmp_path, env, extra)
    guards = classify(selected, run, outcomes, reruns)
    result = verdict(patch.name, patch.number, run, guards, selected_known=selected is not None)
    print(result.message)
    assert result.ok, result.message
