"""The code blocks of README.md and docs/*.md, for the tests that keep them true."""

from __future__ import annotations

import re

from repo_paths import README, REPO


def documentation() -> str:
    """README.md, then every page of docs/, in one text."""
    return "\n".join(p.read_text() for p in [README, *sorted((REPO / "docs").glob("*.md"))])


def code_blocks(lang: str, readme: str | None = None) -> list[str]:
    """The bodies of the documentation's fenced blocks in ``lang`` (bash,
    python, ...); ``readme``: the blocks of that text instead."""
    text = documentation() if readme is None else readme
    return re.findall(rf"```{re.escape(lang)}\n(.*?)```", text, flags=re.S)


def commands(block: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, comments and
    blank lines left out."""
    return [
        line.strip()
        for line in block.replace("\\\n", " ").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def bash_commands(readme: str | None = None) -> list[str]:
    """Every command of every bash block."""
    return [c for block in code_blocks("bash", readme) for c in commands(block)]


def block_with(lang: str, needle: str) -> str:
    """The one block in ``lang`` that contains ``needle``."""
    found = [b for b in code_blocks(lang) if needle in b]
    if len(found) != 1:
        raise LookupError(f"README.md and docs/ have {len(found)} {lang} blocks with {needle!r}, not 1")
    return found[0]
