"""The series as a git work tree (unpack) and back (export).

`unpack` writes what the build produces, through the build's own strict
applier: a first commit (tag `base`) holds the pinned base's sources, the
fork's own package vllm/fork/ and the files the build generates
(_version.py, _fork_provenance.json); each patch is then one commit, with
its author, date and message as `git am` would record them. The tree's
vllm/ is therefore the wheel's vllm/, compiled modules aside. `export`
writes the commits after `base` back as patches/ (the fork's own package
excluded) and copies vllm/fork/ back to the repository, so an unpacked,
unchanged tree exports to the same bytes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from forkbuild import assemble, patching
from forkbuild.base import find_base_wheel
from forkbuild.build_request import BuildRequest

from .sources import source_files

IDENTITY = {
    "GIT_AUTHOR_NAME": "vLLM DFlash-FP8 fork",
    "GIT_AUTHOR_EMAIL": "dflash-fp8-fork@users.noreply.github.com",
    "GIT_COMMITTER_NAME": "vLLM DFlash-FP8 fork",
    "GIT_COMMITTER_EMAIL": "dflash-fp8-fork@users.noreply.github.com",
}
# Pinned so the exported files do not depend on the maintainer's git config.
FORMAT_PATCH = [
    "-c",
    "diff.algorithm=myers",
    "-c",
    "diff.renames=false",
    "-c",
    "format.signature=",
    "format-patch",
    "--zero-commit",
    "--no-signature",
    "--full-index",
    "--no-color",
    "--no-renames",
    "--no-numbered",
]
BASE_DATE = "2026-01-01T00:00:00Z"
# What the tree holds that is not the base's and not a patch's.
FORK_OWN = assemble.OVERLAY_PACKAGE.rstrip("/")
GENERATED = (assemble.VERSION_PATH, assemble.PROVENANCE_PATH)


class WorkTreeError(Exception):
    pass


def _git(tree: Path, *args: str, env: dict | None = None, input: bytes | None = None) -> bytes:
    full_env = {**os.environ, **IDENTITY, "GIT_CONFIG_NOSYSTEM": "1", **(env or {})}
    return subprocess.run(
        ["git", "-C", str(tree), *args], check=True, capture_output=True, env=full_env, input=input
    ).stdout


def _write(tree: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(data)


def _commit_as_git_am_would(tree: Path, patch: patching.Patch, scratch: Path) -> None:
    """Commit the work tree with the patch's author, date and message.

    `git mailinfo` is the parser `git am` uses; only the applying is ours.
    """
    message, diff = scratch / "message", scratch / "diff"
    info = _git(tree, "mailinfo", "-b", "--encoding=UTF-8", str(message), str(diff), input=patch.raw)
    fields = dict(line.split(": ", 1) for line in info.decode().splitlines() if ": " in line)
    body = message.read_bytes().strip(b"\n")
    text = fields["Subject"].encode() + (b"\n\n" + body if body else b"") + b"\n"
    env = {
        "GIT_AUTHOR_NAME": fields["Author"],
        "GIT_AUTHOR_EMAIL": fields["Email"],
        "GIT_AUTHOR_DATE": fields["Date"],
        "GIT_COMMITTER_DATE": fields["Date"],
    }
    _git(tree, "add", "-A")
    _git(tree, "commit", "-q", "--allow-empty", "--cleanup=verbatim", "-F", "-", env=env, input=text)


def unpack(request: BuildRequest, dest: Path) -> int:
    """The fork as a git work tree at `dest`; returns the number of patch commits."""
    if dest.exists() and any(dest.iterdir()):
        raise WorkTreeError(f"{dest} exists and is not empty; pick a new directory")
    base_wheel = find_base_wheel(request.target, request.base)
    base = source_files(base_wheel)
    overlay = assemble.overlay_files(request.config)
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        built = {
            **base,
            **overlay,
            assemble.VERSION_PATH: assemble.version_module(request.version),
            assemble.PROVENANCE_PATH: assemble.provenance(request, overlay),
        }
        _write(partial, built)
        _git(partial, "init", "-q")
        _git(partial, "config", "core.autocrlf", "false")
        _git(partial, "add", "-A")
        stamp = {"GIT_AUTHOR_DATE": BASE_DATE, "GIT_COMMITTER_DATE": BASE_DATE}
        _git(
            partial,
            "commit",
            "-qm",
            f"{request.target.filename} (base)\n\nPlus the fork's own package {FORK_OWN}/ and the "
            f"files the build generates ({', '.join(GENERATED)}).",
            env=stamp,
        )
        _git(partial, "tag", "base")
        files = dict(base)
        with tempfile.TemporaryDirectory() as scratch:
            for patch in request.kept_patches:
                changed = patching.apply_patch(patch, files)
                files.update(changed)
                _write(partial, changed)
                _commit_as_git_am_would(partial, patch, Path(scratch))
        if dest.exists():
            dest.rmdir()
        os.replace(partial, dest)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return len(request.kept_patches)


def export(tree: Path, patches_dir: Path, overlay_dir: Path) -> int:
    """Commits after `base` -> patches_dir (+ series); the tree's vllm/fork/ -> overlay_dir/fork/."""
    excluded = [f":(exclude){FORK_OWN}"] + [f":(exclude){path}" for path in GENERATED]
    with tempfile.TemporaryDirectory() as tmp:
        _git(tree, *FORMAT_PATCH, "-o", tmp, "base..HEAD", "--", ".", *excluded)
        produced = sorted(Path(tmp).glob("*.patch"))
        for old in patches_dir.glob("*.patch"):
            old.unlink()
        for path in produced:
            (patches_dir / path.name).write_bytes(path.read_bytes())
    (patches_dir / "series").write_text("".join(f"{p.name}\n" for p in produced))
    own = tree / FORK_OWN
    target = overlay_dir / "fork"
    if own.is_dir():
        staged = Path(tempfile.mkdtemp(prefix=".fork.partial-", dir=overlay_dir))
        try:
            shutil.copytree(own, staged / "fork", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            if target.exists():
                shutil.rmtree(target)
            os.replace(staged / "fork", target)
        finally:
            shutil.rmtree(staged, ignore_errors=True)
    return len(produced)
