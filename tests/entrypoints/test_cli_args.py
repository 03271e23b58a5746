"""Every SPEC §1 flag is accepted under its upstream name; features not landed yet and impossible
combinations fail at start-up naming the flags."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.cli.main import build_parser


def _parse(argv):
    args = build_parser().parse_args(["serve", *argv])
    return EngineArgs.from_cli_args(args)


def test_short_forms_and_upstream_names():
    ea = _parse(
        [
            "-tp",
            "2",
            "-pcp",
            "4",
            "-dcp",
            "4",
            "-dp",
            "2",
            "--dcp-comm-backend",
            "a2a",
            "--cp-kv-cache-interleave-size",
            "8",
            "--enable-expert-parallel",
            "--kv-cache-dtype",
            "fp8_ds_mla",
            "--attention-config",
            '{"sparse_mla_force_mqa": true}',
            "--kv-offloading-size",
            "16",
            "--speculative-config",
            '{"method":"mtp","num_speculative_tokens":3}',
            "--kv-transfer-config",
            '{"kv_connector":"NixlConnector","kv_role":"kv_both"}',
            "--max-num-batched-tokens",
            "4096",
            "--max-num-seqs",
            "8",
            "--no-enable-prefix-caching",
        ]
    )
    assert (
        ea.tensor_parallel_size,
        ea.prefill_context_parallel_size,
        ea.decode_context_parallel_size,
        ea.data_parallel_size,
    ) == (2, 4, 4, 2)
    assert (
        ea.dcp_comm_backend == "a2a"
        and ea.cp_kv_cache_interleave_size == 8
        and ea.enable_expert_parallel
    )
    assert ea.kv_offloading_size == 16 and not ea.enable_prefix_caching


@pytest.mark.parametrize(
    "argv,match",
    [
        (
            ["-pcp", "2", "-dcp", "3"],
            "--decode-context-parallel-size 3 .*--prefill-context-parallel-size 2",
        ),
        (
            ["-tp", "2", "-dcp", "4"],
            "--decode-context-parallel-size 4 must divide --tensor-parallel-size 2",
        ),
        (["--dcp-comm-backend", "nccl"], None),  # argparse choices
        (["--attention-config", "{bad json"], "--attention-config must be a JSON object"),
        (["--attention-config", '{"nope": 1}'], "--attention-config: unknown keys"),
        (["--kv-cache-dtype", "fp8_ds_mla", "--block-size", "32"], "--block-size must be 64"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["-pp", "2"], "--pipeline-parallel-size"),
        (["--max-model-len", "99999999"], "--max-model-len .* exceeds"),
        (["--max-model-len", "0"], "--max-model-len must be >= 1"),
        # the model's shapes against the parallel sizes, checked before any process starts
        (["-tp", "3"], "--tensor-parallel-size 3 does not divide the model's 4 attention heads"),
        (["-tp", "1024"], "--tensor-parallel-size 1024 does not divide"),
        (
            ["-tp", "2", "-dp", "3", "--enable-expert-parallel"],
            "splits the 8 routed experts over 6",
        ),
    ],
)
def test_invalid_flags_named(tiny_ckpt, argv, match):
    if match is None:
        with pytest.raises(SystemExit):
            _parse([tiny_ckpt, *argv])
        return
    with pytest.raises(ValueError, match=match):
        _parse([tiny_ckpt, *argv]).create_engine_config()


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="needs a machine with < 2 GPUs")
def test_more_ranks_than_gpus_refused(tiny_ckpt):
    n = torch.cuda.device_count()
    if n == 0:
        pytest.skip("no GPU: --device cuda is refused before ranks are counted")
    with pytest.raises(ValueError, match=f"need {n + 1} GPUs; this machine has {n}"):
        _parse([tiny_ckpt, "--device", "cuda", "-tp", str(n + 1)]).create_engine_config()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_refused(tiny_ckpt):
    with pytest.raises(ValueError, match="--device cuda: .* on this machine"):
        _parse([tiny_ckpt, "--device", "cuda"]).create_engine_config()


def test_cpu_default_max_model_len(tiny_ckpt):
    from vllm.engine.arg_utils import CPU_DEFAULT_MAX_MODEL_LEN

    cfg = _parse([tiny_ckpt, "--device", "cpu"]).create_engine_config()
    assert cfg.model_config.max_model_len == CPU_DEFAULT_MAX_MODEL_LEN
    cfg = _parse([tiny_ckpt, "--device", "cpu", "--max-model-len", "100000"])
    assert cfg.create_engine_config().model_config.max_model_len == 100000


def test_default_step_budget(tiny_ckpt):
    """Upstream's: 2048 tokens per step on CPU and small GPUs, 8192 on GPUs of >= 70 GiB; the
    flag wins; without chunked prefill a step holds a whole prompt."""
    cfg = _parse([tiny_ckpt, "--device", "cpu"]).create_engine_config()
    assert cfg.scheduler_config.max_num_batched_tokens == 2048
    cfg = _parse([tiny_ckpt, "--device", "cpu", "--max-num-batched-tokens", "300"])
    assert cfg.create_engine_config().scheduler_config.max_num_batched_tokens == 300
    cfg = _parse(
        [tiny_ckpt, "--device", "cpu", "--max-model-len", "4000", "--no-enable-chunked-prefill"]
    )
    assert cfg.create_engine_config().scheduler_config.max_num_batched_tokens == 4000
    if torch.cuda.is_available():
        big = torch.cuda.get_device_properties(0).total_memory >= 70 * 2**30
        cfg = _parse([tiny_ckpt, "--device", "cuda"]).create_engine_config()
        assert cfg.scheduler_config.max_num_batched_tokens == (8192 if big else 2048)


def test_unknown_model_folder(tmp_path):
    with pytest.raises(ValueError, match="no such folder"):
        _parse([str(tmp_path / "missing")]).create_engine_config()


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["-tp", "2", "-dcp", "4"], "--decode-context-parallel-size 4"),
        (["-tp", "1024"], "--tensor-parallel-size 1024"),
        (["-tp", "3"], "--tensor-parallel-size 3"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
        (
            ["--async-scheduling", "--speculative-config", '{"method":"mtp"}'],
            "--async-scheduling is not supported with --speculative-config",
        ),
        pytest.param(
            ["--device", "cuda"],
            "--device cuda",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs no CUDA"),
        ),
    ],
)
def test_serve_startup_error_names_flag(tiny_ckpt, argv, flag):
    """`vllm serve` with a bad combination: one line naming the flag, exit 2, before any engine
    or worker process exists (the check runs in the server process ahead of the spawn)."""
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", tiny_ckpt, *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - t0
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and flag in errors[0], r.stderr[-2000:]
    assert "starting engine" not in r.stderr and "Traceback" not in r.stderr
    print(f"{argv}: refused in {took:.1f} s")


def test_tiny_checkpoint_command(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "tiny-checkpoint", str(tmp_path / "t")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and (tmp_path / "t" / "config.json").exists()


def test_async_scheduling_flag(tiny_ckpt):
    assert not _parse([tiny_ckpt]).create_engine_config().scheduler_config.async_scheduling
    cfg = _parse([tiny_ckpt, "--async-scheduling"]).create_engine_config()
    assert cfg.scheduler_config.async_scheduling
    assert not _parse([tiny_ckpt, "--no-async-scheduling"]).async_scheduling


def test_speculative_config_flag(tiny_ckpt):
    cfg = _parse(
        [tiny_ckpt, "--speculative-config", '{"method":"mtp","num_speculative_tokens":3}']
    ).create_engine_config()
    assert cfg.num_spec_tokens == 3 and cfg.speculative_config.method == "mtp"


NOT_LANDED = [
    (
        [
            "--kv-transfer-config",
            '{"kv_connector":"NixlConnector","kv_role":"kv_both"}',
            "--attention-config",
            '{"hisparse_config": {"host_pool_gib": 0.01}}',
        ],
        "--kv-transfer-config",
    ),
]


@pytest.mark.parametrize("argv,flag", NOT_LANDED, ids=[f for _, f in NOT_LANDED])
def test_unlanded_feature_fails_saying_so(tiny_ckpt, argv, flag):
    with pytest.raises(NotImplementedError, match=f"not implemented yet.*{flag}"):
        _parse([tiny_ckpt, *argv]).create_engine_config()
