"""Writing the fork's sdist: the build inputs, with one target pinned.

An sdist's file name carries one target's version (pip requires the wheel
built from it to match), so its pyproject.toml names that target as the
one it builds (see ForkConfig.sdist_target).
"""

from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path

from .build_request import BuildRequest
from .config import ConfigError
from .metadata import PACKAGE, sdist_pkg_info

# What a wheel build from the unpacked sdist reads.
CONTENT = ("pyproject.toml", "README.md", "LICENSE", "forkbuild", "patches", "vllm")


def _pinned_pyproject(root: Path, target_name: str) -> bytes:
    text = (root / "pyproject.toml").read_text(encoding="utf-8")
    pinned, count = re.subn(
        r'(?m)^default-target = "[^"]*"$', f'default-target = "{target_name}"\nsdist-target = "{target_name}"', text
    )
    if count != 1:
        raise ConfigError("pyproject.toml: [tool.vllm-fork] needs one default-target line")
    return pinned.encode()


def _normalise(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    # Byte-for-byte the same archive from the same inputs, wherever it is built.
    if "__pycache__" in info.name or info.name.endswith(".pyc"):
        return None
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    return info


def build_sdist(request: BuildRequest, out_dir: Path) -> Path:
    root = request.config.root
    pyproject = _pinned_pyproject(root, request.target.name)
    name = f"{PACKAGE}-{request.version}"
    path = out_dir / f"{name}.tar.gz"

    def add_bytes(tar: tarfile.TarFile, arcname: str, data: bytes) -> None:
        info = _normalise(tarfile.TarInfo(f"{name}/{arcname}"))
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    with tarfile.open(path, "w:gz") as tar:
        for entry in CONTENT:
            if entry == "pyproject.toml":
                add_bytes(tar, entry, pyproject)
            elif (root / entry).exists():
                tar.add(root / entry, arcname=f"{name}/{entry}", filter=_normalise)
        add_bytes(tar, "PKG-INFO", sdist_pkg_info(request.config, request.target, request.version).encode())
    return path
