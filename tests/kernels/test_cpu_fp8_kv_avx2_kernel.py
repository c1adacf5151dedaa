"""The AVX2 fp8 KV-cache kernel (patch 0034): what it owns beyond the
reference checks it shares with the torch path
(test_cpu_fp8_kv_without_avx512.py).

- CPUs without AVX-512 send fp8 caches to it, not to the torch path;
- its cache write gives torch's bytes for every input;
- its read converts every fp8 byte as torch does;
- a query row's result depends on nothing but that row: not on the other
  requests of its batch, the other rows of its request, the number of
  threads, nor on how the kernel shares a long context among threads;
- where it cannot be built or used, the torch path serves, and the user is
  told why;
- a build is made once and reused.

Each test skips (with the reason) where the kernel does not build here: no
C compiler, or a CPU without AVX2/FMA/F16C.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from vllm import _custom_ops as ops

BLOCK_SIZE = 16


@pytest.fixture
def avx2(monkeypatch):
    """The kernel module, on a CPU that reports neither AVX-512 nor AMX."""
    from vllm.v1.attention.backends import cpu_attn_fp8_avx2

    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    try:
        cpu_attn_fp8_avx2.build()
    except cpu_attn_fp8_avx2.BuildError as exc:
        pytest.skip(f"the AVX2 fp8 kernel does not build here: {exc}")
    return cpu_attn_fp8_avx2


class PagedCache:
    """Requests' K/V written through ``ops`` into a shuffled paged fp8 cache."""

    def __init__(self, seq_lens, *, num_kv_heads=2, head_size=64, kv_dtype="fp8", block_size=BLOCK_SIZE, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.kv_dtype, self.block_size = kv_dtype, block_size
        self.num_kv_heads, self.head_size = num_kv_heads, head_size
        blocks = [math.ceil(s / block_size) for s in seq_lens]
        num_blocks = sum(blocks) + 1
        self.cache = torch.zeros(2, num_blocks, num_kv_heads, block_size, head_size, dtype=torch.uint8)
        order = torch.randperm(num_blocks - 1, generator=gen) + 1
        self.block_table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
        start = 0
        for i, (n, seq_len) in enumerate(zip(blocks, seq_lens)):
            self.block_table[i, :n] = order[start : start + n]
            start += n
            pos = torch.arange(seq_len)
            slots = self.block_table[i, pos // block_size].long() * block_size + pos % block_size
            k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
            v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
            ops.cpu_attn_reshape_and_cache(
                k, v, *self.cache.unbind(0), slots, "vec", k_scale=0.5, v_scale=2.0, kv_cache_dtype=kv_dtype
            )

    def attend(self, query, query_lens, seq_lens, rows_of=None, *, causal=True, sinks=None):
        """``ops.cpu_attention_with_kv_cache``; ``rows_of`` picks block-table rows."""
        out = torch.empty_like(query)
        qsl = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
        table = self.block_table if rows_of is None else self.block_table[rows_of]
        ops.cpu_attention_with_kv_cache(
            query=query,
            key_cache=self.cache[0],
            value_cache=self.cache[1],
            output=out,
            query_start_loc=qsl,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            scale=1 / math.sqrt(self.head_size),
            causal=causal,
            alibi_slopes=None,
            sliding_window=(-1, -1),
            block_table=table,
            softcap=0.0,
            scheduler_metadata=None,
            s_aux=sinks,
            k_scale=0.5,
            v_scale=2.0,
            kv_cache_dtype=self.kv_dtype,
        )
        return out


@pytest.mark.needs_patch("0034", no_avx512_pass=True)
def test_cpus_without_avx512_send_fp8_caches_to_the_avx2_kernel(avx2, monkeypatch):
    """The torch path converts a request's whole context to float32 on every
    read, several times the bf16 kernel's time; where the kernel builds, the
    ops entry points never reach it."""
    from vllm.v1.attention.backends import cpu_attn_torch_fp8

    def torch_path(*args, **kwargs):
        raise AssertionError("an fp8 cache took the torch path although the AVX2 kernel builds here")

    monkeypatch.setattr(cpu_attn_torch_fp8, "reshape_and_cache", torch_path)
    monkeypatch.setattr(cpu_attn_torch_fp8, "attention_with_kv_cache", torch_path)
    cache = PagedCache([40])
    out = cache.attend(torch.randn(4, 4, 64), [4], [40])
    assert out.isfinite().all()


@pytest.mark.needs_patch("0034", no_avx512_pass=True)
def test_the_drafters_noncausal_attention_takes_the_avx2_kernel(avx2, monkeypatch):
    """A DFlash drafter's block attends non-causally through the backend's own
    entry point (cpu_noncausal_attn), not through ops: found by the
    end-to-end benchmark, where its torch path made an fp8 cache decode 1.4
    times slower than a bf16 one."""
    from types import SimpleNamespace

    from vllm.v1.attention.backends import cpu_attn_torch_fp8
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.attention.backends.cpu_noncausal_attn import cpu_noncausal_attention_with_kv_cache

    def torch_path(*args, **kwargs):
        raise AssertionError("the drafter's fp8 cache took the torch path although the AVX2 kernel builds here")

    monkeypatch.setattr(cpu_attn_torch_fp8, "attention_with_kv_cache", torch_path)
    cache = PagedCache([40])
    impl = CPUAttentionBackendImpl(
        num_heads=4, head_size=64, scale=0.125, num_kv_heads=2, alibi_slopes=None,
        sliding_window=None, kv_cache_dtype="fp8",
    )  # fmt: skip
    layer = SimpleNamespace(_k_scale_float=0.5, _v_scale_float=2.0)
    metadata = SimpleNamespace(
        query_start_loc=torch.tensor([0, 4], dtype=torch.int32),
        seq_lens=torch.tensor([40], dtype=torch.int32),
        block_table=cache.block_table,
    )
    query = torch.randn(4, 4, 64)
    out = torch.full_like(query, float("nan"))
    cpu_noncausal_attention_with_kv_cache(impl, layer, query, cache.cache[0], cache.cache[1], out, metadata)
    assert torch.equal(out, cache.attend(query, [4], [40], causal=False))


def test_cpus_with_avx512_keep_the_base_kernels_for_fp8(monkeypatch):
    """Where the base's kernels hold an fp8 cache (AVX-512 or AMX), they keep
    serving it: neither fork path is reached."""
    from vllm.v1.attention.backends import cpu_attn_fp8_avx2, cpu_attn_torch_fp8

    if not cpu_attn_torch_fp8.kernels_support_fp8_kv():
        pytest.skip("this CPU (as vLLM sees it) has neither AVX-512 nor AMX")

    def fork_path(*args, **kwargs):
        raise AssertionError("an fp8 cache left the base's kernels on a CPU with AVX-512")

    for module in (cpu_attn_fp8_avx2, cpu_attn_torch_fp8):
        monkeypatch.setattr(module, "reshape_and_cache", fork_path)
        monkeypatch.setattr(module, "attention_with_kv_cache", fork_path)
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    cache = torch.zeros(2, 2, 2, 128, 64, dtype=torch.uint8)
    key = torch.randn(4, 2, 64, dtype=torch.bfloat16)
    isa = _get_attn_isa(torch.bfloat16, 128, 64, "fp8")
    ops.cpu_attn_reshape_and_cache(key, key, *cache.unbind(0), torch.arange(4) + 128, isa, kv_cache_dtype="fp8")
    assert cache[0, 1, :, :4].any()


def _awkward_floats() -> torch.Tensor:
    """Values at every fp8 scale: subnormals, rounding ties, the largest
    finite values and past them, infinities, NaN and zeros of both signs."""
    gen = torch.Generator().manual_seed(0)
    spread = [torch.randn(2048, generator=gen) * 10.0**e for e in range(-6, 6)]
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e5m2 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e5m2).float()
    # Midpoints of neighbouring fp8 values: ties round to the even one.
    ties = [(v[1:] + v[:-1]) / 2 for v in (e4m3.sort().values, e5m2.sort().values)]
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 448.0, 464.0, 480.0, 57344.0, 6.0e4])
    x = torch.cat([*spread, e4m3, e5m2, *ties, special, -special])
    x = x[x.isfinite() | x.isnan() | x.isinf()]
    return x[: x.numel() // 64 * 64]


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_cache_write_gives_torchs_bytes_for_every_input(avx2, kv_dtype, dtype):
    from vllm.v1.attention.backends import cpu_attn_torch_fp8

    fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_dtype]
    x = _awkward_floats().to(dtype).view(-1, 1, 64)  # [tokens, 1 head, 64]
    for scale in (1.0, 0.37, 4.0):
        cache = torch.zeros(2, x.shape[0], 1, 1, 64, dtype=torch.uint8)
        slots = torch.arange(x.shape[0])
        assert avx2.reshape_and_cache(x, x * 2, *cache.unbind(0), slots, scale, scale, kv_dtype)
        for got, src in ((cache[0], x), (cache[1], x * 2)):
            want = cpu_attn_torch_fp8.quantize(src, scale, fp8).view(got.shape)
            differ = (got != want).nonzero()
            assert differ.numel() == 0, (
                f"scale {scale}: {differ.shape[0]} bytes differ, e.g. "
                f"{src.flatten()[differ[:3, 0] * 64 + differ[:3, -1]].tolist()}"
            )


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_read_converts_every_fp8_byte_as_torch_does(avx2, kv_dtype):
    """One key: its softmax weight is exactly 1, so a float32 output row is
    the value row, byte by byte converted, times the value scale. The 256
    bytes hold subnormals, both zeros, NaN and (e5m2) infinities. (Equal as
    values: -0 comes out +0, as from any sum that starts at zero.)"""
    fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_dtype]
    every_byte = torch.arange(256, dtype=torch.uint8)
    cache = torch.zeros(2, 2, 1, BLOCK_SIZE, 256, dtype=torch.uint8)
    cache[1, 1, 0, 0] = every_byte
    out = torch.empty(1, 1, 256)
    for v_scale in (1.0, 0.37):
        assert avx2.attention_with_kv_cache(
            torch.randn(1, 1, 256), cache[0], cache[1], out,
            torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
            0.0625, True, None, (-1, -1), torch.tensor([[1]], dtype=torch.int32),
            0.0, None, 1.0, v_scale, kv_dtype,
        )  # fmt: skip
        want = every_byte.view(fp8).float() * v_scale
        got = out.flatten()
        same = (got == want) | (got.isnan() & want.isnan())
        assert same.all(), (v_scale, every_byte[~same].tolist(), got[~same].tolist(), want[~same].tolist())


