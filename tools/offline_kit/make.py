"""Make an offline install kit of the fork (tools/make_offline_kit.sh runs this).

Runs on the interpreter the kit is for, in a venv with pip >= 24 and packaging:
pip resolves the fork wheel (and any extra requirement files) as it would
install them here (`pip install --dry-run --report`), downloads exactly the
resolved files by their sha256, and the kit records them in a hash-pinned lock
that tools/offline_kit/install.py installs with `--no-index --require-hashes`.

Kit layout (what install.sh reads):
    install.sh, install_kit.py   the installer (never split)
    kit.json                     what the kit is for: target, Python, fork version, torch
    requirements.lock            name==version --hash=sha256:... for every wheel
    wheels/                      the fork wheel and its dependencies
    src.tar                      the checkout's tracked files (tests/, tools/, ...)
Split (--split SIZE): everything but the installer and kit.json goes into one
tar, cut into parts/kit.tar.NNN, and MANIFEST.json lists each part's size and
sha256, the whole tar's and kit.json's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

HERE = Path(__file__).resolve().parent
KIT_FORMAT = 1
INSTALLER_FILES = {"install.sh": HERE / "install.sh", "install_kit.py": HERE / "install.py"}
PART_PREFIX = "kit.tar."
# Stays beside the parts of a split kit, so what a kit is for reads without joining it.
KIT_INFO = "kit.json"
# What --use-system-torch leaves to the box's own installation.
SYSTEM_TORCH_PACKAGES = ("torch",)


class KitError(Exception):
    pass


def parse_size(text: str) -> int:
    """'60M' -> 60 MiB; K, M, G are powers of 1024, a bare number is bytes."""
    match = re.fullmatch(r"(\d+)([KMG]?)(i?B)?", text.strip(), re.IGNORECASE)
    if not match or int(match.group(1)) == 0:
        raise KitError(f"--split {text!r}: give a size such as 60M, 1G or 500000000")
    return int(match.group(1)) * 1024 ** " KMG".index((match.group(2) or " ").upper())


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _pip(python: str, *args: str, env: dict | None = None) -> None:
    cmd = [python, "-m", "pip", "--disable-pip-version-check", *args]
    result = subprocess.run(
        cmd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if result.returncode != 0:
        raise KitError(f"{' '.join(cmd)} failed (exit {result.returncode}):\n{result.stdout[-4000:]}")


def build_fork_wheel(root: Path, target: str, wheels: Path) -> Path:
    _pip(sys.executable, "wheel", "-q", "--no-deps", "-w", str(wheels), str(root), env={"VLLM_TARGET_DEVICE": target})
    built = sorted(wheels.glob("vllm-*.whl"))
    if len(built) != 1:
        raise KitError(f"expected one fork wheel in {wheels}, found {[p.name for p in built]}")
    return built[0]


def resolve(fork_wheel: Path, requirement_files: list[Path], report: Path) -> list[dict]:
    """What pip would install here for the fork wheel and the files: one report entry each."""
    args = ["install", "-q", "--dry-run", "--ignore-installed", "--report", str(report), str(fork_wheel)]
    for req in requirement_files:
        args += ["-r", str(req)]
    _pip(sys.executable, *args)
    return json.loads(report.read_text())["install"]


def _needs(item: dict, extras: frozenset[str]) -> list[tuple[str, frozenset[str]]]:
    """The (name, extras) that `item` requires here with `extras` asked of it."""
    needed = []
    for text in item["metadata"].get("requires_dist") or []:
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras | {""}):
            needed.append((canonicalize_name(req.name), frozenset(req.extras)))
    return needed


def without_system_packages(items: list[dict], system: tuple[str, ...]) -> tuple[list[dict], list[str]]:
    """Drop `system` and what only they pull in: a walk from the requested packages that
    does not enter them. Returns the kept items and the names left out."""
    by_name = {canonicalize_name(item["metadata"]["name"]): item for item in items}
    skip = {canonicalize_name(name) for name in system}
    queue = [
        (name, frozenset(item.get("requested_extras") or ())) for name, item in by_name.items() if item.get("requested")
    ]
    seen, kept = set(), set()
    while queue:
        name, extras = queue.pop()
        if name in skip or (name, extras) in seen or name not in by_name:
            continue
        seen.add((name, extras))
        kept.add(name)
        queue.extend(_needs(by_name[name], extras))
    return [by_name[n] for n in by_name if n in kept], sorted(n for n in by_name if n not in kept)


def _file_name(item: dict) -> str:
    return item["download_info"]["url"].rsplit("/", 1)[-1].split("#", 1)[0].replace("%2B", "+")


def download(items: list[dict], fork_wheel: Path, wheels: Path) -> None:
    """Every resolved file into `wheels`, each checked against the sha256 pip resolved."""
    not_wheels = [_file_name(i) for i in items if not _file_name(i).endswith(".whl")]
    if not_wheels:
        raise KitError(
            "these resolve to source archives, which the box would have to build: "
            + ", ".join(not_wheels)
            + "; pin versions that publish wheels with --with-requirements"
        )
    pinned = wheels.parent / "download.txt"
    pinned.write_text(
        "".join(
            f"{i['metadata']['name']}=={i['metadata']['version']} --hash=sha256:{i['download_info']['archive_info']['hashes']['sha256']}\n"
            for i in items
            if Path(_file_name(i)).name != fork_wheel.name
        )
    )
    _pip(
        sys.executable,
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--require-hashes",
        "-d",
        str(wheels),
        "-r",
        str(pinned),
    )
    pinned.unlink()
    expected = {_file_name(i): i["download_info"]["archive_info"]["hashes"]["sha256"] for i in items}
    present = {p.name for p in wheels.iterdir()}
    if present != set(expected):
        raise KitError(
            f"downloaded files differ from the resolution: missing {sorted(set(expected) - present)}, "
            f"unexpected {sorted(present - set(expected))}"
        )
    for name, digest in expected.items():
        if sha256_of(wheels / name) != digest:
            raise KitError(f"{name}: sha256 differs from the one pip resolved ({digest})")


def write_lock(wheels: Path, lock: Path) -> list[str]:
    """requirements.lock: name==version --hash for every wheel in the kit."""
    lines = []
    for path in sorted(wheels.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(path.name)
        lines.append(f"{name}=={version} --hash=sha256:{sha256_of(path)}")
    lock.write_text(
        "# Hash-pinned: pip install --no-index --find-links wheels --require-hashes -r requirements.lock\n"
        + "\n".join(lines)
        + "\n"
    )
    return lines


def write_source_tar(root: Path, out: Path) -> int:
    """The checkout's tracked files as they are on disk (uncommitted edits included)."""
    try:
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise KitError(f"{root} is not a git checkout ({exc}): the kit carries the checkout's tracked files") from exc
    names = [n for n in listed.decode().split("\0") if n and (root / n).is_file()]
    with tarfile.open(out, "w") as tar:
        for name in names:
            tar.add(root / name, arcname=name, recursive=False)
    return len(names)


