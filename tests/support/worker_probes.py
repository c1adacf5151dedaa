"""Functions that run inside an engine's worker process (``LLM.collective_rpc``):
what the KV caches hold, the layers the drafter taps, the drafter's first
proposal. Pickled by value, so the worker needs no import of this module."""

from __future__ import annotations

import sys

import cloudpickle
import torch


def _kv_tensor(layer):
    kv = layer.kv_cache
    if isinstance(kv, (list, tuple)):
        kv = kv[0]
    return kv


def worker_kv_state(worker) -> dict:
    """Per attention layer: KV dtype, cache tensor dtype/shape, KV scales."""
    runner = worker.model_runner
    ctx = runner.vllm_config.compilation_config.static_forward_context
    draft_names = set(runner.drafter._draft_attn_layer_names) if hasattr(runner, "drafter") else set()
    layers = {}
    for name, layer in ctx.items():
        if not hasattr(layer, "kv_cache_dtype") or not hasattr(layer, "impl"):
            continue
        kv = _kv_tensor(layer)
        layers[name] = {
            "role": "draft" if name in draft_names else "target",
            "kv_cache_dtype": layer.kv_cache_dtype,
            "impl_kv_cache_dtype": getattr(layer.impl, "kv_cache_dtype", None),
            "tensor_dtype": str(kv.dtype),
            "tensor_shape": tuple(kv.shape),
            "k_scale": float(layer._k_scale_float),
            "v_scale": float(layer._v_scale_float),
        }
    cfg = runner.kv_cache_config
    return {
        "layers": layers,
        "num_blocks": int(cfg.num_blocks),
        "block_size": int(runner.cache_config.block_size),
        "kv_cache_memory_bytes": runner.cache_config.kv_cache_memory_bytes,
        "draft_names": sorted(draft_names),
    }


def worker_install_qsl_probe(worker) -> str:
    """Record the dtypes the drafter builds in set_inputs_first_pass."""
    drafter = worker.model_runner.drafter
    if getattr(drafter, "_e2e_probe", None) is not None:
        drafter._e2e_probe.clear()
        return "reset"
    probe: list = []
    orig = drafter.set_inputs_first_pass

    def wrapped(*args, **kwargs):
        result = orig(*args, **kwargs)
        cad = result[2]
        probe.append(
            (
                str(cad.query_start_loc_cpu.dtype),
                str(cad.query_start_loc.dtype),
                cad.query_start_loc_cpu.tolist(),
            )
        )
        return result

    drafter.set_inputs_first_pass = wrapped
    drafter._e2e_probe = probe
    return "installed"


def worker_read_qsl_probe(worker) -> dict:
    drafter = worker.model_runner.drafter
    return {
        "token_arange_np": str(drafter.token_arange_np.dtype),
        "arange": str(drafter.arange.dtype),
        "calls": list(drafter._e2e_probe),
    }


def _target_model(worker):
    model = worker.model_runner.get_model()
    return model.get_language_model() if hasattr(model, "get_language_model") else model


def worker_aux_layers(worker) -> tuple[int, ...]:
    """The ids of the target's layers whose hidden states feed the drafter."""
    return tuple(_target_model(worker).model.aux_hidden_state_layers)


def worker_set_aux_layers(worker, layers) -> tuple[int, ...]:
    _target_model(worker).set_aux_hidden_state_layers(tuple(layers))
    return worker_aux_layers(worker)


def repack_linear_weights(model) -> tuple[int, int]:
    """Do to ``model``'s unquantized linear layers what the base's CPU GEMM
    dispatch does where oneDNN or the SGL kernels are available (AVX-512
    builds): keep the weight only inside the layer's ``cpu_linear`` and leave
    ``.weight`` empty. On CPUs where the base keeps plain ``F.linear`` (AVX2)
    this makes a forward that reads ``.weight`` directly fail the same way, so
    a check does not depend on the CPU. Returns (layers changed here, layers
    the base had repacked already): on AVX-512/AMX CPUs the base's own
    dispatch may have done it to every layer, leaving nothing to change."""
    import torch.nn.functional as F

    from vllm.model_executor.layers.linear import LinearBase

    changed = already = 0
    # Linear layers only: embeddings and the LM head may be the target's own
    # (shared with the drafter), and they are not repacked by the base.
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, LinearBase) or getattr(module, "cpu_linear", None) is None or weight is None:
            continue
        if weight.numel() == 0:
            already += 1
            continue
        kept = weight.detach()
        module.cpu_linear = lambda x, _weight, bias, _kept=kept: F.linear(x, _kept, bias)
        module.weight = torch.nn.Parameter(torch.empty(0, dtype=kept.dtype), requires_grad=False)
        changed += 1
    return changed, already


def worker_repack_draft_linear_weights(worker) -> tuple[int, int]:
    """repack_linear_weights on the engine's drafter."""
    return repack_linear_weights(worker.model_runner.drafter.model)


def worker_record_first_propose(worker) -> str:
    """Keep (on CPU) the target inputs of the drafter's next propose call."""
    drafter = worker.model_runner.drafter
    if getattr(drafter, "_e2e_proposals", None) is not None:
        drafter._e2e_proposals.clear()
        return "reset"
    calls: list = []
    orig = drafter.propose

    def propose(*args, **kwargs):
        if not calls:
            calls.append(
                {
                    k: kwargs[k].detach().to("cpu", copy=True)
                    for k in ("target_token_ids", "target_positions", "target_hidden_states")
                }
            )
        return orig(*args, **kwargs)

    drafter.propose = propose
    drafter._e2e_proposals = calls
    return "installed"


def worker_read_first_propose(worker) -> list:
    return list(worker.model_runner.drafter._e2e_proposals)


cloudpickle.register_pickle_by_value(sys.modules[__name__])
