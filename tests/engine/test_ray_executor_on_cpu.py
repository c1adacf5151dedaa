"""vLLM's Ray executor places CPU workers: what `--distributed-executor-backend
ray` needs from the CPU platform before any model loads.

vLLM 0.21.0 refused Ray on CPU ("current platform cpu does not support ray":
the CPU platform named no Ray resource). With the fork, each worker of the
Ray executor holds one of Ray's CPU resources: the placement group has one
CPU bundle per rank, a worker actor is created with the options the executor
gives it, and it reports its node and no accelerator ids (so the node's own
CPU_VISIBLE_MEMORY_NODES stays). These checks run on a one-node Ray cluster of
their own (two CPUs); tests/cpu_e2e/test_dflash_scale_out.py serves DFlash
over two Ray nodes.

vLLM's older Ray executor (VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0) asks Ray for
"CPU" among custom resources, which Ray refuses: on CPU it is refused when the
engine config is built, saying what to use.
"""

from __future__ import annotations

import pytest
from engine_configs import config_refusal
from ray_nodes import LocalRayCluster

pytestmark = pytest.mark.needs_patch("0033")


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    import ray  # tests/requirements.txt installs it (the fork's `ray` extra)

    # A Ray node of its own (whatever cluster this machine may run) that goes
    # with this process even if it is killed, which one ray.init starts
    # does not wholly do (its agents stay).
    with LocalRayCluster(tmp_path_factory.mktemp("ray"), nodes=1, num_cpus=2) as cluster:
        with pytest.MonkeyPatch.context() as env:
            for name, value in cluster.driver_env.items():
                env.setenv(name, value)
            ray.init(address=cluster.address, log_to_driver=False)
            try:
                yield ray
            finally:
                ray.shutdown()


def test_each_rank_gets_a_cpu_bundle_and_a_worker_actor_on_it(local_ray):
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from vllm.config import ParallelConfig
    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2, RayWorkerProc
    from vllm.v1.executor.ray_utils import get_bundles_sorted_by_node, initialize_ray_cluster

    parallel = ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="ray")
    initialize_ray_cluster(parallel, require_gpu_on_driver=False)
    pg = parallel.placement_group
    try:
        assert pg.bundle_specs == [{"CPU": 1.0}, {"CPU": 1.0}]
        ranks = get_bundles_sorted_by_node(pg)
        assert [bundle for bundle, _node, _ip in ranks] == [0, 1]

        # As RayExecutorV2 creates its workers (the work itself starts later).
        actor = (
            local_ray.remote(RayWorkerProc)
            .options(
                **RayExecutorV2._get_actor_resource_kwargs(),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=ranks[0][0]
                ),
            )
            .remote(
                vllm_config=None,
                rank=0,
                distributed_init_method="tcp://127.0.0.1:1",
                input_shm_handle=None,
                is_driver_worker=True,
            )
        )
        node_id, device_ids = local_ray.get(actor.get_node_and_gpu_ids.remote(), timeout=120)
        local_ray.kill(actor)
    finally:
        remove_placement_group(pg)
    assert node_id == ranks[0][1]
    assert device_ids == []


def test_the_older_ray_executor_is_refused_with_what_to_use(trained_pair, monkeypatch):
    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "0")
    target, _draft = trained_pair
    message = config_refusal(
        model=target,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
    )
    assert "unset VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0" in message, message
    assert "--distributed-executor-backend mp" in message, message
