"""PEP 517 build backend of the fork (pyproject.toml: build-backend = "setup").

The wheel is not compiled: it is the pinned upstream vLLM wheel with the
patch series applied and the overlay added (see forkbuild/). Pick the base
with VLLM_TARGET_DEVICE=cuda|cpu; see README.md for offline builds.
"""

from __future__ import annotations

import io
import re
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from forkbuild import assemble, build_request, config  # noqa: E402
from forkbuild.base import BaseWheelError  # noqa: E402
from forkbuild.patching import PatchError  # noqa: E402

_ERRORS = (config.ConfigError, BaseWheelError, PatchError, assemble.BuildError)


def _fail(exc: Exception):
    # pip shows this line last; keep it the one that says what to do.
    raise SystemExit(f"vllm-fork build error: {exc}")


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    try:
        wheel = assemble.build_wheel(build_request.resolve(ROOT), Path(wheel_directory))
    except _ERRORS as exc:
        _fail(exc)
    return wheel.name


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


_SDIST_CONTENT = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "forkbuild", "patches", "vllm")


def _pkg_info(cfg, version: str) -> bytes:
    """Core metadata of the sdist (Requires-Dist comes from the base wheel,
    which only the wheel build fetches: declared dynamic)."""
    lines = ["Metadata-Version: 2.2", "Name: vllm", f"Version: {version}"]
    if cfg.summary:
        lines.append(f"Summary: {cfg.summary}")
    lines.append(f"Project-URL: Upstream, {assemble.UPSTREAM_URL}")
    if cfg.requires_python:
        lines.append(f"Requires-Python: {cfg.requires_python}")
    lines += ["Dynamic: Requires-Dist", "Description-Content-Type: text/markdown"]
    readme = ROOT / "README.md"
    body = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    return ("\n".join(lines) + "\n\n" + body).encode()


def _sdist_pyproject(target_name: str) -> bytes:
    """pyproject.toml with the sdist's target pinned (see ForkConfig.sdist_target)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    pinned, count = re.subn(
        r'(?m)^default-target = "[^"]*"$', f'default-target = "{target_name}"\nsdist-target = "{target_name}"', text
    )
    if count != 1:
        raise config.ConfigError("pyproject.toml: [tool.vllm-fork] needs one default-target line")
    return pinned.encode()


def build_sdist(sdist_directory, config_settings=None):
    """An sdist for the target VLLM_TARGET_DEVICE names (default: cuda): its
    name carries that target's version, so it builds that target only."""
    try:
        build = build_request.resolve(ROOT, honour_skips=False)
        cfg, version = build.config, build.version
        pyproject = _sdist_pyproject(build.target.name)
    except _ERRORS as exc:
        _fail(exc)
    name = f"vllm-{version}"
    path = Path(sdist_directory) / f"{name}.tar.gz"

    def normalise(info: tarfile.TarInfo):
        if "__pycache__" in info.name or info.name.endswith(".pyc"):
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        return info

    def add_bytes(tar, arcname: str, data: bytes) -> None:
        info = normalise(tarfile.TarInfo(f"{name}/{arcname}"))
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    with tarfile.open(path, "w:gz") as tar:
        for entry in _SDIST_CONTENT:
            if entry == "pyproject.toml":
                add_bytes(tar, entry, pyproject)
            elif (ROOT / entry).exists():
                tar.add(ROOT / entry, arcname=f"{name}/{entry}", filter=normalise)
        add_bytes(tar, "PKG-INFO", _pkg_info(cfg, version))
    return path.name


if __name__ == "__main__":
    sys.exit(
        "setup.py is the PEP 517 backend of this fork; build with `pip wheel .` or "
        "`pip install .` (VLLM_TARGET_DEVICE=cuda|cpu). Direct invocation is not supported."
    )
