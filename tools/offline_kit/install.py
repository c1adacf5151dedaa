"""Install the fork from an offline kit (install.sh runs this; standard library only).

Checks before it installs anything: a split kit's parts against MANIFEST.json
(each part's size and sha256, then the joined whole), every wheel against the
hash-pinned lock, the interpreter against the kit's Python, and, for a kit that
leaves torch to the system, that the venv sees that torch. Then pip installs
with --no-index --require-hashes and no pip configuration of the box's (the kit
is the only source). A venv created here is removed if any step fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path


class KitError(Exception):
    pass


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class _JoinedParts:
    """The parts read one after another as one stream, hashed on the way."""

    def __init__(self, paths: list[Path]):
        self.paths = list(paths)
        self.f = None
        self.digest = hashlib.sha256()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        while True:
            if self.f is None:
                if not self.paths:
                    return b""
                self.f = open(self.paths.pop(0), "rb")
            data = self.f.read(n if n and n > 0 else 1 << 20)
            if data:
                self.digest.update(data)
                self.size += len(data)
                return data
            self.f.close()
            self.f = None


def _extract(tar: tarfile.TarFile, dest: Path) -> None:
    if hasattr(tarfile, "data_filter"):  # refuses links and paths that leave dest
        tar.extractall(dest, filter="data")
    else:  # pragma: no cover - Pythons without extraction filters
        for member in tar:
            if (
                member.name.startswith("/")
                or ".." in Path(member.name).parts
                or not (member.isfile() or member.isdir())
            ):
                raise KitError(f"kit.tar holds {member.name!r}, which a kit never does: make the kit again")
            tar.extract(member, dest)


def join_parts(kit: Path, dest: Path) -> None:
    """Verify every part named in MANIFEST.json, then unpack their join into dest."""
    manifest = json.loads((kit / "MANIFEST.json").read_text())
    parts = manifest["parts"]
    missing = [p["name"] for p in parts + [{"name": "kit.json"}] if not (kit / p["name"]).is_file()]
    if missing:
        raise KitError(
            f"{len(missing)} of {len(parts) + 1} files are missing from {kit}: {', '.join(missing)}; "
            "copy them beside MANIFEST.json (same names) and run install.sh again"
        )
    bad = []
    for part in parts:
        path = kit / part["name"]
        size = path.stat().st_size
        if size != part["size"]:
            bad.append(f"{part['name']} ({size} bytes, expected {part['size']})")
        elif _sha256(path) != part["sha256"]:
            bad.append(f"{part['name']} (sha256 {_sha256(path)}, expected {part['sha256']})")
    if bad:
        raise KitError(f"{len(bad)} parts are corrupt: {'; '.join(bad)}; copy them again and run install.sh again")
    if _sha256(kit / "kit.json") != manifest["kit.json"]["sha256"]:
        raise KitError("kit.json differs from the one the kit was split with (MANIFEST.json): copy it again")
    stream = _JoinedParts([kit / p["name"] for p in parts])
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        _extract(tar, dest)
    while stream.read():  # tar's end padding
        pass
    if stream.digest.hexdigest() != manifest["whole"]["sha256"] or stream.size != manifest["whole"]["size"]:
        raise KitError(
            "the joined parts differ from the kit that was split (MANIFEST.json's whole sha256): make the kit again"
        )
    shutil.copy2(kit / "kit.json", dest / "kit.json")


def verify_wheels(payload: Path) -> list[str]:
    """Every wheel matches its hash in requirements.lock, and the lock names every wheel."""
    wheels = payload / "wheels"
    expected = {}
    for line in (payload / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            spec, digest = line.split(" --hash=sha256:")
            expected[digest.strip()] = spec
    actual = {_sha256(path): path.name for path in sorted(wheels.glob("*.whl"))}
    missing = [spec for digest, spec in expected.items() if digest not in actual]
    extra = [name for digest, name in actual.items() if digest not in expected]
    if missing or extra:
        raise KitError(
            "wheels/ and requirements.lock disagree"
            + (f"; no wheel with the locked hash for: {', '.join(missing)}" if missing else "")
            + (f"; not in the lock: {', '.join(extra)}" if extra else "")
            + ": make the kit again"
        )
    return list(expected.values())


def _python_version(python: str) -> str:
    out = subprocess.run(
        [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True
    )
    if out.returncode != 0:
        raise KitError(f"{python} does not run: {out.stderr.strip()}")
    return out.stdout.strip()


def _system_torch(python: str) -> str:
    out = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def install(payload: Path, venv: Path, system_site: bool) -> None:
    info = json.loads((payload / "kit.json").read_text())
    created = False
    python = venv / "bin" / "python"
    try:
        if venv.exists():
            if not python.exists():
                raise KitError(
                    f"{venv} exists but is not a virtual environment (no bin/python): name a new "
                    "directory or an existing venv"
                )
        else:
            running = "{}.{}".format(*sys.version_info[:2])
            if running != info["python"]:
                raise KitError(
                    f"this kit is for Python {info['python']}, not {running} ({sys.executable}): "
                    f"run install.sh VENV --python python{info['python']}"
                )
            cmd = [sys.executable, "-m", "venv", str(venv)]
            if system_site or info["system_torch"]:
                cmd.insert(3, "--system-site-packages")
            subprocess.run(cmd, check=True)
            created = True
        have = _python_version(str(python))
        if have != info["python"]:
            raise KitError(
                f"{venv} runs Python {have}; this kit is for Python {info['python']}: "
                f"use a venv of Python {info['python']} or make a kit with --python {have}"
            )
        if info["system_torch"]:
            torch = _system_torch(str(python))
            if torch.split("+")[0] != info["torch"]:
                raise KitError(
                    f"this kit leaves torch to the system (made with --use-system-torch) and needs torch "
                    f"{info['torch']}, but {venv} has {'torch ' + torch if torch else 'no torch'}: create the venv "
                    f"from a Python that has torch {info['torch']} (with --system-site-packages), or make a kit "
                    "without --use-system-torch"
                )
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull  # the kit is the only source, whatever the box's pip config says
        cmd = [
            str(python),
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--no-index",
            "--find-links",
            str(payload / "wheels"),
            "--require-hashes",
            "-r",
            str(payload / "requirements.lock"),
        ]
        print(f"==> installing {info['wheels']} wheels into {venv} (no index, hashes required)", file=sys.stderr)
        result = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if result.returncode != 0:
            raise KitError(f"pip could not install the kit (exit {result.returncode}):\n{result.stdout[-4000:]}")
        src = venv / "vllm-fork-src"
        if src.exists():
            shutil.rmtree(src)
        with tarfile.open(payload / "src.tar") as tar:
            _extract(tar, src)
        check = subprocess.run([str(python), "-m", "vllm.fork.info"], capture_output=True, text=True)
        if check.returncode != 0:
            raise KitError(f"installed, but `python -m vllm.fork.info` fails:\n{check.stderr[-4000:]}")
        print(check.stdout, end="")
        print(f"==> installed {info['fork_version']} into {venv}; the fork's tests and tools: {src}", file=sys.stderr)
    except BaseException:
        if created:
            shutil.rmtree(venv, ignore_errors=True)
            print(f"==> removed {venv} again (it was created by this install)", file=sys.stderr)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("venv", nargs="?", help="the virtual environment to install into (created if missing)")
    parser.add_argument("--kit", required=True)
    parser.add_argument("--system-site-packages", action="store_true")
    parser.add_argument("--check", action="store_true", help="verify the kit only")
    args = parser.parse_args(argv)
    if not args.venv and not args.check:
        parser.error("name the venv to install into: install.sh VENV (or --check to verify the kit only)")
    kit = Path(args.kit).resolve()
    try:
        with tempfile.TemporaryDirectory(prefix="vllm-fork-kit-") as tmp:
            payload = kit
            if (kit / "MANIFEST.json").exists():
                print("==> checking and joining the parts", file=sys.stderr)
                payload = Path(tmp)
                join_parts(kit, payload)
            specs = verify_wheels(payload)
            info = json.loads((payload / "kit.json").read_text())
            if args.check:
                print(
                    f"kit ok: {info['fork_version']} ({info['target']}) for Python {info['python']} on "
                    f"{info['platform']}, {len(specs)} wheels"
                    + (f", torch {info['torch']} from the system" if info["system_torch"] else "")
                )
                return 0
            install(payload, Path(args.venv).absolute(), args.system_site_packages)
    except KitError as exc:
        print(f"install.sh: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
