"""The README stays true: its patch list is generated from patches/, its version
example is the current release, its `vllm serve` commands parse."""

from __future__ import annotations

import shlex

import pytest
from fork_maintainer.patch_table import patch_table, readme_with_table
from readme_blocks import bash_commands
from repo_paths import REPO

from forkbuild import config, patching


def test_readme_patch_table_matches_the_series():
    readme = (REPO / "README.md").read_text()
    table = patch_table(patching.read_series(config.load(REPO).patches_dir))
    assert readme_with_table(readme, table) == readme, (
        "README.md's patch table is stale: run `python tools/fork.py patch-table --update-readme`"
    )


def test_readme_shows_the_current_release_as_the_version():
    release = config.load(REPO).release
    readme = (REPO / "README.md").read_text()
    line = next(line for line in readme.splitlines() if line.startswith("vllm --version"))
    assert f"0.21.0+cpu.dflashfp8.{release} / 0.21.0+dflashfp8.{release}" in line, (
        f"README.md's `vllm --version` example is not release {release}: {line}"
    )


@pytest.mark.installed_fork
def test_readme_vllm_serve_commands_parse_with_vllms_own_parser():
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.fork.tiny_pairs import DFLASH_BLOCK_SIZE
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    serve = [c for c in bash_commands() if " vllm serve " in f" {c} "]
    assert len(serve) >= 2, serve
    for command in serve:
        words = shlex.split(command)
        argv = words[words.index("serve") + 1 :]
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        validate_parsed_serve_args(args)
        spec = args.speculative_config
        assert spec["method"] == "dflash" and args.kv_cache_dtype == "fp8", command
        if spec["model"] == "pair/draft":  # the generated pair of `vllm.fork.tiny_pairs`
            assert spec["num_speculative_tokens"] <= DFLASH_BLOCK_SIZE - 1, command


