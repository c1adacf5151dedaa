"""The repository is lint-clean: `ruff check`, `ruff format --check` and
codespell, as configured in pyproject.toml (the same checks .pre-commit-config.yaml
runs before a commit). Each reports what to fix and the command that fixes it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from repo_paths import REPO


@pytest.mark.parametrize(
    "command, fix",
    [
        ([sys.executable, "-m", "ruff", "check", "."], "ruff check --fix ."),
        ([sys.executable, "-m", "ruff", "format", "--check", "."], "ruff format ."),
        ([sys.executable, "-m", "codespell_lib"], "codespell -w (or add the word to [tool.codespell])"),
    ],
    ids=["ruff-check", "ruff-format", "codespell"],
)
def test_repository_is_clean(command, fix):
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"{' '.join(command[2:])} failed (return code {proc.returncode}); fix with `{fix}`:\n"
        f"{proc.stdout[-6000:]}{proc.stderr[-2000:]}"
    )
