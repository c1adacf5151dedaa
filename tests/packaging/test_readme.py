"""The README's patch list is generated from patches/, so it cannot go stale."""

from __future__ import annotations

import sys

from forkrepo import REPO

sys.path.insert(0, str(REPO / "tools"))

import fork  # noqa: E402

from forkbuild import config, patching  # noqa: E402


def test_readme_patch_table_matches_the_series():
    readme = (REPO / "README.md").read_text()
    table = fork.patch_table(patching.read_series(config.load(REPO).patches_dir))
    assert fork.readme_with_table(readme, table) == readme, (
        "README.md's patch table is stale: run `python tools/fork.py patch-table --update-readme`"
    )