@pytest.mark.parametrize("block_size", [16, 128])
def test_a_row_depends_on_nothing_but_itself(avx2, block_size):
    """Contexts of up to 3000 keys (several of the kernel's key splits),
    4 query heads on 1 KV head: the verification rows of request 0, computed
    beside three other requests at 1 and 2 threads, then alone, and each
    alone as a decode step at 1 and 2 threads, are bit-equal. Alone, the
    request's few tiles are spread over threads split by split; in the
    batch each thread takes whole tiles."""
    seq_lens, query_lens = [3000, 2000, 700, 1500], [4, 4, 1, 3]
    cache = PagedCache(seq_lens, num_kv_heads=1, head_size=128, block_size=block_size)
    query = torch.randn(sum(query_lens), 4, 128, generator=torch.Generator().manual_seed(1))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    threads = torch.get_num_threads()
    results = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results[f"batch, {n} threads"] = cache.attend(query, query_lens, seq_lens, sinks=sinks)[:4]
            results[f"alone, {n} threads"] = cache.attend(query[:4], [4], [3000], rows_of=[0], sinks=sinks)
            results[f"decoded, {n} threads"] = torch.cat(
                [cache.attend(query[i : i + 1], [1], [2997 + i], rows_of=[0], sinks=sinks) for i in range(4)]
            )
    finally:
        torch.set_num_threads(threads)
    first_name, first = next(iter(results.items()))
    for name, rows in results.items():
        assert torch.equal(rows, first), f"{name} differs from {first_name}: {(rows - first).abs().max():.3g}"


