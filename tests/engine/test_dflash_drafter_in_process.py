"""The DFlash drafter as vLLM's proposer builds it, without an engine.

The drafter is built as the proposer builds it (``get_model`` with the draft
model config), from the engine config that `vllm serve` arguments give, in a
process of its own with a one-rank process group (a few seconds, where an
engine takes half a minute), then checked:

- its layers take the target's cache config and the drafter's quantization
  config (vllm-project/vllm#42692): each draft attention layer holds the
  ``--kv-cache-dtype`` (fp8) and the k/v scales its checkpoint ships (0.5 /
  0.25); without the cache config a layer caches in the model dtype, without
  the quantization config it keeps scales of 1.0;
- its attention runs where the CPU GEMM dispatch has repacked the linear
  weights into the layer and left ``.weight`` empty (as oneDNN or the SGL
  kernels do on AVX-512 builds; done here explicitly so the check holds on
  every CPU): the draft attention calls its ``qkv_proj`` layer.

What an engine then allocates and computes with them:
tests/cpu_e2e/test_dflash_kv.py and test_dflash_pairs.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

BUILD_THE_DRAFTER = r"""
import json, socket, sys

from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader import get_model

target, draft, kv_cache_dtype = sys.argv[1:4]
config = EngineArgs(model=target, dtype="bfloat16", max_model_len=256, enforce_eager=True,
                    kv_cache_dtype=kv_cache_dtype,
                    speculative_config={"method": "dflash", "model": draft,
                                        "num_speculative_tokens": 3}).create_engine_config()
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
with set_current_vllm_config(config):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(1, 1)
    model = get_model(vllm_config=config, model_config=config.speculative_config.draft_model_config,
                      load_config=config.speculative_config.draft_load_config)
layers = {name: {"kv_cache_dtype": m.kv_cache_dtype, "k_scale": m._k_scale_float,
                 "v_scale": m._v_scale_float}
          for name, m in model.named_modules() if type(m).__name__ == "Attention"}
print("LAYERS " + json.dumps(layers))
if "--repacked-forward" in sys.argv:
    import torch

    sys.path.insert(0, sys.argv[sys.argv.index("--repacked-forward") + 1])
    from worker_probes import repack_linear_weights

    repacked = sum(repack_linear_weights(model))  # changed here + repacked by the base already

    class AttendToQuery(torch.nn.Module):  # paged attention needs an engine step
        def forward(self, q, k, v):
            return q

    attentions = [m for m in model.modules() if type(m).__name__ == "DFlashQwen3Attention"]
    hidden_size = config.speculative_config.draft_model_config.get_hidden_size()
    shapes = []
    with torch.no_grad():
        for attention in attentions:
            attention.attn = AttendToQuery()
            out = attention(torch.arange(5), torch.randn(5, hidden_size, dtype=torch.bfloat16))
            shapes.append(list(out.shape))
    print("FORWARD " + json.dumps({"repacked": repacked, "shapes": shapes}))
"""


def build_the_drafter(pair, kv_cache_dtype: str, *extra: str) -> dict:
    """The report lines of BUILD_THE_DRAFTER, by their first word."""
    proc = subprocess.run(
        [sys.executable, "-c", BUILD_THE_DRAFTER, *pair, kv_cache_dtype, *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = {
        line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1])
        for line in proc.stdout.splitlines()
        if line.startswith(("LAYERS ", "FORWARD "))
    }
    assert proc.returncode == 0 and report, (
        f"building the drafter: return code {proc.returncode}"
        f"{f' (signal {-proc.returncode})' if proc.returncode < 0 else ''}\n"
        f"stdout tail:\n{proc.stdout[-2000:]}\nstderr tail:\n{proc.stderr[-4000:]}"
    )
    return report


@pytest.mark.needs_patch("0001", no_avx512_pass=True)
def test_draft_layers_take_the_kv_cache_dtype_and_the_drafters_kv_scales(kv_scales_pair):
    layers = build_the_drafter(kv_scales_pair, "fp8")["LAYERS"]
    print(f"\n[engine] draft attention layers: {layers}")
    assert len(layers) == 2, layers
    for name, layer in layers.items():
        assert layer == {"kv_cache_dtype": "fp8", "k_scale": 0.5, "v_scale": 0.25}, (name, layer)


@pytest.mark.needs_patch("0003", no_avx512_pass=True)
def test_draft_attention_runs_with_repacked_linear_weights(full_pair):
    from repo_paths import SUPPORT

    support = str(SUPPORT)
    forward = build_the_drafter(full_pair, "fp8", "--repacked-forward", support)["FORWARD"]
    print(f"\n[engine] repacked draft attention: {forward}")
    assert forward["repacked"] > 0 and len(forward["shapes"]) == 2, forward
