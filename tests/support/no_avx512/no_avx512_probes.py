"""torch's CPU-feature probes that vLLM consults, answering "absent"."""

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


def apply() -> None:
    import torch

    for name in PROBES:
        if hasattr(torch.cpu, name):
            setattr(torch.cpu, name, _absent)


def active() -> bool:
    import torch

    return all(getattr(torch.cpu, name, _absent) is _absent for name in PROBES)
