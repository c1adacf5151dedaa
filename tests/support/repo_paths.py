"""Where things are in this repository, for the tests and their helpers.

The one place the suite derives paths from its own location; a test that needs
the repository root, the tests directory or the helpers imports them from here.
"""

from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
REPO = TESTS.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
PATCHES = REPO / "patches"
# Code the suite shares with the benchmarks (the `vllm serve` harness, the
# Triton attention cases): on the suite's path through pyproject.toml.
TOOLS_LIB = REPO / "tools" / "lib"
