"""torch's CPU-feature probes that vLLM consults, answering "absent"."""

import os

# Every probe of an instruction-set extension beyond AVX2 that vLLM or torch
# code of the base reads to pick a kernel library or an attention ISA.
PROBES = (
    "_is_avx512_supported",
    "_is_vnni_supported",
    "_is_avx512_bf16_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
)


def _absent() -> bool:
    return False


# Inductor's caches are keyed without the vector ISA the code was generated
# for: a graph that a process seeing AVX-512 compiled (16-lane loops) would be
# taken from the cache here and built for AVX2 (8-lane vectors), and its
# masked loads of up to 16 floats overrun 8-float buffers on the stack (a
# worker died of SIGBUS in the sampler). Processes that see no AVX-512 keep
# their own cache next to the machine's.
INDUCTOR_CACHE_SUFFIX = "-as-without-avx512"


def _own_inductor_cache() -> None:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    if not base.endswith(INDUCTOR_CACHE_SUFFIX):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = base + INDUCTOR_CACHE_SUFFIX


def apply() -> None:
    import torch

    for name in PROBES:
        if hasattr(torch.cpu, name):
            setattr(torch.cpu, name, _absent)
    _own_inductor_cache()


def active() -> bool:
    import torch

    return all(getattr(torch.cpu, name, _absent) is _absent for name in PROBES)
