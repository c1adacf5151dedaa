"""Builds of the fork unpacked for import, as the necessity proofs run them.

A proof builds the fork without one patch (forkbuild, as every build) and
puts the unpacked wheel ahead of the installed one. Unpacking and compiling
a whole wheel (2 255 files, 362 MB, mostly the kernel libraries) for each of
some thirty proofs costs more than the build itself; yet a build without one
patch differs from the full build in a few files only. So the full build is
unpacked and compiled once per process, and each build without a patch is
unpacked as hard links to every file it shares with it (their compiled
modules too), with only the files that differ written and compiled anew.
"""

from __future__ import annotations

import compileall
import os
import shutil
import zipfile
from pathlib import Path


def _entries(wheel: Path) -> dict[str, tuple[int, int]]:
    with zipfile.ZipFile(wheel) as zf:
        return {i.filename: (i.CRC, i.file_size) for i in zf.infolist() if not i.is_dir()}


def unpack_compiled(wheel: Path, dest: Path) -> Path:
    """The wheel unpacked into ``dest`` with its modules compiled, as an
    installer leaves it (with PYTHONDONTWRITEBYTECODE=1 in the environment,
    every process of a proof would otherwise compile vllm again on import)."""
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(dest)
    assert compileall.compile_dir(dest, quiet=1, workers=0), f"compiling {dest} failed"
    return dest


def _compiled_of(source: Path) -> list[Path]:
    """The compiled files of a Python source; none for other files (a C
    source beside a module of the same name shares its stem, not its .pyc)."""
    cache = source.parent / "__pycache__"
    if source.suffix != ".py":
        return []
    return sorted(cache.glob(source.stem + ".*.pyc")) if cache.is_dir() else []


def _link(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # a file system without hard links (or across two): a copy
        shutil.copy2(source, target)


def unpack_next_to(wheel: Path, full_wheel: Path, full_tree: Path, dest: Path) -> Path:
    """``wheel`` unpacked into ``dest``: hard links into ``full_tree`` (the
    unpacked, compiled ``full_wheel``) for each file with the same content,
    the other files extracted and compiled. Nothing is ever written through a
    link, so the full tree stays as it was."""
    shared = _entries(full_wheel)
    changed = []
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if info.is_dir():
                continue
            target = dest / info.filename
            target.parent.mkdir(parents=True, exist_ok=True)
            if shared.get(info.filename) == (info.CRC, info.file_size):
                _link(full_tree / info.filename, target)
                for compiled in _compiled_of(full_tree / info.filename):
                    (target.parent / "__pycache__").mkdir(exist_ok=True)
                    _link(compiled, target.parent / "__pycache__" / compiled.name)
            else:
                zf.extract(info, dest)
                changed.append(target)
    for path in changed:
        if path.suffix == ".py":
            assert compileall.compile_file(path, quiet=1), f"compiling {path} failed"
    return dest