def split_payload(kit: Path, part_size: int) -> dict:
    """Move everything but the installer into parts/kit.tar.NNN of at most part_size bytes."""
    payload = sorted(p.name for p in kit.iterdir() if p.name not in INSTALLER_FILES and p.name != KIT_INFO)
    parts_dir = kit / "parts"
    parts_dir.mkdir()
    whole = hashlib.sha256()
    parts: list[dict] = []

    class _PartWriter:
        """A file object that cuts what is written to it into numbered parts."""

        def __init__(self):
            self.f = None
            self.digest = None
            self.left = 0

        def _next(self):
            self.close_part()
            path = parts_dir / f"{PART_PREFIX}{len(parts):03d}"
            self.f, self.digest, self.left = open(path, "wb"), hashlib.sha256(), part_size
            parts.append({"name": f"parts/{path.name}", "size": 0, "sha256": ""})

        def write(self, data: bytes) -> int:
            view = memoryview(data)
            while view:
                if self.f is None or self.left == 0:
                    self._next()
                chunk = view[: self.left]
                self.f.write(chunk)
                self.digest.update(chunk)
                whole.update(chunk)
                self.left -= len(chunk)
                parts[-1]["size"] += len(chunk)
                view = view[len(chunk) :]
            return len(data)

        def close_part(self):
            if self.f is not None:
                self.f.close()
                parts[-1]["sha256"] = self.digest.hexdigest()
                self.f = None

    writer = _PartWriter()
    with tarfile.open(fileobj=writer, mode="w|") as tar:
        for name in payload:
            tar.add(kit / name, arcname=name)
    writer.close_part()
    for name in payload:
        path = kit / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    manifest = {
        "format": KIT_FORMAT,
        "part_size": part_size,
        "parts": parts,
        KIT_INFO: {"sha256": sha256_of(kit / KIT_INFO)},
        "whole": {"name": "kit.tar", "size": sum(p["size"] for p in parts), "sha256": whole.hexdigest()},
    }
    (kit / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def make(args: argparse.Namespace) -> None:
    kit = Path(args.kit)
    wheels = kit / "wheels"
    wheels.mkdir(parents=True)
    print(f"==> building the fork's {args.target} wheel", file=sys.stderr)
    fork_wheel = build_fork_wheel(Path(args.root), args.target, wheels)
    print("==> resolving its dependencies for this interpreter and platform", file=sys.stderr)
    items = resolve(fork_wheel, [Path(r) for r in args.with_requirements], kit / "report.json")
    (kit / "report.json").unlink()
    versions = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in items}
    left_out: list[str] = []
    if args.use_system_torch:
        items, left_out = without_system_packages(items, SYSTEM_TORCH_PACKAGES)
    print(
        f"==> downloading {len(items) - 1} wheels"
        + (f" (left to the box's torch: {', '.join(left_out)})" if left_out else ""),
        file=sys.stderr,
    )
    download(items, fork_wheel, wheels)
    lock = write_lock(wheels, kit / "requirements.lock")
    src_files = write_source_tar(Path(args.root), kit / "src.tar")
    info = {
        "format": KIT_FORMAT,
        "target": args.target,
        "fork_version": str(parse_wheel_filename(fork_wheel.name)[1]),
        "fork_wheel": fork_wheel.name,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "platform": f"{platform.system().lower()}_{platform.machine()}",
        "torch": versions.get("torch", ""),
        "system_torch": bool(args.use_system_torch),
        "left_to_the_system": left_out,
        "wheels": len(lock),
        "src_files": src_files,
    }
    (kit / "kit.json").write_text(json.dumps(info, indent=1) + "\n")
    for name, source in INSTALLER_FILES.items():
        shutil.copy2(source, kit / name)
    os.chmod(kit / "install.sh", 0o755)
    if args.split:
        manifest = split_payload(kit, parse_size(args.split))
        print(f"==> split into {len(manifest['parts'])} parts of at most {args.split}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kit", required=True, help="the directory to fill (made; must not exist)")
    parser.add_argument("--root", default=str(HERE.parents[1]), help="the fork checkout")
    parser.add_argument("--target", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--use-system-torch", action="store_true")
    parser.add_argument("--with-requirements", action="append", default=[])
    parser.add_argument("--split", default="")
    args = parser.parse_args(argv)
    try:
        if args.split:
            parse_size(args.split)
        make(args)
    except KitError as exc:
        print(f"make_offline_kit: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
