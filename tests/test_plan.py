"""`vllm plan`: the seed's arithmetic from the GLM-5.3 config, config folders, JSON, bad input.

Tolerances: byte counts and FLOP/byte are exact arithmetic, compared to the seed's printed
rounding (53.4 GiB, 6.7 GiB, ~26, ~191). The indexer crossover is the exact causal-prefill
solution (31,271 and 257,606 tokens); the seed rounds it to ~32K and ~256K, so we allow 5 %.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from vllm.config.arch import GLM_5_3, ModelArch
from vllm.entrypoints.cli import plan as cli
from vllm.kv_cache_interface import kv_bytes_per_token
from vllm.model_executor.tiny import TINY_CONFIG
from vllm.plan import (
    GiB,
    Layout,
    PlanInputs,
    causal_prefill_flops,
    dcp_prefill_allgather_bytes,
    indexer_crossover_tokens,
    indexer_flops_per_key,
    make_plan,
    mla_flops_per_row_head,
    parse_layout,
    parse_tokens,
    pcp_allgather_bytes,
    request_kv_bytes,
    sparse_mla_flop_per_byte,
    token_bytes,
)

MILLION = 1_048_576


@pytest.fixture(scope="module")
def glm() -> ModelArch:
    return ModelArch.from_dict(GLM_5_3)


def _by_layout(plan: dict) -> dict[str, dict]:
    return {row["layout"]: row for row in plan["layouts"]}


# ---- the seed's numbers --------------------------------------------------------------------
def test_kv_bytes_per_token(glm):
    assert token_bytes(glm, "fp8_ds_mla", mtp=True) == 54_728 == kv_bytes_per_token(glm, "fp8")
    assert token_bytes(glm, "fp8_ds_mla", mtp=False) == 54_728 - 788
    assert make_plan(glm, [Layout(dp=8)])["kv_bytes_per_token"] == 54_728


def test_million_token_request(glm):
    assert round(request_kv_bytes(glm, MILLION, "fp8_ds_mla", True) / GiB, 1) == 53.4
    assert round(request_kv_bytes(glm, MILLION, "fp8_ds_mla", True, dcp=8) / GiB, 1) == 6.7
    plan = make_plan(glm, [parse_layout("PCP8xDCP8")], inputs=PlanInputs(context_tokens=MILLION))
    assert round(plan["request_kv_gib"], 1) == 53.4
    row = plan["layouts"][0]
    assert round(row["request_kv_gib_per_gpu"], 1) == 6.7
    assert row["max_context_tokens"] == MILLION  # DCP8 holds a 1M request in 15 GiB
    # without DCP, 15 GiB holds floor(15 GiB / (64·54,728 B)) blocks of 64 tokens
    pcp = make_plan(glm, [parse_layout("PCP8")])["layouts"][0]
    assert pcp["max_context_tokens"] == (15 * GiB // (64 * 54_728)) * 64 == 294_272


def test_flop_per_byte(glm):
    assert mla_flops_per_row_head(glm) == 2176
    assert round(sparse_mla_flop_per_byte(glm, heads=8)) == 26
    assert round(sparse_mla_flop_per_byte(glm, heads=64)) == 191
    rows = _by_layout(make_plan(glm, [parse_layout(s) for s in ("TP8", "PCP8", "DP8")]))
    assert round(rows["TP8"]["flop_per_byte_prefill"]) == 26
    assert round(rows["PCP8"]["flop_per_byte_prefill"]) == 191
    assert rows["DP8"]["heads_per_gpu"] == 64


def test_indexer_crossover(glm):
    tp8 = indexer_crossover_tokens(glm, heads=8)
    pcp8 = indexer_crossover_tokens(glm, heads=64)
    assert tp8 == pytest.approx(32 * 1024, rel=0.05)
    assert pcp8 == pytest.approx(256 * 1024, rel=0.05)
    # large-L limit 2·k·c_M/c_I: mean causal context L/2, 21 indexer layers against 78 MLA layers
    c_m = glm.num_hidden_layers * mla_flops_per_row_head(glm) * 8
    c_i = glm.num_full_layers * indexer_flops_per_key(glm)
    assert 2 * glm.index_topk * c_m / c_i == pytest.approx(32_329, abs=1)
    # the crossover is where the summed causal-prefill FLOPs swap order
    for heads, cross in ((8, tp8), (64, pcp8)):
        idx, mla = causal_prefill_flops(glm, cross - 10, heads)
        assert idx < mla
        idx, mla = causal_prefill_flops(glm, cross + 10, heads)
        assert idx > mla
    rows = _by_layout(make_plan(glm, [parse_layout(s) for s in ("TP8", "PCP8", "PCP8xDCP8")]))
    assert rows["TP8"]["indexer_crossover_tokens"] == tp8
    assert (
        rows["PCP8"]["indexer_crossover_tokens"]
        == pcp8
        == rows["PCP8xDCP8"]["indexer_crossover_tokens"]
    )


def test_allgather_bytes(glm):
    full, shared = pcp_allgather_bytes(glm, 2048, 8, "fp8_ds_mla")
    assert full == 2048 * 7 / 8 * (656 + 132) and shared == 2048 * 7 / 8 * 656
    full, _ = dcp_prefill_allgather_bytes(glm, 248 * 1024, 8, "fp8_ds_mla")
    assert full == 248 * 1024 * 7 / 8 * 788
    rows = _by_layout(make_plan(glm, [parse_layout("DP8"), parse_layout("PCP8xDCP8")]))
    assert rows["DP8"]["pcp_allgather_mb_per_layer"] == 0 == rows["DP8"]["dcp_decode_ms_per_step"]
    dcp = rows["PCP8xDCP8"]
    assert dcp["pcp_allgather_mb_per_layer"] == pytest.approx(2048 * 7 / 8 * 788 / 1e6)
    # 22 layers with an indexer (21 + MTP) and 57 without, at 450 GB/s
    total = 22 * 2048 * 7 / 8 * 788 + 57 * 2048 * 7 / 8 * 656
    assert dcp["pcp_allgather_ms_per_chunk"] == pytest.approx(1e3 * total / 450e9)
    assert dcp["dcp_decode_ms_per_step"] > 0


def test_hisparse_capacity(glm):
    ctx = PlanInputs(context_tokens=MILLION, host_pool_gib=64.0)
    rows = _by_layout(make_plan(glm, [parse_layout("DP8"), parse_layout("DP8+HS")], inputs=ctx))
    assert rows["DP8"]["concurrency"] == 0  # 53.4 GiB does not fit in 15 GiB
    hs = rows["DP8+HS"]
    # the pool holds the 79 MLA rows per token; indexer keys and the hot set stay on the GPU
    assert hs["max_context_fit_tokens"] == int(64 * GiB // (79 * 656))
    assert hs["max_context_tokens"] == MILLION and hs["concurrency"] == 8


# ---- weights -------------------------------------------------------------------------------
def test_weights_per_gpu_glm_fp8_ep8(glm):
    """GLM-5.3 FP8 at the seed's EP8 deployments (attention replicated): routed experts
    75 MoE layers × 256 / 8 experts × 3 × 2048 × 6144 e4m3 bytes + one fp32 scale per 128×128
    tile = 90.6 GB per GPU; the rest (attention 14.2 GB, of which 2.3 GB are the bf16 absorbed
    W_UK/W_UV that replace kv_b_proj, shared experts 2.8, dense MLP 0.7, bf16 embeddings and
    lm_head 3.8, router and norms 0.5) is replicated: 112.6 GB = 104.9 GiB per GPU, inside an
    H200's 139 GiB with 16.2 GiB left for KV at --gpu-memory-utilization 0.9. bf16 needs 204 GiB:
    it does not fit."""
    inputs = PlanInputs(mtp=False)
    layouts = [parse_layout(s) for s in ("DP8xEP8", "PCP8xDCP8xEP8", "DP8", "TP8")]
    rows = _by_layout(make_plan(glm, layouts, inputs=inputs))
    dec, pre = rows["DP8xEP8"], rows["PCP8xDCP8xEP8"]
    routed = 75 * 256 // 8 * (3 * 2048 * 6144 + 3 * 16 * 48 * 4)
    assert dec["weights_fp8_by_kind_gib"]["routed experts"] * GiB == pytest.approx(routed)
    assert 102 < dec["weights_fp8_gib"] < 112  # 104.9 GiB = 112.6 GB: the "~110 GB"
    assert 198 < dec["weights_bf16_gib"] < 215
    assert pre["weights_fp8_gib"] == dec["weights_fp8_gib"]  # PCP/DCP shard no weights
    assert dec["kv_room_fp8_gib"] == pytest.approx(139 * 0.9 - dec["weights_fp8_gib"] - 4)
    assert dec["fits_fp8"] and not dec["fits_bf16"]
    assert not rows["DP8"]["fits_fp8"]  # every expert on every GPU: 700 GiB
    assert rows["TP8"]["fits_fp8"] and rows["TP8"]["weights_fp8_gib"] < dec["weights_fp8_gib"]
    whole = make_plan(glm, layouts[:1], inputs=inputs)["weights_gb"]
    assert whole["fp8"]["routed experts"] == pytest.approx(725.0, abs=0.5)
    assert 19 < sum(whole["fp8"].values()) - whole["fp8"]["routed experts"] < 27


def test_cli_prints_weights(capsys):
    assert cli.main(["--layouts", "DP8xEP8", "PCP8xDCP8xEP8", "--no-mtp"]) == 0
    out = capsys.readouterr().out
    assert "weights per GPU, FP8 (GiB)" in out and "104.90" in out
    assert "fits an H200: FP8 / bf16" in out and "yes / no" in out
    assert cli.main(["--dp", "8", "--ep", "8", "--no-mtp", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["layouts"][0]
    assert row["layout"] == "DP8xEP8" and row["fits_fp8"]


# ---- parsing -------------------------------------------------------------------------------
def test_parse_layout_and_tokens():
    assert parse_layout("PCP8×DCP8") == Layout(pcp=8, dcp=8)
    assert parse_layout("dp8+hs") == Layout(dp=8, hisparse=True)
    assert parse_layout("TP2xPCP4").name == "TP2xPCP4"
    assert parse_tokens("1M") == MILLION and parse_tokens("128K") == 131_072
    assert parse_tokens("2,048") == 2048
    assert parse_layout("PCP8xDCP8xEP8") == Layout(pcp=8, dcp=8, ep=8)
    assert parse_layout("DP8×EP8").name == "DP8xEP8"
    for bad in ("PCP8yDCP8", "", "TP8xTP2", "EP8"):
        with pytest.raises(ValueError, match="bad layout"):
            parse_layout(bad)


# ---- the command ---------------------------------------------------------------------------
def test_cli_table_and_json(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert "54,728" in out and "PCP8xDCP8" in out
    assert cli.main(["--json", "--context", "1M"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_bytes_per_token"] == 54_728
    assert [r["layout"] for r in plan["layouts"]] == ["DP8xEP8", "TP8", "PCP8xEP8", "PCP8xDCP8xEP8"]
    assert plan["layouts"][0]["fits_fp8"] and not plan["layouts"][0]["fits_bf16"]


def test_cli_model_folder(tmp_path, capsys):
    with open(tmp_path / "config.json", "w") as f:
        json.dump(TINY_CONFIG, f)
    argv = [str(tmp_path), "--layouts", "DP2,TP2", "PCP2xDCP2+HS", "--context", "256", "--json"]
    assert cli.main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    tiny = ModelArch.from_dict(TINY_CONFIG)
    assert plan["kv_bytes_per_token"] == kv_bytes_per_token(tiny, "fp8_ds_mla")
    assert plan["arch"]["num_layers"] == TINY_CONFIG["num_hidden_layers"]
    rows = _by_layout(plan)
    assert rows["TP2"]["heads_per_gpu"] == TINY_CONFIG["num_attention_heads"] // 2
    assert rows["PCP2xDCP2+HS"]["hisparse"]


def test_add_parser_on_subparsers(capsys):
    parser = argparse.ArgumentParser(prog="vllm")
    cli.add_parser(parser.add_subparsers(dest="subcommand"))
    args = parser.parse_args(["plan", "--pcp", "8", "--dcp", "8", "--json"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["layouts"][0]["layout"] == "PCP8xDCP8"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["/nonexistent/model-folder"], "not found"),
        (["--layouts", "PCP8yDCP8"], "bad layout"),
        (["--layouts", "DP8xDCP8"], "must divide"),
        (["--tp", "3"], "does not divide"),
        (["--tp", "8", "--layouts", "DP8"], "not both"),
        (["--context", "2M"], "max_position_embeddings"),
        (["--context", "lots"], "bad token count"),
        (["--hisparse", "--host-pool-gib", "512"], "exceeds the host memory"),
        (["--kv-cache-dtype", "int4"], "--kv-cache-dtype"),
        (["--layouts", "DP8xEP4"], "must span every GPU"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    ],
)
def test_cli_bad_input(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_folder_without_config(tmp_path, capsys):
    assert cli.main([str(tmp_path)]) == 2
    assert "config.json" in capsys.readouterr().err


def test_standalone_module_bad_layout():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    proc = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli.plan", "--layouts", "PCP8yDCP8"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 2
    assert "bad layout" in proc.stderr and "Traceback" not in proc.stderr
