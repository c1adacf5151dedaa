"""Which test files hold the guards of each patch (tests marked needs_patch).

Recorded from the session's collection of the whole suite, so that
tests/necessity collects only those files in the subprocess that runs a
patch's guards on a build without it (collecting the whole suite there costs
more than running most patches' guards).
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
GUARD_FILES = pytest.StashKey[dict]()


def _collected_whole_suite(config: pytest.Config) -> bool:
    roots = {TESTS, TESTS.parent}
    args = [Path(a.split("::", 1)[0]) for a in config.args]
    whole = all((config.invocation_params.dir / a).resolve() in roots for a in args)
    return whole and not (config.getoption("ignore") or config.getoption("ignore_glob") or config.getoption("deselect"))


def record_guard_files(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Call before any deselection (-k, -m, --needs-patch)."""
    if not _collected_whole_suite(config):
        return
    files: dict[str, set[str]] = {}
    for item in items:
        for mark in item.iter_markers("needs_patch"):
            for number in mark.args:
                files.setdefault(number, set()).add(str(item.path))
    config.stash[GUARD_FILES] = files


def guard_files(config: pytest.Config, number: str) -> list[str] | None:
    """The files with a test marked needs_patch(number); None when this
    session did not collect the whole suite (look everywhere then)."""
    files = config.stash.get(GUARD_FILES, None)
    return None if files is None else sorted(files.get(number, ()))
