"""Wheel build time per target from a cached base, next to what recompressing costs.

    python benchmarks/bench_wheel_build.py [--targets cpu cuda] [--repeat 3]

Prints, per target: base size, median build time of the fork wheel, time to
recompress every member of the base (what a naive repack pays), and the ratio.
Goal: <= 10 s per target.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import zipfile
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from forkbuild import assemble, build_request, config  # noqa: E402
from forkbuild.base import find_base_wheel  # noqa: E402


def recompress_seconds(wheel: Path) -> float:
    start = time.perf_counter()
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            compressor = zlib.compressobj(6, zlib.DEFLATED, -15)
            compressor.compress(zf.read(info))
            compressor.flush()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=["cpu", "cuda"])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    cfg = config.load(REPO)
    print(f"{'target':<6} {'base MB':>8} {'build s':>8} {'recompress s':>13} {'ratio':>7}  goal<=10s")
    for name in args.targets:
        target = cfg.target(name)
        base = find_base_wheel(target)  # fetched into the cache once, outside the timing
        times = []
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.repeat):
                start = time.perf_counter()
                assemble.build_wheel(build_request.resolve(REPO, name), Path(tmp) / str(i))
                times.append(time.perf_counter() - start)
        build = statistics.median(times)
        naive = recompress_seconds(base)
        verdict = "ok" if build <= 10 else "MISSED"
        print(
            f"{name:<6} {base.stat().st_size / 1e6:>8.1f} {build:>8.2f} {naive:>13.2f} {naive / build:>6.1f}x  {verdict}"
        )


if __name__ == "__main__":
    main()
