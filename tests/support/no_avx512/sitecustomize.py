"""Make a Python process see an x86 CPU without AVX-512 and without AMX.

Python imports ``sitecustomize`` at start-up from ``sys.path``; with this
directory on ``PYTHONPATH`` and ``VLLM_FORK_TEST_NO_AVX512=1``, every process
of a test run (pytest, engine cores, ``vllm serve``, the necessity
harness's subprocesses) gets torch's CPU-feature probes answering False for
AVX-512 and AMX. vLLM's CPU platform then loads ``_C_AVX2`` and the fork's
fp8 KV cache takes its torch path, exactly as on an AVX2-only host, so that
path is tested on machines that have AVX-512 too. tests/support/no_avx512_pass.py sets
both variables when the run asks for the mode.
"""

import os

if os.environ.get("VLLM_FORK_TEST_NO_AVX512") == "1":
    import no_avx512_probes

    no_avx512_probes.apply_when_torch_is_imported()
