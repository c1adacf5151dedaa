"""The files of a GitHub release of the fork, so users can pin a wheel URL.

    python tools/ci/release_assets.py --tag TAG OUT [--kit-python 3.12]
                                   [--notes FILE --download-url URL]

For every target (cuda, cpu): the sdist and the wheel built from it by
`python -m build` (the frontend users run; no isolation: the backend needs
only the standard library), and, with --kit-python, the manifest of that
target's offline kit for that Python (kit.json and the hash-pinned
requirements.lock of tools/make_offline_kit.sh; the kit's wheels are
gigabytes, too large for release files). SHA256SUMS covers every file, in
the format `sha256sum -c` reads. The tag must be the one this checkout's
release number gives (.github/workflows/release.yml runs this on a pushed
tag): a wrong tag stops before anything is built. OUT must be new or empty;
on failure it is removed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from forkbuild import config as fork_config  # noqa: E402
from forkbuild.base import sha256_of  # noqa: E402


class ReleaseError(Exception):
    pass


def release_tag(cfg: fork_config.ForkConfig) -> str:
    """v<base version>-<prefix>.<release>: the version without its target's
    local part ('+' does not belong in a tag or a download URL)."""
    versions = sorted({target.version for target in cfg.targets.values()})
    if len(versions) != 1:
        raise ReleaseError(f"the targets are of different base versions {versions}: one release tag cannot name them")
    return f"v{versions[0]}-{cfg.version_prefix}.{cfg.release}"


def _run(command: list[str], env: dict[str, str] | None = None) -> None:
    result = subprocess.run(command, cwd=ROOT, env={**os.environ, **(env or {})})
    if result.returncode != 0:
        raise ReleaseError(f"{' '.join(command)} failed with exit status {result.returncode} (its output is above)")


def build_target(target: str, out: Path) -> list[Path]:
    """The sdist of `target` and the wheel built from it."""
    before = set(out.iterdir())
    _run(
        # Without --sdist/--wheel, build makes the sdist and the wheel from it.
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), "."],
        env={fork_config.TARGET_ENV: target},
    )
    return sorted(set(out.iterdir()) - before)


def kit_manifest(target: str, python: str, out: Path, work: Path) -> list[Path]:
    """kit.json and requirements.lock of `target`'s offline kit for `python`."""
    kit = work / f"kit-{target}"
    _run(["bash", "tools/make_offline_kit.sh", "--python", python, "--target", target, str(kit)])
    stem = f"offline-kit-{target}-py{python}"
    made = [out / f"{stem}.json", out / f"{stem}.requirements.lock"]
    shutil.copy2(kit / "kit.json", made[0])
    shutil.copy2(kit / "requirements.lock", made[1])
    shutil.rmtree(kit)
    return made


def write_sums(out: Path) -> Path:
    files = sorted(p for p in out.iterdir() if p.is_file() and p.name != "SHA256SUMS")
    sums = out / "SHA256SUMS"
    sums.write_text("".join(f"{sha256_of(p)}  {p.name}\n" for p in files))
    return sums


def notes(cfg: fork_config.ForkConfig, files: list[Path], download_url: str) -> str:
    """Release notes: the pinnable install command of each wheel.

    `download_url` is where the release's files are served, e.g.
    https://github.com/OWNER/REPO/releases/download/TAG.
    """
    lines = [f"Release {cfg.release} of the fork. Install a wheel by its URL (its version names its target):", ""]
    for path in files:
        if path.suffix == ".whl":
            lines.append(f"    pip install '{download_url.rstrip('/')}/{urllib.parse.quote(path.name)}'")
    lines += ["", "Every file's sha256 is in SHA256SUMS (`sha256sum -c SHA256SUMS`)."]
    return "\n".join(lines) + "\n"


def make(tag: str, out: Path, kit_python: str | None = None, notes_to: tuple[Path, str] | None = None) -> list[Path]:
    """Every release file in `out`; `notes_to` = (file, download URL) also writes the notes."""
    cfg = fork_config.load(ROOT)
    expected = release_tag(cfg)
    if tag != expected:
        raise ReleaseError(
            f"tag {tag!r} does not name this checkout's release: pyproject.toml gives {expected!r} "
            f"(bump [tool.vllm-fork] release and tag that commit {expected})"
        )
    if out.exists() and any(out.iterdir()):
        raise ReleaseError(f"{out} already exists and is not empty: remove it or name a new directory")
    out.mkdir(parents=True, exist_ok=True)
    try:
        files: list[Path] = []
        with tempfile.TemporaryDirectory() as work:
            for target in sorted(cfg.targets):
                files += build_target(target, out)
                if kit_python:
                    files += kit_manifest(target, kit_python, out, Path(work))
        files.append(write_sums(out))
        if notes_to:
            notes_to[0].write_text(notes(cfg, files, notes_to[1]))
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the directory for the release files (new or empty)")
    parser.add_argument("--tag", required=True, help="the pushed tag; must be v<base>-<prefix>.<release>")
    parser.add_argument("--kit-python", help="also the offline kits' manifests for this Python (e.g. 3.12)")
    parser.add_argument("--notes", type=Path, help="write the release notes to this file")
    parser.add_argument("--download-url", help="with --notes: where the release's files are served")
    args = parser.parse_args(argv)
    if bool(args.notes) != bool(args.download_url):
        parser.error("--notes and --download-url go together")
    try:
        notes_to = (args.notes, args.download_url) if args.notes else None
        files = make(args.tag, args.out.resolve(), args.kit_python, notes_to)
    except ReleaseError as exc:
        print(f"release_assets.py: {exc}", file=sys.stderr)
        return 2
    for path in files:
        print(path.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
