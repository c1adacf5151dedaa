"""Maintainer tooling for the patch series.

    tools/fork.py unpack  DIR [--target cpu]   the fork as a git work tree: base, then one commit per patch
    tools/fork.py export  DIR [--to patches]   commits since tag `base` -> patches/ + series, vllm/fork/ back
    tools/fork.py check   --against 0.22.0     per patch: applies / already in upstream / conflicts
    tools/fork.py lock                         record the content hash for this release
    tools/fork.py patch-table                  the README's patch list
    tools/fork.py diff-wheels A.whl B.whl      what two builds differ in, file by file

Typical rebase onto another vLLM release: `check --against X.Y.Z`, then
`unpack` a tree of the new base, edit the patches there, `export`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from forkbuild import build_request, config, patching
from forkbuild.base import BaseWheelError, find_base_wheel

from . import patch_table, release_lock, upstream_check, wheel_diff, worktree
from .sources import fetch_sdist, source_files

ROOT = Path(__file__).resolve().parents[2]


def cmd_unpack(args) -> None:
    build = build_request.resolve(ROOT, args.target, honour_skips=False)
    count = worktree.unpack(build, Path(args.dir))
    print(f"{args.dir}: base {build.target.filename} + vllm/fork + {count} patches as commits")


def cmd_export(args) -> None:
    out = Path(args.to) if args.to else ROOT / "patches"
    overlay = Path(args.overlay_to) if args.overlay_to else ROOT / "vllm"
    count = worktree.export(Path(args.dir), out, overlay)
    print(f"exported {count} patches to {out}, vllm/fork to {overlay}")


def cmd_check(args) -> None:
    build = build_request.resolve(ROOT, args.target, honour_skips=False)
    source = Path(args.against)
    if not source.exists():
        if os.sep in args.against or args.against.endswith((".whl", ".tar.gz")):
            raise config.ConfigError(f"--against {args.against}: no such file or directory")
        if build.base.offline:
            raise config.ConfigError(
                f"--against {args.against}: {config.OFFLINE_ENV} is set, so the vllm {args.against} "
                "sdist is not fetched from the index; pass a local wheel, sdist or directory"
            )
        source = fetch_sdist(args.against)
    try:
        base = source_files(find_base_wheel(build.target, build.base))
    except BaseWheelError as exc:
        print(f"note: without the base ({exc}), only patch lines are compared", file=sys.stderr)
        base = None
    report = upstream_check.check_series(list(build.series), source_files(source), base)
    width = max((len(entry.name) for entry in report), default=0)
    print(f"patch series against {source.name}:")
    for entry in report:
        print(f"  {entry.name:<{width}}  {entry.status}")
    if any(entry.conflicts for entry in report):
        sys.exit(1)


def cmd_lock(args) -> None:
    print(release_lock.lock(config.load(ROOT)))


def cmd_patch_table(args) -> None:
    table = patch_table.patch_table(patching.read_series(config.load(ROOT).patches_dir))
    if args.update_readme:
        readme = ROOT / "README.md"
        readme.write_text(patch_table.readme_with_table(readme.read_text(), table))
    else:
        print(table, end="")


def cmd_diff_wheels(args) -> None:
    found = wheel_diff.differences(Path(args.first), Path(args.second))
    for line in found:
        print(line)
    if found:
        sys.exit(1)
    print(f"same files, same bytes ({Path(args.first).name} / {Path(args.second).name}; provenance and version aside)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="tools/fork.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    unpack = sub.add_parser("unpack", help="the fork as a git work tree")
    unpack.add_argument("dir")
    unpack.add_argument("--target", help="cuda or cpu (default: VLLM_TARGET_DEVICE or cuda)")
    unpack.set_defaults(func=cmd_unpack)
    export = sub.add_parser("export", help="git work tree -> patches/ and vllm/fork/")
    export.add_argument("dir")
    export.add_argument("--to", help="patches directory (default: the repo's patches/)")
    export.add_argument("--overlay-to", help="directory to write fork/ into (default: the repo's vllm/)")
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
    diff = sub.add_parser("diff-wheels", help="compare two builds file by file")
    diff.add_argument("first")
    diff.add_argument("second")
    diff.set_defaults(func=cmd_diff_wheels)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (
        config.ConfigError,
        patching.PatchError,
        BaseWheelError,
        release_lock.LockError,
        worktree.WorkTreeError,
        subprocess.CalledProcessError,
    ) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        sys.exit(f"error: {exc}\n{detail.decode(errors='replace')}".rstrip())
