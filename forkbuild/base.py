"""Finding the pinned upstream wheel: local file or directory, cache, then the index.

Every route ends in the same sha256 check, so a wrong file can never reach the
build. Downloads go to a temporary file next to the cache entry and are moved
in only after they verify, so an interrupted or tampered download leaves
nothing behind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from .config import BASE_WHEEL_ENV, CACHE_DIR_ENV, OFFLINE_ENV, Target

DEFAULT_INDEX = "https://pypi.org/simple"


class BaseWheelError(Exception):
    pass


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    if environ.get(CACHE_DIR_ENV):
        return Path(environ[CACHE_DIR_ENV])
    xdg = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "vllm-fork" / "bases"


def _verify(path: Path, target: Target) -> Path:
    actual = sha256_of(path)
    if actual != target.sha256:
        raise BaseWheelError(
            f"base wheel {path} has sha256 {actual}, expected {target.sha256} "
            f"(pinned for target {target.name!r} in pyproject.toml); "
            "delete or replace the file — nothing was built or installed"
        )
    return path


def _log(message: str) -> None:
    print(f"vllm-fork: {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class BaseSource:
    """Where the pinned base may come from: a local file or directory, the
    cache, and (unless offline) the index."""

    local: str
    cache: Path
    offline: bool

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> BaseSource:
        return cls(
            local=environ.get(BASE_WHEEL_ENV, ""),
            cache=cache_dir(environ),
            offline=environ.get(OFFLINE_ENV, "") not in ("", "0"),
        )


def find_base_wheel(target: Target, source: BaseSource | None = None) -> Path:
    source = source or BaseSource.from_environ()
    if source.local:
        path = Path(source.local)
        if path.is_dir():
            path = path / target.filename
        if not path.is_file():
            raise BaseWheelError(
                f"{BASE_WHEEL_ENV}={source.local} does not hold {target.filename} "
                f"(the pinned base for target {target.name!r})"
            )
        return _verify(path, target)

    cached = source.cache / target.sha256 / target.filename
    if cached.is_file():
        return _verify(cached, target)

    if source.offline:
        raise BaseWheelError(
            f"offline build and no cached base: put {target.filename} "
            f"(sha256 {target.sha256}) in a directory and set {BASE_WHEEL_ENV} to it"
        )
    return _download(target, cached)


def _index_url() -> str:
    return (os.environ.get("PIP_INDEX_URL") or os.environ.get("UV_INDEX_URL") or DEFAULT_INDEX).rstrip("/")


def index_file_url(dist: str, filename: str) -> str:
    """URL of one release file, looked up on the simple index (PEP 691 JSON)."""
    page = f"{_index_url()}/{dist}/"
    request = urllib.request.Request(page, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            listing = json.load(response)
    except (OSError, ValueError) as exc:
        raise BaseWheelError(
            f"cannot list {page} to fetch {filename}: {exc}; for an offline build set "
            f"{BASE_WHEEL_ENV} to the wheel file or a directory holding it"
        ) from exc
    for entry in listing.get("files", []):
        if entry["filename"] == filename:
            return urllib.parse.urljoin(page, entry["url"])
    raise BaseWheelError(f"{page} does not list {filename}")


def _download(target: Target, destination: Path) -> Path:
    url = index_file_url(target.dist, target.filename)
    destination.parent.mkdir(parents=True, exist_ok=True)
    _log(f"downloading base {target.filename} ...")
    fd, partial = tempfile.mkstemp(dir=destination.parent, prefix=".partial-")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=300) as response:
            shutil.copyfileobj(response, out, 1 << 20)
        _verify(Path(partial), target)
        # mkstemp creates 0600; a cache shared by users and CI images is read by others.
        os.chmod(partial, 0o644)
        os.replace(partial, destination)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    _log(f"cached base at {destination}")
    return destination
