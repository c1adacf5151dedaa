"""The vllm/ sources of a wheel, an sdist or an unpacked tree; fetching an upstream sdist."""

from __future__ import annotations

import os
import tarfile
import urllib.request
import zipfile
from pathlib import Path

from forkbuild.base import cache_dir, index_file_url

# Compiled extension modules: binary, large, and never what a patch changes.
COMPILED_SUFFIX = ".so"


def source_files(archive_path: Path) -> dict[str, bytes]:
    """Files under vllm/ of a wheel, an sdist or a directory, compiled modules aside."""
    files: dict[str, bytes] = {}
    if archive_path.is_dir():
        for path in archive_path.rglob("*"):
            rel = path.relative_to(archive_path).as_posix()
            if (
                path.is_file()
                and rel.startswith("vllm/")
                and not rel.endswith((COMPILED_SUFFIX, ".pyc"))
                and "__pycache__" not in path.parts
            ):
                files[rel] = path.read_bytes()
    elif archive_path.suffix == ".whl":
        with zipfile.ZipFile(archive_path) as zf:
            for name in zf.namelist():
                if name.startswith("vllm/") and not name.endswith((COMPILED_SUFFIX, "/")):
                    files[name] = zf.read(name)
    else:
        with tarfile.open(archive_path) as tar:
            for member in tar.getmembers():
                rel = member.name.split("/", 1)[-1]
                if member.isfile() and rel.startswith("vllm/") and not rel.endswith(COMPILED_SUFFIX):
                    files[rel] = tar.extractfile(member).read()
    return files


def fetch_sdist(version: str) -> Path:
    """vLLM's sdist of `version` from the index, cached beside the bases."""
    filename = f"vllm-{version}.tar.gz"
    path = cache_dir().parent / "sdists" / filename
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        url = index_file_url("vllm", filename)
        with urllib.request.urlopen(url, timeout=300) as response:
            data = response.read()
        tmp = path.with_suffix(".partial")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return path
