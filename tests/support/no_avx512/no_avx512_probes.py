"""torch's CPU-feature probes that vLLM consults, answering "absent"."""

import importlib.abc
import importlib.util
import os
import sys

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


def _default_inductor_cache() -> str:
    """torch's default (torch._inductor.runtime.cache_dir_utils), computed
    here: importing torch._inductor at start-up imports Triton before a test
    can ask for its interpreter."""
    import getpass
    import re
    import tempfile

    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser()))


def _own_inductor_cache() -> None:
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or _default_inductor_cache()
    if not base.endswith(INDUCTOR_CACHE_SUFFIX):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = base + INDUCTOR_CACHE_SUFFIX


def _absent_probes(torch) -> None:
    for name in PROBES:
        if hasattr(torch.cpu, name):
            setattr(torch.cpu, name, _absent)


def apply() -> None:
    """This process sees a CPU without AVX-512 or AMX, from now on."""
    import torch

    _absent_probes(torch)
    _own_inductor_cache()


class _ProbesOnTorchImport(importlib.abc.MetaPathFinder):
    """Patches torch's probes as soon as `import torch` has run, in processes
    that import it: most Python processes of a test run (pip, build
    backends, the git and packaging tools) never do, and importing torch at
    every start-up cost them seconds each."""

    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _absent_probes(module)

            spec.loader.exec_module = exec_module
        return spec


def apply_when_torch_is_imported() -> None:
    _own_inductor_cache()
    if "torch" in sys.modules:
        _absent_probes(sys.modules["torch"])
    else:
        sys.meta_path.insert(0, _ProbesOnTorchImport())


def active() -> bool:
    import torch

    return all(getattr(torch.cpu, name, _absent) is _absent for name in PROBES)
