"""patches/release.lock: the release number stands for exactly this content of patches/ and vllm/."""

from __future__ import annotations

import hashlib
from pathlib import Path

from forkbuild import config

LOCK_FILE = "patches/release.lock"


class LockError(Exception):
    pass


def content_digest(cfg: config.ForkConfig) -> str:
    """Hash of everything that changes the built wheel besides the base."""
    digest = hashlib.sha256()
    paths = sorted(p for p in cfg.patches_dir.iterdir() if p.name != Path(LOCK_FILE).name)
    paths += sorted(p for p in cfg.overlay_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for path in paths:
        if path.is_file():
            digest.update(path.relative_to(cfg.root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def read_lock(cfg: config.ForkConfig) -> dict[str, str]:
    path = cfg.root / LOCK_FILE
    if not path.is_file():
        return {}
    return dict(line.split(" = ", 1) for line in path.read_text().splitlines() if " = " in line)


def lock(cfg: config.ForkConfig) -> str:
    """Write the lock for the current release; refuse changed content under a locked number."""
    current, digest = read_lock(cfg), content_digest(cfg)
    if current.get("content") == digest and current.get("release") == str(cfg.release):
        return f"{LOCK_FILE} is current (release {cfg.release})"
    if current and current.get("content") != digest and current.get("release") == str(cfg.release):
        raise LockError(
            f"patches/ or vllm/ changed since release {cfg.release} was locked: bump "
            "[tool.vllm-fork].release in pyproject.toml, then run `tools/fork.py lock` again"
        )
    (cfg.root / LOCK_FILE).write_text(
        "# Written by tools/fork.py lock: the release number below stands for exactly this\n"
        "# content of patches/ and vllm/. Change either -> bump the release.\n"
        f"release = {cfg.release}\ncontent = {digest}\n"
    )
    return f"locked release {cfg.release}: {digest[:16]}"
