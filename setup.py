"""PEP 517 build backend of the fork (pyproject.toml: build-backend = "setup").

The wheel is not compiled: it is the pinned upstream vLLM wheel with the
patch series applied and the overlay added (see forkbuild/). Pick the base
with VLLM_TARGET_DEVICE=cuda|cpu; see README.md for offline builds.
"""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from forkbuild import assemble, config  # noqa: E402
from forkbuild.base import BaseWheelError  # noqa: E402
from forkbuild.patching import PatchError  # noqa: E402

_ERRORS = (config.ConfigError, BaseWheelError, PatchError, assemble.BuildError)


def _fail(exc: Exception):
    # pip shows this line last; keep it the one that says what to do.
    raise SystemExit(f"vllm-fork build error: {exc}")


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    try:
        cfg = config.load(ROOT)
        wheel = assemble.build_wheel(cfg, cfg.target(), Path(wheel_directory))
    except _ERRORS as exc:
        _fail(exc)
    return wheel.name


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    try:
        cfg = config.load(ROOT)
        target = cfg.target()
        version = cfg.fork_version(target, config.skipped_patches())
        text = assemble.metadata_text(cfg, target)
    except _ERRORS as exc:
        _fail(exc)
    dist_info = Path(metadata_directory) / f"vllm-{version}.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(text)
    return dist_info.name


_SDIST_CONTENT = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "forkbuild", "patches", "vllm")


def build_sdist(sdist_directory, config_settings=None):
    cfg = config.load(ROOT)
    name = f"vllm-{cfg.fork_version(cfg.target())}"
    path = Path(sdist_directory) / f"{name}.tar.gz"

    def normalise(info: tarfile.TarInfo):
        if "__pycache__" in info.name or info.name.endswith(".pyc"):
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        return info

    with tarfile.open(path, "w:gz") as tar:
        for entry in _SDIST_CONTENT:
            if (ROOT / entry).exists():
                tar.add(ROOT / entry, arcname=f"{name}/{entry}", filter=normalise)
        # Core fields only: the full METADATA needs the base wheel, which the
        # wheel build (not the sdist) fetches.
        data = f"Metadata-Version: 2.1\nName: vllm\nVersion: {cfg.fork_version(cfg.target())}\n".encode()
        info = tarfile.TarInfo(f"{name}/PKG-INFO")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path.name


if __name__ == "__main__":
    sys.exit(
        "setup.py is the PEP 517 backend of this fork; build with `pip wheel .` or "
        "`pip install .` (VLLM_TARGET_DEVICE=cuda|cpu). Direct invocation is not supported."
    )