# Where each command the README shows is exercised. CPU commands are run word
# for word; those that need a GPU, real models or the repository's GitHub URL
# run in the GPU workflow, or are parsed (vllm serve) / stood in for
# (git+file:// for the GitHub URL). A new README command needs an entry here.
README_COMMANDS = {
    "bash tools/serve.sh Qwen/": "tests/packaging/test_readme.py::test_readme_vllm_serve_commands_parse_with_vllms_own_parser",
    "bash tools/serve.sh": "tests/cpu_e2e/test_serve_script.py",
    "bash tools/run_tests.sh": "tests/packaging/test_workflows.py::test_cpu_workflow_and_ci_run_use_the_readme_test_command",
    "vllm serve Qwen/": "tests/packaging/test_readme.py::test_readme_vllm_serve_commands_parse_with_vllms_own_parser",
    "VLLM_BATCH_INVARIANT=1 ": "tests/packaging/test_readme.py::test_readme_vllm_serve_commands_parse_with_vllms_own_parser "
    "(the mode itself, on an offline engine: tests/cpu_e2e/test_batch_invariant_cpu.py)",
    "python -m vllm.fork.tiny_pairs ": "tests/cpu_e2e/test_readme_quickstart.py",
    "python -m vllm.fork.tiny_families ": "tests/cpu_e2e/test_dflash_families.py::test_readme_family_commands_serve_the_hybrid_moe_target",
    "VLLM_CPU_KVCACHE_SPACE=2 vllm serve fam/target ": "tests/cpu_e2e/test_dflash_families.py::test_readme_family_commands_serve_the_hybrid_moe_target",
    "VLLM_CPU_KVCACHE_SPACE=2 vllm serve pair/target ": "tests/cpu_e2e/test_readme_quickstart.py",
    "VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=": "tests/cpu_e2e/test_dflash_tensor_parallel.py::test_served_api_with_tp2",
    'VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND="0-15|16-31" vllm serve pair/target --kv-cache-dtype fp8 '
    "--enforce-eager --data-parallel-size 2": "tests/cpu_e2e/test_dflash_scale_out.py::test_data_parallel_in_one_server",
    'VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND="0-31" vllm serve pair/target --kv-cache-dtype fp8 '
    "--enforce-eager --tensor-parallel-size 2": "tests/cpu_e2e/test_dflash_scale_out.py::test_tensor_parallel_across_two_nodes",
    'VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND="0-31" vllm serve pair/target --kv-cache-dtype fp8 '
    "--enforce-eager --data-parallel-size 2": "tests/cpu_e2e/test_dflash_scale_out.py::test_data_parallel_across_two_nodes",
    'pip install "vllm[ray] @ ': "tests/packaging/test_backend.py::test_cpu_wheel_is_named_vllm_with_cpu_version (the extra)",
    "ray start --": "tests/cpu_e2e/test_dflash_scale_out.py::test_tensor_parallel_over_ray_on_two_nodes (tests/support/ray_nodes.py)",
    "RAY_ADDRESS=NODE0_IP:6379 ": "tests/cpu_e2e/test_dflash_scale_out.py::test_tensor_parallel_over_ray_on_two_nodes",
    "curl -s http://127.0.0.1:8000/": "tests/cpu_e2e/test_readme_quickstart.py",
    'pip install "git+https://': "tests/packaging/test_backend.py::test_pip_builds_the_fork_offline",
    "VLLM_TARGET_DEVICE=cpu pip install .": "tests/packaging/test_backend.py::test_pip_builds_the_fork_offline",
    "VLLM_FORK_BASE_WHEEL=/wheels VLLM_FORK_OFFLINE=1 pip install .": "tests/packaging/test_backend.py::test_pip_builds_the_fork_offline",
    "vllm --version": "tests/packaging/test_real_bases.py::test_vllm_cli_reports_the_fork_version",
    "python -m vllm.fork.info": "tests/packaging/test_real_bases.py::test_installed_fork_is_this_checkout",
    "python -m vllm.fork.info --kv": "tests/engine/test_kv_support_report.py::test_info_prints_the_report",
    "bash tools/run_gpu_checks.sh": "tests/packaging/test_workflows.py::test_gpu_workflow_runs_an_existing_script",
    "bash tools/make_offline_kit.sh ": "tools/ci/check_offline_kits.sh (makes both kits; argument errors: tests/packaging/test_offline_kit.py)",
    "bash kit/install.sh ": "tests/packaging/test_offline_kit.py::test_split_kit_installs_with_no_network_and_runs",
    "VLLM_FORK_KIT=kit ": "tools/run_gpu_checks.sh (a GPU box with the kit)",
    "bash tools/ci/check_offline_kits.sh": "tests/packaging/test_workflows.py::test_offline_kit_workflow_runs_the_kit_proof",
    "VLLM_FORK_REAL_TARGET=": ".github/workflows/gpu.yml (real models, a GPU)",
    "python tools/fork.py unpack ": "tests/packaging/test_maintainer_tool.py::test_unpack_then_export_is_byte_identical",
    "python tools/fork.py export ": "tests/packaging/test_maintainer_tool.py::test_unpack_then_export_is_byte_identical",
    "python tools/fork.py check ": "tests/packaging/test_real_bases.py::test_dflash_fix_is_reported_as_in_upstream_022",
}


def test_every_readme_command_is_exercised_somewhere():
    """Each command of README.md and docs/ matches an entry of README_COMMANDS whose test
    (file, and function where named) exists."""
    unmapped, missing = [], []
    for command in bash_commands():
        command = " ".join(command.split())  # continuation lines leave runs of spaces
        where = next(
            (v for k, v in sorted(README_COMMANDS.items(), key=lambda kv: -len(kv[0])) if command.startswith(k)), None
        )
        if where is None:
            unmapped.append(command)
            continue
        path, _, function = where.split(" ")[0].partition("::")
        file = REPO / path
        if not file.is_file() or (function and f"def {function}(" not in file.read_text()):
            missing.append(f"{command!r} -> {where}")
    assert not unmapped, f"README commands no test exercises (add them to README_COMMANDS): {unmapped}"
    assert not missing, f"README_COMMANDS names tests that do not exist: {missing}"
