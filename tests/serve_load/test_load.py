"""Concurrent streaming and non-streaming completions and chat clients,
more of them than --max-num-seqs, against a KV cache too small for all of
them: every request completes, nothing is lost, duplicated, truncated or
mixed, and every greedy output is the target-only output for its prompt,
token for token (float32: tests/support/lossless.py)."""

from __future__ import annotations

import serve_workload as workload
from draft_counts import DraftCounts


def test_load_with_preemption_is_lossless(live_server, load_jobs, references, figures):
    srv = live_server
    before = srv.metrics()
    outs, wall = workload.run_jobs(srv.base, srv.model, load_jobs, concurrency=workload.LOAD_CONCURRENCY)
    after = workload.wait_idle(srv)

    failed = [o for o in outs if not o.ok]
    report, bad = workload.check(outs, references)
    response_ids = [i for o in outs for i in o.response_ids]
    preemptions = workload.delta(before, after, "vllm:num_preemptions_total")
    finished = workload.delta(before, after, "vllm:request_success_total{finished_reason=length}")
    lat = workload.latency_summary(outs)
    accepted = int(workload.delta(before, after, "vllm:spec_decode_num_accepted_tokens_total"))
    figures["load"] = {
        "sent": len(load_jobs),
        "completed": len(outs) - len(failed),
        "failed": len(failed),
        **report.summary(),
        "concurrency": workload.LOAD_CONCURRENCY,
        "max_num_seqs": workload.MAX_NUM_SEQS,
        "kv_blocks": workload.NUM_BLOCKS,
        "preemptions": int(preemptions),
        "wall_s": round(wall, 2),
        "req_per_s": round(len(outs) / wall, 2),
        **{k: round(v, 3) for k, v in lat.items()},
        "accepted_tokens": accepted,
        "acceptance_length": round(DraftCounts.between(before, after).mean_acceptance_length, 3),
    }
    print(f"\n[serve-load] load: {figures['load']}")

    assert not failed, [f"{o.job.key}: {o.status} {o.error}" for o in failed][:5]
    assert not bad, bad[:10]
    assert len(set(response_ids)) == len(response_ids) == len(load_jobs), "a response id repeats"
    # The engine finished each request exactly once (none twice, none lost).
    assert finished == len(load_jobs), (finished, len(load_jobs))
    assert preemptions > 0, (
        f"no preemption with {workload.NUM_BLOCKS} KV blocks of {workload.BLOCK_SIZE} tokens: the load "
        "did not put the KV cache under pressure"
    )
    assert workload.delta(before, after, "vllm:spec_decode_num_drafts_total") > 0, "no drafts were made"
    # The trained-prompt jobs (workload.load_jobs) get drafts accepted: the equality
    # above covers accepted tokens under preemption, not only rejections.
    assert accepted > 0, "no draft token was accepted"
    assert after.get("vllm:kv_cache_usage_perc", 0) == 0, "KV blocks still in use after the load"
