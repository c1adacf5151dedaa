"""Suite-wide pytest configuration."""

import sys
from pathlib import Path

# Helper modules shared by several test directories and benchmarks/
# (dflash_e2e, vllm_server): importable by their plain names.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

# The tiny model pairs, as session fixtures for every directory.
pytest_plugins = ["tiny_pair_fixtures"]


def pytest_configure(config):
    # A test marked needs_patch("NNNN") guards patch NNNN of patches/series: a
    # build of the fork without that patch must make the test fail.
    config.addinivalue_line(
        "markers",
        "needs_patch(*numbers): the test guards these patches (4-digit numbers) "
        "and must fail on a build without any of them",
    )


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


def pytest_collection_modifyitems(config, items):
    number = config.getoption("--needs-patch")
    if not number:
        return
    keep, drop = [], []
    for item in items:
        numbers = {arg for mark in item.iter_markers("needs_patch") for arg in mark.args}
        (keep if number in numbers else drop).append(item)
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
