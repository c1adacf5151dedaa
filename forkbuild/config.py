"""The fork's build settings: `[tool.vllm-fork]` in pyproject.toml plus the environment."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

TARGET_ENV = "VLLM_TARGET_DEVICE"
BASE_WHEEL_ENV = "VLLM_FORK_BASE_WHEEL"
CACHE_DIR_ENV = "VLLM_FORK_CACHE_DIR"
OFFLINE_ENV = "VLLM_FORK_OFFLINE"
SKIP_PATCHES_ENV = "VLLM_FORK_SKIP_PATCHES"


class ConfigError(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    dist: str
    version: str
    filename: str
    sha256: str
    local_version: str
    requires_dist_rewrite: tuple[tuple[str, str], ...]

    @property
    def wheel_tag(self) -> str:
        # name-version[-build]-python-abi-platform.whl
        return "-".join(self.filename[: -len(".whl")].split("-")[-3:])


@dataclasses.dataclass(frozen=True)
class ForkConfig:
    root: Path
    release: int
    version_prefix: str
    default_target: str
    targets: dict[str, Target]
    # [project] fields this fork states itself (the base's are a third party's).
    summary: str = ""
    requires_python: str = ""
    # [project.optional-dependencies]: what `vllm[extra]` adds to either target.
    optional_dependencies: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # Set in an sdist's pyproject.toml: the one target that sdist builds (its
    # file name carries that target's version, and pip insists they agree).
    sdist_target: str = ""

    @property
    def patches_dir(self) -> Path:
        return self.root / "patches"

    @property
    def overlay_dir(self) -> Path:
        return self.root / "vllm"

    def target(self, name: str | None = None, environ: Mapping[str, str] = os.environ) -> Target:
        """`name`, else VLLM_TARGET_DEVICE, else the default target."""
        origin = "given" if name else f"from {TARGET_ENV}" if environ.get(TARGET_ENV) else "the default"
        name = name or environ.get(TARGET_ENV) or self.default_target
        if self.sdist_target and name != self.sdist_target:
            other = self.targets.get(name)
            raise ConfigError(
                f"this sdist builds the {self.sdist_target!r} target "
                f"(vllm {self.fork_version(self.targets[self.sdist_target])}), not {name!r} "
                f"({origin}); use the {name!r} sdist"
                + (
                    f" (vllm {self.fork_version(other)}, made with {TARGET_ENV}={name} python -m build --sdist)"
                    if other
                    else ""
                )
                + ", a checkout, or the git URL"
            )
        if name not in self.targets:
            raise ConfigError(
                f"unknown build target {name!r} ({origin}); valid targets: {', '.join(sorted(self.targets))}"
            )
        return self.targets[name]

    def fork_version(self, target: Target, skipped: tuple[str, ...] = ()) -> str:
        """The one formula of the fork's version; a build gets it from its BuildRequest."""
        local = [part for part in (target.local_version,) if part]
        local += [self.version_prefix, str(self.release)]
        if skipped:
            local += ["without"] + list(skipped)
        return f"{target.version}+{'.'.join(local)}"


def load(root: Path | None = None) -> ForkConfig:
    root = (root or Path(__file__).resolve().parent.parent).resolve()
    with open(root / "pyproject.toml", "rb") as f:
        pyproject = tomllib.load(f)
    table = pyproject["tool"]["vllm-fork"]
    project = pyproject.get("project", {})
    targets = {
        name: Target(
            name=name,
            dist=spec["dist"],
            version=spec["version"],
            filename=spec["filename"],
            sha256=spec["sha256"].lower(),
            local_version=spec.get("local-version", ""),
            requires_dist_rewrite=tuple(tuple(pair) for pair in spec.get("requires-dist-rewrite", [])),
        )
        for name, spec in table["targets"].items()
    }
    return ForkConfig(
        root=root,
        release=int(table["release"]),
        version_prefix=table["version-prefix"],
        default_target=table["default-target"],
        targets=targets,
        summary=project.get("description", ""),
        requires_python=project.get("requires-python", ""),
        optional_dependencies=tuple(
            (extra, tuple(reqs)) for extra, reqs in project.get("optional-dependencies", {}).items()
        ),
        sdist_target=table.get("sdist-target", ""),
    )
