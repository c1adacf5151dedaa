"""docs/settings.md is the one list of the fork's environment variables: the
code reads no VLLM_FORK_* name the table lacks, and the table lists none
that nothing reads."""

from __future__ import annotations

import re

from repo_paths import REPO

NAME = re.compile(r"\bVLLM_FORK_[A-Z0-9_]*[A-Z0-9]\b")
SOURCES = ("forkbuild", "tools", "tests", "benchmarks", "vllm", ".github", ".ci")
# Names the scripts refuse, saying which option replaced them.
REFUSED = {"VLLM_FORK_REINSTALL", "VLLM_FORK_INSTALL_CHECK", "VLLM_FORK_TARGET"}


def _names_in_code() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for top in SOURCES:
        for path in (REPO / top).rglob("*"):
            if not path.is_file() or path.suffix not in (".py", ".sh", ".yml", "") or "__pycache__" in path.parts:
                continue
            if path.name == "test_settings_table.py":
                continue
            for name in set(NAME.findall(path.read_text(errors="replace"))):
                found.setdefault(name, []).append(str(path.relative_to(REPO)))
    return found


def _names_in_table() -> set[str]:
    rows = [line for line in (REPO / "docs" / "settings.md").read_text().splitlines() if line.startswith("| `")]
    return {name for row in rows for name in NAME.findall(row.split("|")[1])}


def test_every_variable_the_code_reads_is_in_the_table():
    missing = {name: files for name, files in _names_in_code().items() if name not in _names_in_table() | REFUSED}
    assert not missing, f"add these to docs/settings.md (name, default, meaning): {missing}"


def test_the_table_lists_only_variables_something_reads():
    stale = _names_in_table() - set(_names_in_code())
    assert not stale, f"docs/settings.md lists variables nothing reads: {sorted(stale)}"
