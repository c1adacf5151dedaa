"""What this vLLM is: fork version, pinned base wheel and applied patches.

python -m vllm.fork.info          # human-readable
python -m vllm.fork.info --json   # machine-readable
python -m vllm.fork.info --kv     # KV cache dtypes for a DFlash target and drafter here
"""

from __future__ import annotations

import argparse
import json
from functools import cache
from importlib import resources


@cache
def provenance() -> dict:
    """Written into the wheel at build time by the fork's build backend."""
    return json.loads(resources.files("vllm").joinpath("_fork_provenance.json").read_text())


def describe() -> str:
    info = provenance()
    base = info["base"]
    lines = [
        f"vllm {info['fork_version']} (DFlash-FP8 fork, target {info['target']})",
        f"base: {base['filename']}",
        f"      sha256 {base['sha256']}",
        "patches:",
    ]
    lines += [f"  {p['name']}  sha256 {p['sha256'][:16]}  {p['subject']}" for p in info["patches"]]
    if info.get("skipped_patches"):
        lines.append(f"SKIPPED (test build): {', '.join(info['skipped_patches'])}")
    if info.get("overlay"):
        lines.append("added files:")
        lines += [f"  {path}" for path in info["overlay"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vllm.fork.info", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the raw provenance record")
    parser.add_argument(
        "--kv", action="store_true", help="which KV cache dtypes serve a DFlash target and drafter on this machine"
    )
    args = parser.parse_args(argv)
    if args.kv:
        from vllm.fork import kv_support

        print(kv_support.describe())
        return
    print(json.dumps(provenance(), indent=2, sort_keys=True) if args.json else describe())


if __name__ == "__main__":
    main()