def test_calls_the_kernel_does_not_cover_take_the_torch_path(avx2):
    """A head size that is not a multiple of 8: the kernel declines (writes
    nothing) and ops serves the call through torch, correctly."""
    cache = PagedCache([30], head_size=20)
    query = torch.randn(2, 4, 20)
    assert not avx2.attention_with_kv_cache(
        query, cache.cache[0], cache.cache[1], torch.empty_like(query),
        torch.tensor([0, 2], dtype=torch.int32), torch.tensor([30], dtype=torch.int32),
        0.2, True, None, (-1, -1), cache.block_table, 0.0, None, 0.5, 2.0, "fp8",
    )  # fmt: skip
    assert cache.attend(query, [2], [30]).isfinite().all()


def test_the_build_is_made_once_and_reused(avx2, tmp_path, monkeypatch):
    """A second process (or call) loads the cached library: it asks the
    compiler its version (part of the key) and compiles nothing."""
    import subprocess

    first = avx2.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    asked, run = [], subprocess.run

    def only_the_version(cmd, **kwargs):
        asked.append(cmd)
        assert cmd[1:] == ["--version"], f"compiled again although the build is cached: {cmd}"
        return run(cmd, **kwargs)

    monkeypatch.setattr(subprocess, "run", only_the_version)
    assert avx2.build(tmp_path) == first
    assert first.stat().st_mtime_ns == stamp and asked
    assert [p.name for p in tmp_path.iterdir()] == [first.name], "a build left files behind"


