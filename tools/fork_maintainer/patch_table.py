"""The README's patch list, generated from the series (tests/packaging/test_readme.py keeps it in sync)."""

from __future__ import annotations

from forkbuild import patching

README_START = "<!-- patch-table:"
README_END = "<!-- /patch-table -->"


def patch_table(patches: list[patching.Patch]) -> str:
    rows = ["| # | patch | origin | upstream |", "|---|---|---|---|"]
    for patch in patches:
        origin = patch.fields.get("Origin", "").replace("|", "\\|")
        rows.append(f"| {patch.number} | {patch.subject} | {origin} | {patch.fields.get('Applied-Upstream', '')} |")
    return "\n".join(rows) + "\n"


def readme_with_table(readme: str, table: str) -> str:
    head, _, rest = readme.partition(README_START)
    marker, _, rest = rest.partition("\n")
    _, _, tail = rest.partition(README_END)
    return f"{head}{README_START}{marker}\n{table}{README_END}{tail}"
