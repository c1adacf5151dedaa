"""An invalid --speculative-config makes `vllm serve` exit non-zero soon,
with a message naming the problem, and leave no process behind."""

from __future__ import annotations

import json
import subprocess

import pytest

import dflash_e2e as e2e
import serve_load as sl
from vllm_server import VllmServer, vllm_dist_skip_reason

# A hang detector: a refused config takes ~10-15 s (the CLI's imports).
EXIT_BOUND_S = 180


def _spec(draft: str, **override) -> str:
    return json.dumps({**e2e.dflash_spec_config(draft), **override})


@pytest.mark.parametrize("case", ["not-json", "unknown-method", "negative-tokens", "missing-draft"])
def test_invalid_speculative_config_exits_with_a_clear_message(case, partial_pair, tmp_path, figures):
    if reason := vllm_dist_skip_reason():
        pytest.skip(reason)
    target, draft = partial_pair
    spec, expected = {
        "not-json": ('{"method": "dflash", "model": ', "argument --speculative-config"),
        "unknown-method": (_spec(draft, method="dflash2"), "'dflash'"),
        "negative-tokens": (_spec(draft, num_speculative_tokens=-1), "greater than 0"),
        "missing-draft": (_spec(draft, model=str(tmp_path / "no-such-draft")),
                          "Invalid repository ID or local directory"),
    }[case]
    srv = VllmServer(target, sl.server_args(None) + ["--speculative-config", spec],
                     tmp_path / "server.log", env=sl.SERVER_ENV).spawn()
    try:
        code = srv.proc.wait(timeout=EXIT_BOUND_S)
        leftovers = srv.leftovers()
    except subprocess.TimeoutExpired:
        pytest.fail(f"vllm serve with speculative config {spec} still runs after "
                    f"{EXIT_BOUND_S} s:\n{srv.log_tail()}")
    finally:
        srv.stop()
    log = srv.log_tail(20000)
    figures[f"invalid speculative config: {case}"] = {"exit_code": code}
    print(f"\n[serve-load] --speculative-config {spec}: exit {code}")
    assert code != 0, log
    assert expected in log, log[-3000:]
    assert "SpeculativeConfig" in log or case == "not-json", log[-3000:]
    assert not leftovers, leftovers
