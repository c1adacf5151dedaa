"""The fork's core metadata: the wheel's METADATA and the sdist's PKG-INFO.

Both carry the same fork fields (name, version, summary, where it comes
from, Requires-Python, the README as description); the wheel's also
carries the base wheel's dependencies, which only a wheel build fetches,
so the sdist declares them dynamic.
"""

from __future__ import annotations

from .config import ForkConfig, Target

PACKAGE = "vllm"
UPSTREAM_URL = "https://github.com/vllm-project/vllm"

# Fields of the base's METADATA that name its publisher, not this fork.
_PUBLISHER_FIELDS = {
    "Author",
    "Author-email",
    "Maintainer",
    "Maintainer-email",
    "Home-page",
    "Project-URL",
    "Download-URL",
    "Summary",
    "Requires-Python",
    "Description-Content-Type",
}


class MetadataError(Exception):
    pass


def _fork_fields(config: ForkConfig, target: Target) -> list[str]:
    """The fields that follow Version, in the order both files carry them."""
    lines = [f"Summary: {config.summary}"] if config.summary else []
    lines.append(f"Project-URL: Upstream, {UPSTREAM_URL}")
    lines.append(f"Project-URL: Base wheel, https://pypi.org/project/{target.dist}/{target.version}/")
    if config.requires_python:
        lines.append(f"Requires-Python: {config.requires_python}")
    for extra, requirements in config.optional_dependencies:
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {req}; extra == "{extra}"' for req in requirements]
    return lines


def _with_description(lines: list[str], config: ForkConfig) -> str:
    readme = config.root / "README.md"
    body = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    if body:
        lines = [*lines, "Description-Content-Type: text/markdown"]
    return "\n".join(lines) + "\n\n" + body


def wheel_metadata(base_metadata: str, config: ForkConfig, target: Target, version: str) -> str:
    """The base's METADATA as this fork's: the fork fields in place of the
    base publisher's names and URLs, the base's dependencies (rewritten
    where the target says so) and the fork's own extras."""
    headers, _, _ = base_metadata.partition("\n\n")
    unused = dict(target.requires_dist_rewrite)
    lines = []
    for line in headers.split("\n"):
        key, _, value = line.partition(": ")
        if key in _PUBLISHER_FIELDS:
            continue
        if key == "Name":
            line = f"Name: {PACKAGE}"
        elif key == "Version":
            line = f"Version: {version}"
        elif key == "Requires-Dist":
            requirement, semi, marker = value.partition(";")
            replacement = dict(target.requires_dist_rewrite).get(requirement.strip())
            if replacement is not None:
                unused.pop(requirement.strip(), None)
                line = f"Requires-Dist: {replacement}" + (f";{marker}" if semi else "")
        lines.append(line)
        if key == "Version":
            lines.extend(_fork_fields(config, target))
    base_extras = {line.partition(": ")[2] for line in headers.split("\n") if line.startswith("Provides-Extra: ")}
    clashing = sorted(base_extras & {extra for extra, _ in config.optional_dependencies})
    if clashing:
        raise MetadataError(
            f"target {target.name!r}: the base already provides the extras {clashing}; "
            "[project.optional-dependencies] may only add new ones"
        )
    if unused:
        raise MetadataError(
            f"target {target.name!r}: requires-dist-rewrite rules matched nothing in the base "
            f"METADATA: {sorted(unused)} (has the base changed?)"
        )
    return _with_description(lines, config)


def sdist_pkg_info(config: ForkConfig, target: Target, version: str) -> str:
    """PKG-INFO of the sdist of `target` (its dependencies declared dynamic)."""
    lines = ["Metadata-Version: 2.2", f"Name: {PACKAGE}", f"Version: {version}"]
    lines += _fork_fields(config, target)
    lines.append("Dynamic: Requires-Dist")
    return _with_description(lines, config)