@pytest.mark.parametrize(
    "how",
    ["no compiler", "the compiler fails", "VLLM_CPU_FP8_KV_KERNEL=0"],
)
def test_without_the_kernel_the_torch_path_serves_and_says_why(avx2, how, tmp_path, monkeypatch):
    if how == "no compiler":
        monkeypatch.setattr(avx2, "_compiler", lambda: None)
        said = "install gcc"
    elif how == "the compiler fails":
        monkeypatch.setenv("CC", str(tmp_path / "cc"))
        (tmp_path / "cc").write_text(
            "#!/bin/sh\n[ \"$1\" = --version ] && echo broken-cc && exit 0\necho 'cc: out of luck' >&2\nexit 3\n"
        )
        (tmp_path / "cc").chmod(0o755)
        monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
        said = "cc: out of luck"
    else:
        monkeypatch.setenv(avx2.DISABLE_VAR, "0")
        said = "VLLM_CPU_FP8_KV_KERNEL=0"
    messages = []

    class Records(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Records(level=logging.INFO)
    vllm_logger = logging.getLogger("vllm")  # vLLM's loggers do not propagate to the root
    vllm_logger.addHandler(handler)
    avx2.kernels.cache_clear()
    try:
        assert avx2.kernels() is None
        cache = PagedCache([40])
        out = cache.attend(torch.randn(4, 4, 64), [4], [40])
    finally:
        avx2.kernels.cache_clear()
        vllm_logger.removeHandler(handler)
    assert out.isfinite().all()
    assert any(said in m for m in messages), messages
    if how == "the compiler fails":
        assert not list((tmp_path / "cache").rglob("*.so")), "a failed build left a library behind"
