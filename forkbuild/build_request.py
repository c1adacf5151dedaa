"""What one build is asked for, resolved once: target, patches left out, base source, version.

pyproject.toml and the environment (VLLM_TARGET_DEVICE, VLLM_FORK_SKIP_PATCHES,
VLLM_FORK_BASE_WHEEL, VLLM_FORK_CACHE_DIR, VLLM_FORK_OFFLINE) are read here and
nowhere else in the build; everything downstream takes a BuildRequest.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

from . import config, patching
from .base import BaseSource


@dataclasses.dataclass(frozen=True)
class BuildRequest:
    config: config.ForkConfig
    target: config.Target
    series: tuple[patching.Patch, ...]
    # The patches asked to be left out plus those whose Depends-On names one.
    left_out: tuple[str, ...]
    base: BaseSource
    version: str

    @property
    def kept_patches(self) -> list[patching.Patch]:
        return [p for p in self.series if p.number not in self.left_out]


def _numbers(raw: str) -> tuple[str, ...]:
    return tuple(sorted(part.strip() for part in raw.replace(",", " ").split() if part.strip()))


def resolve(
    root: Path | None = None,
    target_name: str | None = None,
    environ: Mapping[str, str] = os.environ,
    *,
    honour_skips: bool = True,
) -> BuildRequest:
    """The build of `target_name` (else VLLM_TARGET_DEVICE, else the default target).

    `honour_skips=False` ignores VLLM_FORK_SKIP_PATCHES (an sdist is always
    of the whole series).
    """
    cfg = config.load(root)
    target = cfg.target(target_name, environ)
    series = tuple(patching.read_series(cfg.patches_dir))
    asked = _numbers(environ.get(config.SKIP_PATCHES_ENV, "")) if honour_skips else ()
    left_out = patching.left_out_patches(list(series), asked)
    return BuildRequest(
        config=cfg,
        target=target,
        series=series,
        left_out=left_out,
        base=BaseSource.from_environ(environ),
        version=cfg.fork_version(target, left_out),
    )
