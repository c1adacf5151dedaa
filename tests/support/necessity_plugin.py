"""Necessity proofs: the tests that guard each patch (a pytest plugin).

A test marked needs_patch("NNNN") guards patch NNNN of patches/series: a
build of the fork without that patch must make the test fail
(tests/necessity/test_patches_are_needed.py builds it and runs the guards
with --needs-patch NNNN in a subprocess). This plugin owns the marker, the
options that select a patch's guards, and the record of which files hold
guards (tests/support/patch_guards.py).
"""

from __future__ import annotations

import os

import patch_guards
import pytest

# VLLM_FORK_NECESSITY_WITH_EXTENDED=1: a necessity proof also runs the
# patch's guards marked `extended` (the extended CI job sets it).
NECESSITY_WITH_EXTENDED_ENV = "VLLM_FORK_NECESSITY_WITH_EXTENDED"


def pytest_addoption(parser):
    parser.addoption(
        "--needs-patch",
        metavar="NNNN",
        help="run only the tests marked needs_patch(..., NNNN, ...) (used by tests/necessity)",
    )
    parser.addoption(
        "--needs-patch-selected",
        metavar="FILE",
        help="with --needs-patch: write the selected node ids to FILE, one a line, before "
        "any test runs (tests/necessity reruns them one by one if the run crashes)",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "needs_patch(*numbers): the test guards these patches (4-digit numbers) "
        "and must fail on a build without any of them",
    )


@pytest.hookimpl(tryfirst=True)  # the guard files are recorded before -k/-m deselect
def pytest_collection_modifyitems(config, items):
    patch_guards.record_guard_files(config, items)
    number = config.getoption("--needs-patch")
    if not number:
        return
    # Guards marked `extended` (a start of their own too long for every
    # commit) join a necessity proof only in the extended CI job.
    with_extended = os.environ.get(NECESSITY_WITH_EXTENDED_ENV) == "1"
    keep, drop = [], []
    for item in items:
        numbers = {arg for mark in item.iter_markers("needs_patch") for arg in mark.args}
        extended = item.get_closest_marker("extended") is not None
        (keep if number in numbers and (with_extended or not extended) else drop).append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_collection_finish(session):
    # After every deselection (-k, -m too), before any test runs.
    if not session.config.getoption("--needs-patch"):
        return
    for item in session.items:
        # JUnit names a case by a dotted classname; the node id lets
        # tests/necessity match outcomes to the selection exactly.
        item.user_properties.append(("nodeid", item.nodeid))
    record = session.config.getoption("--needs-patch-selected")
    if record:
        with open(record, "w", encoding="utf-8") as f:
            f.writelines(f"{item.nodeid}\n" for item in session.items)
