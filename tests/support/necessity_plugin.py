"""Necessity proofs: the tests that guard each patch (a pytest plugin).

A test marked needs_patch("NNNN") guards patch NNNN of patches/series: a
build of the fork without that patch must make the test fail
(tests/necessity/test_patches_are_needed.py builds it and runs the guards
with --needs-patch NNNN in a subprocess). This plugin owns the marker, the
options that select a patch's guards, and the marks of each proof, read from
its guards (tests/support/patch_guards.py): no patch number is listed by hand.
"""

from __future__ import annotations

import patch_guards
import pytest

WITH_EXTENDED_OPTION = "--necessity-with-extended"


def proof_marks(number: str) -> list:
    """The marks of patch ``number``'s necessity proof: ``extended_guards``
    when some of its guards are marked extended (the extended CI job proves
    those), ``no_avx512_pass`` when a guard says
    ``needs_patch(..., no_avx512_pass=True)``."""
    marks = []
    if patch_guards.has_extended_guards(number):
        marks.append(pytest.mark.extended_guards)
    if patch_guards.proven_without_avx512(number):
        marks.append(pytest.mark.no_avx512_pass)
    return marks


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
    parser.addoption(
        WITH_EXTENDED_OPTION,
        action="store_true",
        help="with --needs-patch: the patch's guards marked `extended` run too; in a necessity "
        "proof: its subprocess gets this option (the extended CI job: -m extended_guards with it)",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "needs_patch(*numbers): the test guards these patches (4-digit numbers) "
        "and must fail on a build without any of them; no_avx512_pass=True: the proof also "
        "runs as on a CPU without AVX-512/AMX",
    )
    config.addinivalue_line(
        "markers",
        "extended_guards: the necessity proof of a patch with guards marked extended "
        "(run with --necessity-with-extended in the extended CI job)",
    )


def pytest_collection_modifyitems(config, items):
    number = config.getoption("--needs-patch")
    if not number:
        return
    # Guards marked `extended` (a start of their own too long for every
    # commit) join a necessity proof only in the extended CI job.
    with_extended = config.getoption(WITH_EXTENDED_OPTION)
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
