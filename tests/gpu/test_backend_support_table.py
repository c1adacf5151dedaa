"""The GPU suite's own machinery, checked on any machine (no GPU needed):
the drafter-backend support table asks vLLM (fake DeviceCapability,
monkeypatched FA3 fp8 support), the error-message parser, the exception
chain the start-error harness records, the tie-aware greedy comparison and
the KV capacity formula."""

from __future__ import annotations

import engine_start_errors as ese
import gpu_backends as gb
import gpu_e2e
import pytest
import torch

HEAD = 64


def table(cap):
    return gb.support_table(head_size=HEAD, dtype=torch.bfloat16, device_capability=cap)


@pytest.fixture
def fa3_fp8(monkeypatch):
    """FA3 on Hopper: flash_attn_supports_fp8() is True."""
    import vllm.v1.attention.backends.flash_attn as fa

    monkeypatch.setattr(fa, "flash_attn_supports_fp8", lambda: True)


@pytest.fixture
def no_fa3_fp8(monkeypatch):
    import vllm.v1.attention.backends.flash_attn as fa

    monkeypatch.setattr(fa, "flash_attn_supports_fp8", lambda: False)


def test_hopper_with_fa3_fp8_flash_attn_serves_every_kv_dtype(fa3_fp8):
    t = table(gb.capability(9, 0))
    print("\n" + gb.format_table(t))
    for kv in gb.KV_DTYPES:
        assert t[("FLASH_ATTN", kv)] == [], (kv, t[("FLASH_ATTN", kv)])


def test_without_fa3_fp8_flash_attn_serves_auto_only(no_fa3_fp8):
    t = table(gb.capability(8, 0))
    print("\n" + gb.format_table(t))
    assert t[("FLASH_ATTN", "auto")] == []
    for kv in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        assert t[("FLASH_ATTN", kv)] == ["kv_cache_dtype not supported"]


def test_flash_attn_needs_ampere(fa3_fp8):
    reasons = gb.validation_reasons(
        "FLASH_ATTN", head_size=HEAD, dtype=torch.bfloat16, kv_cache_dtype="auto", device_capability=gb.capability(7, 5)
    )
    assert "compute capability not supported" in reasons


def test_non_causal_is_what_decides_triton(monkeypatch, fa3_fp8):
    """The table asks the backend class: TRITON_ATTN's row follows its
    supports_non_causal() (False in vLLM 0.21.0; a fork patch may change it)."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    cap = gb.capability(9, 0)
    before = table(cap)
    native = TritonAttentionBackend.supports_non_causal()
    assert ("non-causal attention not supported" in before[("TRITON_ATTN", "auto")]) == (not native)
    monkeypatch.setattr(TritonAttentionBackend, "supports_non_causal", classmethod(lambda cls: True))
    after = table(cap)
    assert after[("TRITON_ATTN", "auto")] == []
    assert after[("TRITON_ATTN", "fp8")] == []
    # Causal layers (the target's) were never the problem.
    monkeypatch.undo()
    assert (
        gb.validation_reasons(
            "TRITON_ATTN",
            head_size=HEAD,
            dtype=torch.bfloat16,
            kv_cache_dtype="fp8",
            device_capability=cap,
            use_non_causal=False,
        )
        == []
    )


def test_flashinfer_row_is_never_supported_for_dflash_in_0_21(fa3_fp8):
    """FlashInfer has no non-causal path in 0.21.0, or no module on this machine."""
    reasons = table(gb.capability(9, 0))[("FLASHINFER", "auto")]
    assert reasons, reasons
    assert any(r.startswith("ImportError") or "non-causal" in r for r in reasons), reasons


def test_working_backends(fa3_fp8):
    cap = gb.capability(9, 0)
    assert "FLASH_ATTN" in gb.working_backends("fp8", head_size=HEAD, dtype=torch.bfloat16, device_capability=cap)


def test_runtime_gap_fa3_has_no_e5m2():
    assert gb.runtime_gap("FLASH_ATTN", "fp8_e5m2") is not None
    assert gb.runtime_gap("FLASH_ATTN", "fp8") is None
    assert gb.runtime_gap("FLASH_ATTN", "fp8_e4m3") is None
    assert gb.runtime_gap("FLASH_ATTN", "auto") is None
    assert gb.runtime_gap("TRITON_ATTN", "fp8_e5m2") is None


@pytest.mark.parametrize(
    "message, names",
    [
        (
            "Selected backend AttentionBackendEnum.TRITON_ATTN is not valid for this configuration. "
            "Reason: ['non-causal attention not supported']. Backends that support this "
            "configuration: FLASH_ATTN, FLEX_ATTENTION.",
            ["FLASH_ATTN", "FLEX_ATTENTION"],
        ),
        (
            "x. Backends that support this configuration: TRITON_ATTN, FLASH_ATTN\nnext line FLASHINFER",
            ["TRITON_ATTN", "FLASH_ATTN"],
        ),
        ("Backends that support this configuration: none.", []),
        ("Selected backend AttentionBackendEnum.TRITON_ATTN is not valid for this configuration.", None),
    ],
)
def test_backend_names_in(message, names):
    assert gb.backend_names_in(message) == names


def test_exception_chain_finds_the_value_error():
    try:
        try:
            raise ValueError("Selected backend X is not valid")
        except ValueError as inner:
            raise RuntimeError("Engine core initialization failed") from inner
    except RuntimeError as e:
        chain = ese.exception_chain(e)
    assert [c["type"] for c in chain] == ["RuntimeError", "ValueError"]
    assert ese.first_of_type(chain, "ValueError")["message"] == "Selected backend X is not valid"
    assert ese.first_of_type(chain, "KeyError") is None


def test_expected_blocks_formula(tmp_path):
    config = {
        "target": {
            "num_hidden_layers": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "hidden_size": 256,
            "num_attention_heads": 4,
        },
        "draft": {
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "hidden_size": 256,
            "num_attention_heads": 4,
        },
    }
    auto, per_auto = gpu_e2e.expected_blocks(config, "auto", 16, 1 << 30)
    fp8, per_fp8 = gpu_e2e.expected_blocks(config, "fp8", 16, 1 << 30)
    assert per_auto == 6 * 2 * 2 * 16 * 64 * 2 and per_fp8 * 2 == per_auto
    assert fp8 == 2 * auto or fp8 == 2 * auto + 1


def test_cuda_skip_reason_says_how_to_run():
    assert "torch.cuda.is_available()" in gpu_e2e.CUDA_SKIP_REASON
    assert "tools/run_gpu_checks.sh" in gpu_e2e.CUDA_SKIP_REASON
