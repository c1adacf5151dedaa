"""Where code lives: the suite's paths in one module, benchmarks apart from the tests."""

from __future__ import annotations

import re

from repo_paths import REPO, SUPPORT, TESTS

# A file that finds the repository from its own location.
OWN_LOCATION = re.compile(r"Path\(__file__\)[^\n]*\.(parents?\b|parent\.parent)|dirname\(__file__\)")


def test_the_suite_takes_repository_paths_from_one_module():
    offenders = [
        p.relative_to(REPO).as_posix()
        for p in sorted(TESTS.rglob("*.py"))
        if p != SUPPORT / "repo_paths.py" and OWN_LOCATION.search(p.read_text(encoding="utf-8"))
    ]
    assert offenders == [], f"use tests/support/repo_paths.py in {offenders}"


def test_benchmarks_import_no_test_internals():
    """Code both run lives in tools/lib; a benchmark never reaches into tests/."""
    offenders = [
        p.relative_to(REPO).as_posix()
        for p in sorted((REPO / "benchmarks").rglob("*.py"))
        # A path into tests/ put on sys.path or built from parts; a command
        # line in a docstring that names one is not an import.
        if re.search(r"""sys\.path.*tests|["']tests["']""", p.read_text(encoding="utf-8"))
    ]
    assert offenders == [], offenders
