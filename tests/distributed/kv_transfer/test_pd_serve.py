"""P/D disaggregation end to end (SPEC §7): the real vllm-router in P/D mode in front of a prefill
engine (kv_producer) and a decode engine (kv_consumer) joined by real NIXL over UCX loopback,
driven by the real OpenAI client. Greedy text equals one engine's, streamed or not, for prefill
DCP1 → decode DCP1, PCP2×DCP2 → DCP1, PCP2×DCP2 → DCP2 and PCP2×DCP2 → DP2 (+EP2), and into the
host pool of a HiSparse decode engine (DCP1 → HiSparse, PCP2×DCP2 → HiSparse and PCP2×DCP2 →
HiSparse DP2 + EP2, GPU pools smaller than the prompts), and with MTP3 on both sides (PCP2×DCP2 →
HiSparse, the seed's deployment: the MTP layer's KV moves too); the decode engine receives exactly the KV of the prompt positions it does not compute (its counter); leases
are released (the prefill engine's blocks return to zero); a prefill engine killed before its KV
is pulled leaves the decode engine recomputing (same text) or failing the request within seconds,
with no block left in use.

Servers are started once per module, in parallel, and shared by the tests (CI has two cores)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from tests.distributed.kv_transfer.requirements import require_nixl, require_router
from tests.utils import RemoteServer

require_nixl()
ROUTER = require_router()

pytestmark = pytest.mark.distributed

MAX_TOKENS = 12
EXTRA = {"ignore_eos": True}


def _free_port() -> int:
    return _free_port_range(1)


def _free_port_range(n: int) -> int:
    from tests.distributed.kv_transfer.nixl_harness import free_port_range

    return free_port_range(n)


def _kv(role: str, **kw) -> list[str]:
    return [
        "--kv-transfer-config",
        json.dumps({"kv_connector": "NixlConnector", "kv_role": role, **kw}),
    ]


class Router:
    """``vllm-router --vllm-pd-disaggregation`` (cache-aware policy, its default) in front of
    one prefill and one decode engine."""

    def __init__(self, prefill: RemoteServer, decode: RemoteServer):
        self.port = _free_port()
        cmd = [ROUTER, "--vllm-pd-disaggregation", "--prefill", prefill.url, "--decode",
               decode.url, "--host", "127.0.0.1", "--port", str(self.port),
               "--prometheus-port", str(_free_port()), "--worker-startup-check-interval", "1",
               "--log-level", "warning"]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert self.proc.poll() is None, f"vllm-router exited with {self.proc.returncode}"
            assert time.monotonic() < deadline, "vllm-router did not become healthy"
            time.sleep(0.25)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _metric(server: RemoteServer, name: str) -> float:
    text = requests.get(server.url + "/metrics", timeout=5).text
    vals = [float(m) for m in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)]
    return sum(vals)


def _wait_metric(server: RemoteServer, name: str, want: float, timeout_s: float = 15.0) -> float:
    deadline = time.monotonic() + timeout_s
    while (v := _metric(server, name)) != want and time.monotonic() < deadline:
        time.sleep(0.2)
    return v


@pytest.fixture(scope="module")
def engines(tiny_ckpt):
    """ref: one engine; p1: prefill DCP1 (kv_both, upstream's usual role) with the CPU offload
    tier beside NIXL, --async-scheduling; p2: prefill PCP2×DCP2; d1: decode DCP1 (kv_both,
    recompute, --async-scheduling);
    d2: decode TP2×DCP2 (fail); ddp: decode DP2 + EP2; dhs, dhsdp: HiSparse decode (one rank,
    and DP2 + EP2) whose GPU pool (6 blocks) is smaller than the prompts' pages; pm → dhsm: the
    same PCP2×DCP2 → HiSparse with MTP3 on both engines."""
    ckpt = [tiny_ckpt, "--enable-prompt-tokens-details"]
    hisparse = ["--attention-config", json.dumps({"hisparse_config": {"host_pool_gib": 0.05}}),
                "--num-gpu-blocks-override", "6", "--max-num-batched-tokens", "128"]  # fmt: skip
    mtp = ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 3})]
    specs = {
        "ref": ckpt,
        "p1": ckpt
        + ["--kv-offloading-size", "0.02", "--async-scheduling"]
        + _kv("kv_both", side_channel_port=_free_port_range(1)),
        "p2": ckpt
        + ["-pcp", "2", "-dcp", "2"]
        + _kv("kv_producer", side_channel_port=_free_port_range(2)),
        "d1": ckpt + ["--async-scheduling"] + _kv("kv_both", side_channel_port=_free_port_range(1)),
        "d2": ckpt
        + ["-tp", "2", "-dcp", "2"]
        + _kv("kv_consumer", kv_load_failure_policy="fail", kv_load_timeout_s=10),
        "ddp": ckpt
        + ["--data-parallel-size", "2", "--enable-expert-parallel"]
        + _kv("kv_consumer"),
        "dhs": ckpt + hisparse + _kv("kv_consumer"),
        "pm": ckpt
        + ["-pcp", "2", "-dcp", "2"]
        + mtp
        + _kv("kv_producer", side_channel_port=_free_port_range(2)),
        "dhsm": ckpt + hisparse + mtp + _kv("kv_consumer"),
        "dhsdp": ckpt
        + hisparse
        + ["--data-parallel-size", "2", "--enable-expert-parallel"]
        + _kv("kv_consumer"),
    }
    with ThreadPoolExecutor(len(specs)) as pool:
        futs = {k: pool.submit(RemoteServer, a, startup_timeout=300) for k, a in specs.items()}
        servers, errors = {}, []
        for k, f in futs.items():  # every start is awaited: none may outlive a failed one
            try:
                servers[k] = f.result()
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        if errors:
            for s in servers.values():
                s.stop()
            raise errors[0]
    routers = {pair: Router(servers[pair[0]], servers[pair[1]]) for pair in PAIRS}
    ref = openai.OpenAI(base_url=servers["ref"].base_url, api_key="x", max_retries=0)
    yield servers, routers, ref
    for r in routers.values():
        r.stop()
    for s in servers.values():
        s.stop()


def _prompt(tag: int, n: int) -> list[int]:
    """A prompt of n token ids, different for every tag (no prefix-cache hit across tests)."""
    return [(tag * 37 + i * 11) % 900 + 20 for i in range(n)]


def _complete(client, prompt, stream=False) -> tuple[str, dict | None]:
    kw = dict(model=client.models.list().data[0].id, prompt=prompt, max_tokens=MAX_TOKENS,
              temperature=0, extra_body=EXTRA)  # fmt: skip
    if not stream:
        r = client.completions.create(**kw)
        return r.choices[0].text, (r.model_extra or {}).get("kv_transfer_params")
    chunks = list(client.completions.create(stream=True, **kw))
    return "".join(c.choices[0].text for c in chunks if c.choices), None


PAIRS = [("p1", "d1"), ("p2", "d1"), ("p2", "d2"), ("p2", "ddp"), ("p1", "dhs"), ("p2", "dhs"),
         ("p2", "dhsdp"), ("pm", "dhsm")]  # fmt: skip


@pytest.mark.timeout(600)
@pytest.mark.parametrize("pair", PAIRS, ids=["dcp1-dcp1", "pcp2dcp2-dcp1", "pcp2dcp2-dcp2",
                                             "pcp2dcp2-dp2ep2", "dcp1-hisparse",
                                             "pcp2dcp2-hisparse", "pcp2dcp2-hisparse-dp2ep2",
                                             "pcp2dcp2-mtp3-hisparse-mtp3"])  # fmt: skip
def test_router_greedy_equals_one_engine_and_moves_owned_kv(engines, tiny_ckpt, pair):
    servers, routers, ref = engines
    router, decode = routers[pair], servers[pair[1]]
    per_token = _kv_bytes_per_token(tiny_ckpt, num_mtp_layers=int(pair[0] == "pm"))
    tag = PAIRS.index(pair) * 10
    for k, (n, stream) in enumerate([(150, False), (9, False), (130, True)]):
        prompt = _prompt(tag + k, n)
        before = _metric(decode, "vllm:kv_transfer_recv_bytes_total")
        text, _ = _complete(router.client, prompt, stream)
        assert text == _complete(ref, prompt)[0], (pair, n, stream)
        # the decode engine computes the last prompt token; every other position's KV crossed
        # once (each decode rank received only the rows it owns)
        got = _metric(decode, "vllm:kv_transfer_recv_bytes_total") - before
        assert got == (n - 1) * per_token, (pair, n, got)
    if pair[1] == "dhs":  # the received complete pages are now the host pool's prefix cache
        prompt = _prompt(tag, 150)
        c = openai.OpenAI(base_url=decode.base_url, api_key="x", max_retries=0)
        r = c.completions.create(model=c.models.list().data[0].id, prompt=prompt,
                                 max_tokens=MAX_TOKENS, temperature=0, extra_body=EXTRA)  # fmt: skip
        assert r.choices[0].text == _complete(ref, prompt)[0]
        assert r.usage.prompt_tokens_details.cached_tokens == 128
    # every decode rank confirmed: the prefill engine's leases are released
    assert _wait_metric(servers[pair[0]], "vllm:kv_cache_usage_perc", 0.0) == 0.0
    if pair[0] == "p1":  # its offload tier took the prompts' full blocks while NIXL leased them
        assert _metric(servers["p1"], "vllm:kv_offload_stored_blocks_total") >= 150 // 64
    assert _wait_metric(decode, "vllm:kv_cache_usage_perc", 0.0) == 0.0


@pytest.mark.timeout(300)
def test_router_chat_stream_and_whole(engines):
    servers, routers, ref = engines
    c = routers[("p1", "d1")].client
    name = c.models.list().data[0].id
    for i, stream in enumerate((False, True)):
        msgs = [{"role": "user", "content": f"Tell me about disaggregated serving, take {i}."}]
        kw = dict(model=name, messages=msgs, max_tokens=MAX_TOKENS, temperature=0, extra_body=EXTRA)
        want = ref.chat.completions.create(**kw).choices[0].message.content
        if stream:
            chunks = list(c.chat.completions.create(stream=True, **kw))
            got = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        else:
            got = c.chat.completions.create(**kw).choices[0].message.content
        assert got == want


@pytest.mark.timeout(300)
def test_render_endpoints_speak_upstream_schema(engines):
    servers, _, _ = engines
    url = servers["p1"].base_url
    r = requests.post(url + "/completions/render", json={"prompt": [5, 6, 7], "max_tokens": 3})
    assert r.status_code == 200
    (gen,) = r.json()  # one GenerateRequest per prompt
    assert gen["token_ids"] == [5, 6, 7] and gen["sampling_params"]["max_tokens"] == 3
    assert gen["request_id"].startswith("cmpl-")
    msgs = [{"role": "user", "content": "hi"}]
    r = requests.post(url + "/chat/completions/render", json={"messages": msgs, "stream": True})
    assert r.status_code == 200 and r.json()["token_ids"] and r.json()["stream"] is True


@pytest.mark.timeout(300)
def test_killed_prefill_engine_recompute_or_fail(engines, tiny_ckpt):
    """The prefill engine dies holding a finished request's KV (leased, not yet pulled): the
    decode engine with ``recompute`` gives the same greedy text; with ``fail`` the client gets
    the error within seconds; neither keeps a block."""
    servers, _, ref = engines
    p1 = servers["p1"]
    prompt = _prompt(99, 140)
    pc = openai.OpenAI(base_url=p1.base_url, api_key="x", max_retries=0)
    r = pc.completions.create(
        model=pc.models.list().data[0].id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"kv_transfer_params": {"do_remote_decode": True}},
    )  # fmt: skip
    params = r.model_extra["kv_transfer_params"]
    assert params["do_remote_prefill"] and len(r.choices[0].text) > 0
    assert r.usage.completion_tokens == 1  # a prefill request stops after its prefill
    os.killpg(p1.proc.pid, signal.SIGKILL)
    p1.proc.wait(10)
    want = _complete(ref, prompt)[0]

    kw = dict(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
              extra_body={**EXTRA, "kv_transfer_params": params})  # fmt: skip
    for name in ("d1", "dhs"):  # dhs: a HiSparse decode engine recomputes the whole prompt
        d = openai.OpenAI(base_url=servers[name].base_url, api_key="x", max_retries=0)
        got = d.completions.create(model=d.models.list().data[0].id, **kw).choices[0].text
        assert got == want, name
        assert _metric(servers[name], "vllm:kv_transfer_num_failed_loads_total") >= 1, name

    d2 = openai.OpenAI(base_url=servers["d2"].base_url, api_key="x", max_retries=0)
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError, match="KV transfer of request .* failed"):
        d2.completions.create(model=d2.models.list().data[0].id, **kw)
    assert time.monotonic() - t0 < 10  # refused at once (the side channel is gone)
    for name in ("d1", "d2", "dhs"):
        assert _wait_metric(servers[name], "vllm:kv_cache_usage_perc", 0.0) == 0.0, name


def _kv_bytes_per_token(ckpt: str, num_mtp_layers: int = 0) -> int:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.kv_cache_interface import kv_bytes_per_token

    cfg = EngineArgs(model=ckpt).create_engine_config()
    mc = cfg.model_config
    return kv_bytes_per_token(
        mc.arch, cfg.cache_config.cache_dtype, mc.dtype, num_mtp_layers=num_mtp_layers
    )
