"""Fixtures for the build tests; the helpers live in forkrepo.py."""

from __future__ import annotations

import re
import shutil

import pytest
from forkrepo import ForkRepo, fork_config, make_base_wheel
from repo_paths import REPO


@pytest.fixture
def fork_repo(tmp_path, monkeypatch) -> ForkRepo:
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(REPO / "README.md", root / "README.md")
    # The synthetic fork starts at release 1 whatever the real one is now.
    pyproject = re.sub(r"(?m)^release = \d+$", "release = 1", (REPO / "pyproject.toml").read_text())
    (root / "pyproject.toml").write_text(pyproject)
    for entry in ("forkbuild", "tools"):
        shutil.copytree(REPO / entry, root / entry, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "patches").mkdir()
    (root / "patches" / "series").write_text("")
    (root / "vllm").mkdir()
    bases = tmp_path / "bases"
    bases.mkdir()
    repo = ForkRepo(root, bases)
    for name, target in repo.config().targets.items():
        repo.pin(name, make_base_wheel(bases, target))
    monkeypatch.setenv(fork_config.BASE_WHEEL_ENV, str(bases))
    monkeypatch.setenv(fork_config.CACHE_DIR_ENV, str(tmp_path / "cache"))
    for var in (fork_config.TARGET_ENV, fork_config.SKIP_PATCHES_ENV, fork_config.OFFLINE_ENV):
        monkeypatch.delenv(var, raising=False)
    return repo
