"""PEP 517 build backend of the fork (pyproject.toml: build-backend = "forkbuild.backend").

Hooks only. The wheel is not compiled: it is the pinned upstream vLLM
wheel with the patch series applied and the overlay added (assemble.py);
the sdist carries those inputs (sdist.py). VLLM_TARGET_DEVICE=cuda|cpu
picks the base; build_request.py reads every other build setting.
"""

from __future__ import annotations

from pathlib import Path

from . import assemble, build_request, config, sdist
from .base import BaseWheelError
from .metadata import MetadataError
from .patching import PatchError

ROOT = Path(__file__).resolve().parent.parent

_ERRORS = (config.ConfigError, BaseWheelError, PatchError, MetadataError, assemble.BuildError)


def _fail(exc: Exception):
    # pip shows this line last; keep it the one that says what to do.
    raise SystemExit(f"vllm-fork build error: {exc}") from None


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    try:
        return assemble.build_wheel(build_request.resolve(ROOT), Path(wheel_directory)).name
    except _ERRORS as exc:
        _fail(exc)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    try:
        build = build_request.resolve(ROOT)
        text = assemble.metadata_text(build)
    except _ERRORS as exc:
        _fail(exc)
    dist_info = Path(metadata_directory) / f"vllm-{build.version}.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(text)
    return dist_info.name


def build_sdist(sdist_directory, config_settings=None):
    """An sdist of the target VLLM_TARGET_DEVICE names (default: the
    configured default target), of the whole series whatever is skipped."""
    try:
        return sdist.build_sdist(build_request.resolve(ROOT, honour_skips=False), Path(sdist_directory)).name
    except _ERRORS as exc:
        _fail(exc)
