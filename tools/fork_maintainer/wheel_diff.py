"""What differs between two builds of the fork, file by file.

A refactoring of the build must not change what it builds: the same files
with the same bytes. The provenance record (patch file hashes, overlay
list) is set aside, and so is the version where the two builds' versions
differ (the dist-info directory's name, `_version.py`, METADATA's Version
line); RECORD rows are compared without those of the files normalised
here, whose hashes follow the raw bytes.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

from forkbuild.assemble import PROVENANCE_PATH, VERSION_PATH

_DIST_INFO = re.compile(r"^vllm-[^/]+\.dist-info/")


def _version(names: list[str]) -> str:
    for name in names:
        match = re.match(r"^vllm-([^/]+)\.dist-info/", name)
        if match:
            return match.group(1)
    return ""


def _normalised(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        version = _version(names).encode()
        files = {}
        for name in names:
            key = _DIST_INFO.sub("vllm.dist-info/", name)
            data = zf.read(name)
            if key == PROVENANCE_PATH:
                continue
            if key == "vllm.dist-info/RECORD":
                # Rows of the files normalised here carry hashes of the raw bytes.
                data = re.sub(rb"(?m)^vllm-[^/,]+\.dist-info/", b"vllm.dist-info/", data)
                skip = (PROVENANCE_PATH, VERSION_PATH, "vllm.dist-info/METADATA")
                data = b"\n".join(row for row in data.split(b"\n") if row.split(b",", 1)[0].decode() not in skip)
            elif key in (VERSION_PATH, "vllm.dist-info/METADATA") and version:
                local = version.partition(b"+")[2]
                data = data.replace(version, b"<fork version>").replace(local, b"<local version>")
            files[key] = data
        return files


def differences(first: Path, second: Path) -> list[str]:
    """The member names whose bytes differ or that one wheel lacks (normalised as above)."""
    a, b = _normalised(first), _normalised(second)
    out = []
    for name in sorted(set(a) | set(b)):
        if name not in a:
            out.append(f"only in {second.name}: {name}")
        elif name not in b:
            out.append(f"only in {first.name}: {name}")
        elif a[name] != b[name]:
            out.append(f"differs: {name}")
    return out
