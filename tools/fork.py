#!/usr/bin/env python3
"""Maintainer tooling for the patch series.

    tools/fork.py unpack  DIR [--target cpu]   base wheel -> git work tree, one commit per patch
    tools/fork.py export  DIR [--to patches]   commits since tag `base` -> patches/ + series
    tools/fork.py check   --against 0.22.0     per patch: applies / already in upstream / conflicts
    tools/fork.py lock                         record the content hash for this release

Typical rebase onto another vLLM release: `check --against X.Y.Z`, then
`unpack` a tree of the new base, `git am`/edit the patches there, `export`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from forkbuild import config, patching  # noqa: E402
from forkbuild.base import BaseWheelError, cache_dir, find_base_wheel, index_file_url  # noqa: E402

IDENTITY = {
    "GIT_AUTHOR_NAME": "vLLM DFlash-FP8 fork",
    "GIT_AUTHOR_EMAIL": "dflash-fp8-fork@users.noreply.github.com",
    "GIT_COMMITTER_NAME": "vLLM DFlash-FP8 fork",
    "GIT_COMMITTER_EMAIL": "dflash-fp8-fork@users.noreply.github.com",
}
# Pinned so the exported files do not depend on the maintainer's git config.
FORMAT_PATCH = [
    "-c", "diff.algorithm=myers", "-c", "diff.renames=false", "-c", "format.signature=",
    "format-patch", "--zero-commit", "--no-signature", "--full-index", "--no-color",
    "--no-renames", "--no-numbered",
]
LOCK_FILE = "patches/release.lock"


def _git(tree: Path, *args: str, env: dict | None = None, input: bytes | None = None) -> bytes:
    full_env = {**os.environ, **IDENTITY, "GIT_CONFIG_NOSYSTEM": "1", **(env or {})}
    return subprocess.run(
        ["git", "-C", str(tree), *args], check=True, capture_output=True, env=full_env, input=input
    ).stdout


def source_files(archive_path: Path) -> dict[str, bytes]:
    """Text sources under vllm/ of a wheel, an sdist or an unpacked tree."""
    files: dict[str, bytes] = {}
    if archive_path.is_dir():
        for path in archive_path.rglob("*"):
            rel = path.relative_to(archive_path).as_posix()
            if path.is_file() and rel.startswith("vllm/") and not rel.endswith((".so", ".pyc")):
                files[rel] = path.read_bytes()
    elif archive_path.suffix == ".whl":
        with zipfile.ZipFile(archive_path) as zf:
            for name in zf.namelist():
                if name.startswith("vllm/") and not name.endswith((".so", "/")):
                    files[name] = zf.read(name)
    else:
        with tarfile.open(archive_path) as tar:
            for member in tar.getmembers():
                rel = member.name.split("/", 1)[-1]
                if member.isfile() and rel.startswith("vllm/") and not rel.endswith(".so"):
                    files[rel] = tar.extractfile(member).read()
    return files


def cmd_unpack(args) -> None:
    cfg = config.load(ROOT)
    target = cfg.target(args.target)
    dest = Path(args.dir)
    if dest.exists() and any(dest.iterdir()):
        sys.exit(f"{dest} exists and is not empty; pick a new directory")
    files = source_files(find_base_wheel(target))
    dest.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_bytes(data)
    stamp = {"GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}
    _git(dest, "init", "-q")
    _git(dest, "config", "core.autocrlf", "false")
    _git(dest, "add", "-A")
    _git(dest, "commit", "-qm", f"{target.filename} (base)", env=stamp)
    _git(dest, "tag", "base")
    for patch in patching.read_series(cfg.patches_dir):
        _git(dest, "am", "-q", "--keep-cr", "--keep-non-patch", "--committer-date-is-author-date", input=patch.raw)
    print(f"{dest}: base {target.filename} + {len(patching.read_series(cfg.patches_dir))} patches as commits")


def cmd_export(args) -> None:
    tree = Path(args.dir)
    out = Path(args.to) if args.to else ROOT / "patches"
    with tempfile.TemporaryDirectory() as tmp:
        _git(tree, *FORMAT_PATCH, "-o", tmp, "base..HEAD")
        produced = sorted(Path(tmp).glob("*.patch"))
        for old in out.glob("*.patch"):
            old.unlink()
        for path in produced:
            (out / path.name).write_bytes(path.read_bytes())
    (out / "series").write_text("".join(f"{p.name}\n" for p in produced))
    print(f"exported {len(produced)} patches to {out}")


def _fetch_sdist(version: str) -> Path:
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


def check_series(
    patches: list[patching.Patch], files: dict[str, bytes], base: dict[str, bytes] | None = None
) -> list[tuple[str, str]]:
    """Status of each patch against `files`, applying the ones that apply.

    `base` (the pinned base's files) lets a restyled upstream version of a
    patch's Python change count as already in upstream.
    """
    report = []
    files = dict(files)
    base = dict(base) if base is not None else None
    for patch in patches:
        if patching.is_already_applied(patch, files, base):
            report.append((patch.name, "already in upstream"))
        else:
            for strict, status in ((True, "applies"), (False, "applies with offsets")):
                try:
                    files.update(patching.apply_patch(patch, files, strict=strict))
                    report.append((patch.name, status))
                    break
                except patching.PatchError as exc:
                    detail = str(exc)
            else:
                report.append((patch.name, f"conflicts: {detail}"))
        if base is not None:
            try:
                base.update(patching.apply_patch(patch, base))
            except patching.PatchError:
                base = None
    return report


def cmd_check(args) -> None:
    cfg = config.load(ROOT)
    source = Path(args.against)
    if not source.exists():
        if os.sep in args.against or args.against.endswith((".whl", ".tar.gz")):
            raise config.ConfigError(f"--against {args.against}: no such file or directory")
        if os.environ.get(config.OFFLINE_ENV, "") not in ("", "0"):
            raise config.ConfigError(
                f"--against {args.against}: {config.OFFLINE_ENV} is set, so the vllm {args.against} "
                "sdist is not fetched from the index; pass a local wheel, sdist or directory")
        source = _fetch_sdist(args.against)
    target = cfg.target(args.target)
    try:
        base = source_files(find_base_wheel(target))
    except BaseWheelError as exc:
        print(f"note: without the base ({exc}), only patch lines are compared", file=sys.stderr)
        base = None
    report = check_series(patching.read_series(cfg.patches_dir), source_files(source), base)
    width = max((len(name) for name, _ in report), default=0)
    print(f"patch series against {source.name}:")
    for name, status in report:
        print(f"  {name:<{width}}  {status}")
    if any(status.startswith("conflicts") for _, status in report):
        sys.exit(1)


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


def cmd_lock(args) -> None:
    cfg = config.load(ROOT)
    lock, digest = read_lock(cfg), content_digest(cfg)
    if lock.get("content") == digest and lock.get("release") == str(cfg.release):
        print(f"{LOCK_FILE} is current (release {cfg.release})")
        return
    if lock and lock.get("content") != digest and lock.get("release") == str(cfg.release):
        sys.exit(
            f"patches/ or vllm/ changed since release {cfg.release} was locked: bump "
            "[tool.vllm-fork].release in pyproject.toml, then run `tools/fork.py lock` again"
        )
    (cfg.root / LOCK_FILE).write_text(
        "# Written by tools/fork.py lock: the release number below stands for exactly this\n"
        "# content of patches/ and vllm/. Change either -> bump the release.\n"
        f"release = {cfg.release}\ncontent = {digest}\n"
    )
    print(f"locked release {cfg.release}: {digest[:16]}")


def patch_table(patches: list[patching.Patch]) -> str:
    """The README's patch list (tests/packaging/test_readme.py keeps it in sync)."""
    rows = ["| # | patch | origin | upstream |", "|---|---|---|---|"]
    for patch in patches:
        origin = patch.fields.get("Origin", "").replace("|", "\\|")
        rows.append(f"| {patch.number} | {patch.subject} | {origin} | {patch.fields.get('Applied-Upstream', '')} |")
    return "\n".join(rows) + "\n"


README_START = "<!-- patch-table:"
README_END = "<!-- /patch-table -->"


def readme_with_table(readme: str, table: str) -> str:
    head, _, rest = readme.partition(README_START)
    marker, _, rest = rest.partition("\n")
    _, _, tail = rest.partition(README_END)
    return f"{head}{README_START}{marker}\n{table}{README_END}{tail}"


def cmd_patch_table(args) -> None:
    table = patch_table(patching.read_series(config.load(ROOT).patches_dir))
    if args.update_readme:
        readme = ROOT / "README.md"
        readme.write_text(readme_with_table(readme.read_text(), table))
    else:
        print(table, end="")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    unpack = sub.add_parser("unpack", help="base wheel + series -> git work tree")
    unpack.add_argument("dir")
    unpack.add_argument("--target", choices=None, help="cuda or cpu (default: VLLM_TARGET_DEVICE or cuda)")
    unpack.set_defaults(func=cmd_unpack)
    export = sub.add_parser("export", help="git work tree -> patches/")
    export.add_argument("dir")
    export.add_argument("--to", help="output directory (default: the repo's patches/)")
    export.set_defaults(func=cmd_export)
    check = sub.add_parser("check", help="report the series against another vLLM release")
    check.add_argument("--against", required=True, help="a version on the index, or a wheel/sdist/directory")
    check.add_argument("--target", help="base the patches were written for (default: VLLM_TARGET_DEVICE or cuda)")
    check.set_defaults(func=cmd_check)
    lock = sub.add_parser("lock", help="record the content hash of this release")
    lock.set_defaults(func=cmd_lock)
    table = sub.add_parser("patch-table", help="print the README's patch list (markdown)")
    table.add_argument("--update-readme", action="store_true", help="rewrite the table in README.md")
    table.set_defaults(func=cmd_patch_table)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (config.ConfigError, patching.PatchError, BaseWheelError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        sys.exit(f"error: {exc}\n{detail.decode(errors='replace')}".rstrip())


if __name__ == "__main__":
    main()
