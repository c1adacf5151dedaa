"""Fixtures for the CUDA suite; helpers in tests/support/gpu_e2e.py.

The CUDA modules skip themselves at import when torch sees no CUDA device;
this file must stay importable without one (the support-table unit tests run
everywhere). At the end of a session that ran CUDA cases, the per-case
outcomes and measurements are printed as one table and, when
VLLM_FORK_GPU_REPORT_DIR is set, written to gpu_matrix.json there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gpu_e2e
import offline_engine
import pytest

_outcomes: dict[str, dict[str, str]] = {}
_measured: dict = {}


@pytest.fixture(scope="session")
def measurements():
    return _measured


@pytest.fixture(scope="session")
def matrix(partial_pair, full_pair, measurements):
    m = gpu_e2e.Matrix(partial_pair, full_pair, measurements)
    yield m
    offline_engine.shutdown_llm()


def pytest_runtest_logreport(report):
    """Keep each CUDA case's outcome per test: ``{case id: {test: outcome}}``."""
    case = getattr(report, "gpu_case", None)
    if case is None:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        if hasattr(report, "wasxfail"):
            outcome = "xfail" if report.skipped else "xpass"
        else:
            outcome = report.outcome
        _outcomes.setdefault(case, {})[report.gpu_test] = outcome


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "case" in callspec.params:
        report.gpu_case = item.callspec.id
        report.gpu_test = item.originalname


def pytest_terminal_summary(terminalreporter):
    if not _outcomes and not _measured:
        return
    tests = sorted({t for row in _outcomes.values() for t in row})
    lines = ["", "[gpu] outcome per case (rows) and test (columns):"]
    lines.append("[gpu] " + f"{'case':<28}" + "".join(f"{t[5:29]:>26}" for t in tests))
    for case in sorted(_outcomes):
        lines.append("[gpu] " + f"{case:<28}" + "".join(f"{_outcomes[case].get(t, '-'):>26}" for t in tests))
    lines.append("[gpu] measured:")
    lines += [f"[gpu]   {k}: {v}" for k, v in sorted(_measured.items(), key=lambda kv: str(kv[0]))]
    for line in lines:
        terminalreporter.write_line(line)
    report_dir = os.environ.get(gpu_e2e.REPORT_DIR_ENV)
    if report_dir:
        Path(report_dir).mkdir(parents=True, exist_ok=True)
        (Path(report_dir) / "gpu_matrix.json").write_text(
            json.dumps(
                {"outcomes": _outcomes, "measured": {str(k): v for k, v in _measured.items()}}, indent=2, default=str
            )
        )
