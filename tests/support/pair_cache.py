"""The generated tiny pairs (vllm.fork.tiny_pairs, vllm.fork.tiny_families),
each generated once per content and shared by every process of a run."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

PAIR_CACHE_ENV = "VLLM_FORK_TEST_PAIR_CACHE"


def _pair_cache_root() -> Path:
    if os.environ.get(PAIR_CACHE_ENV):
        return Path(os.environ[PAIR_CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "vllm-fork" / "tiny-pairs"


def make_pair(name: str, acceptance: str, **kw) -> tuple[str, str]:
    """A seeded tiny target + DFlash drafter pair (vllm.fork.tiny_pairs),
    generated once per content: the pair is a function of the generator's
    source, torch's version and the arguments, so it is cached under a key of
    those (VLLM_FORK_TEST_PAIR_CACHE, else ~/.cache/vllm-fork/tiny-pairs) and
    shared by every process of a run -- the trained pair costs 10-30 s of
    training on 2 cores, and the necessity proofs' subprocesses need it too.
    Tests must not write into it (copy it first)."""
    import vllm.fork.tiny_pairs as tiny_pairs

    spec = json.dumps({"acceptance": acceptance, "seed": 0, **kw}, sort_keys=True, default=str)
    return _cached_pair(
        name, [tiny_pairs.__file__], spec, lambda out: tiny_pairs.ensure_pair(out, acceptance, seed=0, **kw)
    )


def make_family_pair(family: str, *, fp8_weights: bool = False) -> tuple[str, str]:
    """A target of ``family`` (vllm.fork.tiny_families) and a DFlash drafter
    trained against it, cached as :func:`make_pair` caches its pairs."""
    import vllm.fork.tiny_families as tiny_families
    import vllm.fork.tiny_pairs as tiny_pairs

    name = f"family-{family}" + ("-fp8-weights" if fp8_weights else "")
    return _cached_pair(
        name,
        [tiny_families.__file__, tiny_pairs.__file__],
        json.dumps({"family": family, "seed": 0, "fp8_weights": fp8_weights}),
        lambda out: tiny_families.ensure_family_pair(out, family, seed=0, fp8_weights=fp8_weights),
    )


def _cached_pair(name: str, sources: list[str], spec: str, generate) -> tuple[str, str]:
    """``generate(dir)`` written into a temporary directory and renamed into
    place under a key of ``sources``, torch's version and ``spec``, so no
    process ever sees half a pair."""
    digest = hashlib.sha256(
        b"".join(Path(f).read_bytes() for f in sources) + torch.__version__.encode() + spec.encode()
    ).hexdigest()[:16]
    root = _pair_cache_root()
    final = root / f"{name}-{digest}"

    def complete() -> bool:
        return (final / "target" / "config.json").is_file() and (final / "draft" / "config.json").is_file()

    if not complete():
        root.mkdir(parents=True, exist_ok=True)
        # One process generates a pair; the others (xdist workers, necessity
        # proofs) wait for it instead of training the same pair on the same
        # cores at the same time.
        with open(root / f".{name}-{digest}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not complete():
                partial = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
                try:
                    generate(partial)
                    os.replace(partial, final)
                except OSError:
                    if not final.is_dir():  # not another process that won the race
                        raise
                finally:
                    shutil.rmtree(partial, ignore_errors=True)
    return str(final / "target"), str(final / "draft")
