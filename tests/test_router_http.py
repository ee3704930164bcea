"""The router's HTTP layer without engines: a fake OpenAI server and a fake conductor
(tests/router_fakes.py). Real engines: tests/test_router.py."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("aiohttp")

from kvstore.router.server import STAGES, Router, build_app  # noqa: E402
from tests.processes import wait_for  # noqa: E402
from tests.router_fakes import FakeBackend, Served, fake_engine  # noqa: E402


@pytest.fixture
def stack():
    engine_app, seen = fake_engine()
    engine = Served(engine_app)
    backend = FakeBackend(engine.url)
    router = Served(build_app(Router(backend, read_timeout=1.0, index_wait_s=0.1)))
    yield router.url, backend, seen
    router.close()
    engine.close()


def post(url: str, body, timeout: float = 20):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


@pytest.mark.parametrize(
    "body,message",
    [
        (b"not json", "JSON"),
        ([1, 2], "JSON object"),
        ({"model": "tiny"}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": ""}, "empty"),
        ({"prompt": ["a", "b"]}, "one prompt"),
        ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
        ({"prompt": [1], "stream": "yes"}, "stream"),
    ],
)
def test_bad_requests_are_400_with_an_openai_error(stack, body, message):
    url, backend, seen = stack
    status, _, data = post(f"{url}/v1/completions", body)
    assert status == 400
    assert message in json.loads(data)["error"]["message"]
    assert not backend.scheduled and not [s for s in seen if s[0] != "tokenize"]


def test_a_chat_without_messages_is_400(stack):
    url, _, _ = stack
    status, _, data = post(f"{url}/v1/chat/completions", {"model": "tiny", "messages": []})
    assert status == 400 and "messages" in json.loads(data)["error"]["message"]


def test_prefill_gets_one_token_then_decode_gets_the_request_unchanged(stack):
    url, backend, seen = stack
    body = {
        "model": "tiny",
        "prompt": list(range(1, 11)),
        "max_tokens": 5,
        "temperature": 0,
        "seed": 7,
        "stop": ["x"],
        "min_tokens": 2,
        "stream_options": {"include_usage": True},
        "custom_field": {"a": 1},
    }
    status, headers, data = post(f"{url}/v1/completions", body)
    assert status == 200
    prefill, decode = [b for path, b in seen if path == "/v1/completions"]
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False and "min_tokens" not in prefill
    assert {k: v for k, v in prefill.items() if k not in ("max_tokens", "stream", "n")} == {
        k: v for k, v in body.items() if k not in ("max_tokens", "min_tokens", "stream_options")
    }
    assert decode == body  # every field passed through as it came
    assert json.loads(data)["echo"] == body
    keys, input_length, output_length, namespace = backend.scheduled[0]
    assert (len(keys), input_length, output_length, namespace) == (2, 10, 5, "ns/layer1")  # 10 tokens: 2 blocks of 4
    assert headers["x-kvstore-prefix-tokens"] == "8" and headers["x-kvstore-decode-engine"] == "D"
    assert backend.reports == ["prefill_finished", "decode_finished"]  # prefill_started: with Schedule


def test_a_final_decode_engine_is_called_without_waiting_for_the_prefill_finished_reply():
    arrivals: list = []
    engine_app, _ = fake_engine(arrivals)
    engine = Served(engine_app)
    backend = FakeBackend(engine.url)
    router = Served(build_app(Router(backend, read_timeout=5.0, index_wait_s=0.1)))
    try:
        backend.report_delay = 0.5
        body = {"model": "tiny", "prompt": list(range(1, 11)), "max_tokens": 2, "stream": True}
        for final in (True, False):
            backend.decode_final = final
            arrivals.clear()
            backend.report_times.clear()
            status, _, _ = post(f"{router.url}/v1/completions", body)
            assert status == 200
            decode_at = next(t for path, stream, t in arrivals if stream)
            wait_for(lambda: len(backend.report_times) == 2, 10)  # reported after the answer ends
            reported_at = dict(backend.report_times)
            assert (decode_at < reported_at["prefill_finished"]) is final
            assert reported_at["prefill_finished"] < reported_at["decode_finished"]  # the conductor's order kept
    finally:
        router.close()
        engine.close()


def test_stale_engine_records_serve_while_they_are_read_again():
    engine_app, _ = fake_engine()
    engine = Served(engine_app)
    backend = FakeBackend(engine.url)
    router = Served(build_app(Router(backend, records_ttl_s=0.0)))  # stale at once
    body = {"model": "tiny", "prompt": list(range(1, 11)), "max_tokens": 2}
    try:
        assert post(f"{router.url}/v1/completions", body)[0] == 200  # the first read is waited for
        backend.engines_gate.clear()  # the pool stops answering engines()
        reads = backend.engine_reads
        assert post(f"{router.url}/v1/completions", body)[0] == 200  # served from the records held
        wait_for(lambda: backend.engine_reads == reads + 1)  # and read again beside it, once
        assert post(f"{router.url}/v1/completions", body)[0] == 200
        assert backend.engine_reads == reads + 1  # no second read while the first is out
    finally:
        backend.engines_gate.set()
        router.close()
        engine.close()


def test_the_router_waits_for_the_prompts_partial_last_block_too(stack):
    from dataclasses import replace

    from kvstore_client.vllm_hashing import VLLMBlockHasher, tail_hash

    url, backend, _ = stack
    backend.index_lag = 2  # the tail reaches the index two polls after the full blocks
    status, _, _ = post(f"{url}/v1/completions", {"model": "tiny", "prompt": list(range(1, 11)), "max_tokens": 2})
    assert status == 200
    full = VLLMBlockHasher(4).hashes(list(range(1, 11)))
    want = [("ns/layer1", h) for h in full] + [("ns/layer1", tail_hash(full[-1], [9, 10]))]
    assert backend.index_queries == [want] * 3
    assert len(backend.scheduled[0][0]) == 2  # the conductor is asked about the full blocks only
    backend.index_queries.clear()
    post(f"{url}/v1/completions", {"model": "tiny", "prompt": list(range(1, 10)), "max_tokens": 2})
    assert backend.index_queries == [want[:2]]  # a one-token tail is not stored
    backend.index_queries.clear()
    backend.records[0] = replace(backend.records[0], partial_blocks=None)  # a prefill engine that stores none
    post(f"{url}/v1/completions", {"model": "tiny", "prompt": list(range(1, 11)), "max_tokens": 2})
    assert backend.index_queries == [want[:2]]


def test_text_and_chat_prompts_are_tokenized_by_an_engine(stack):
    url, backend, seen = stack
    status, _, _ = post(f"{url}/v1/completions", {"model": "tiny", "prompt": "w1 w2 w3 w4 w5"})
    assert status == 200
    status, _, _ = post(
        f"{url}/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "w1 w2 w3 w4 w5 w6 w7 w8 w9"}], "max_tokens": 3},
    )
    assert status == 200
    tokenized = [b for path, b in seen if path == "tokenize"]
    assert tokenized[0] == {"model": "tiny", "prompt": "w1 w2 w3 w4 w5"}
    assert tokenized[1]["messages"][0]["content"].startswith("w1")
    assert [(len(k), n) for k, n, _, _ in backend.scheduled] == [(1, 5), (2, 9)]


def test_overload_is_429_with_retry_after_and_no_engine_call(stack):
    url, backend, seen = stack
    backend.overloaded = "ttft_slo"
    status, headers, data = post(f"{url}/v1/completions", {"model": "tiny", "prompt": [1, 2, 3]})
    assert status == 429
    assert headers["Retry-After"] == "1" and headers["x-kvstore-reject-reason"] == "ttft_slo"
    assert json.loads(data)["error"]["type"] == "overloaded"
    assert not [s for s in seen if s[0] != "tokenize"]


def test_an_engine_refusal_passes_through_and_the_request_is_cancelled(stack):
    url, backend, _ = stack
    status, _, data = post(f"{url}/v1/completions", {"model": "tiny", "prompt": [1, 2], "max_tokens": 500})
    assert status == 400 and json.loads(data)["error"]["message"] == "too many"  # the engine's own answer
    assert backend.reports == ["prefill_finished", "cancelled"]


def sse_events(data: bytes) -> list[str]:
    return [e for e in data.decode().split("\n\n") if e]


def test_streams_are_relayed_as_server_sent_events(stack):
    url, backend, _ = stack
    status, headers, data = post(
        f"{url}/v1/completions", {"model": "tiny", "prompt": [1, 2], "max_tokens": 3, "stream": True}
    )
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(data)
    assert events[-1] == "data: [DONE]"
    assert [json.loads(e[len("data: ") :])["choices"][0]["text"] for e in events[:-1]] == [" w0", " w1", " w2"]
    wait_for(lambda: backend.reports[-1:] == ["decode_finished"])  # reported once the stream has ended


def test_an_engine_dying_mid_stream_ends_it_with_an_error_event(stack):
    url, backend, _ = stack
    start = time.monotonic()
    status, _, data = post(
        f"{url}/v1/completions", {"model": "tiny", "prompt": [666, 2], "max_tokens": 3, "stream": True}
    )
    assert status == 200 and time.monotonic() - start < 10
    events = sse_events(data)
    assert events[0].startswith("data: ") and events[-1] == "data: [DONE]"
    assert events[-2].startswith("event: error\ndata: ")
    assert json.loads(events[-2].split("data: ", 1)[1])["error"]["code"] == 502
    wait_for(lambda: backend.reports[-1:] == ["cancelled"])


def test_a_stalled_engine_times_out_instead_of_hanging(stack):
    url, backend, _ = stack
    start = time.monotonic()
    status, _, data = post(f"{url}/v1/completions", {"model": "tiny", "prompt": [777, 2]})
    assert status == 504 and time.monotonic() - start < 10  # read timeout 1 s in the fixture
    assert json.loads(data)["error"]["type"] == "gateway_timeout"
    assert backend.reports[-1] == "cancelled"


def test_an_unreachable_engine_is_a_502(stack):
    url, backend, _ = stack
    backend.records = [r.__class__(**{**r.__dict__, "url": "http://127.0.0.1:9"}) for r in backend.records]
    status, _, data = post(f"{url}/v1/completions", {"model": "tiny", "prompt": [1, 2]})
    assert status == 502 and json.loads(data)["error"]["type"] == "bad_gateway"
    # refused before any answer: deregistered, the request tried once more (the fake conductor picks P again)
    assert backend.deregistered == [("ns/layer1", "P"), ("ns/layer1", "P")]


def engine_pool(tmp_path):
    """A real master and node, and a Client of them; stop with the returned closer."""
    from kvstore.master.server import MasterServer
    from kvstore.node.config import StoreConfig
    from kvstore.node.daemon import NodeOptions, StorageNode
    from kvstore_client import Client

    master = MasterServer(ttl_s=5.0, heartbeat_interval_s=0.2).start()
    node = StorageNode(
        StoreConfig(dram_capacity=8 << 20, max_block_bytes=1 << 20),
        NodeOptions(master=master.address, unix_socket=False, data_dir=str(tmp_path / "node")),
    ).start()
    client = Client(master.address, timeout=5)
    wait_for(lambda: client.cluster_status().nodes)

    def close():
        client.close()
        node.stop()
        master.stop(grace=0)

    return client, node.info().node_id, close


def register(client, node_id: str, engine_id: str, url: str, roles: tuple) -> None:
    """What a connector does at start (kvstore_client.vllm.engines): conductor ids and a pool record."""
    from kvstore_client.vllm.engines import record_key

    ids = {role: f"{engine_id}#{role}" for role in roles}
    for role, conductor_id in ids.items():
        client.scheduling.register_engine("vllm/layer0", conductor_id, role, node_id)
    record = {
        "engine_id": engine_id,
        "url": url,
        "role": "both" if len(roles) == 2 else roles[0],
        "ids": ids,
        "conductor_namespace": "vllm/layer0",
        "block_size": 4,
        "hash_algo": "sha256",
        "hash_seed": None,
        "model": "tiny",
    }
    client.put(record_key("vllm", engine_id), json.dumps(record).encode())


@pytest.mark.parametrize("dead_roles", [("prefill", "decode"), ("decode",)])
def test_a_killed_engine_leaves_the_conductor_and_the_request_runs_elsewhere(tmp_path, dead_roles):
    """A real conductor; fake engines. The engine registered first (the one an idle conductor
    picks) is killed: the router finds it refusing connections, deregisters it, and the same
    request succeeds on the live engine; the conductor no longer knows the dead one."""
    from kvstore.router.server import PoolBackend

    client, node_id, close_pool = engine_pool(tmp_path)
    dead_app, _ = fake_engine()
    live_app, live_seen = fake_engine()
    dead, live = Served(dead_app), Served(live_app)
    router = None
    try:
        register(client, node_id, "dead", dead.url, dead_roles)
        register(client, node_id, "live", live.url, ("prefill", "decode"))
        dead.close()  # killed: its port refuses connections, nobody deregisters it
        backend = PoolBackend(client, "vllm")
        wait_for(lambda: len(backend.engines()) == 2)  # the records are indexed
        routing = Router(backend, read_timeout=5.0, index_wait_s=0.1)
        router = Served(build_app(routing))
        for i in range(3):
            status, headers, data = post(
                f"{router.url}/v1/completions", {"model": "tiny", "prompt": [i + 1] * 9, "max_tokens": 2}
            )
            assert status == 200, data
            assert headers["x-kvstore-prefill-engine"] == "live#prefill"
            assert headers["x-kvstore-decode-engine"] == "live#decode"
        assert routing.metrics.requests.get("engine_unreachable") == 1  # found once, then never picked again
        assert routing.metrics.requests.get("ok") == 3
        # a prefill and a decode each; a dead decode engine is found after its request's prefill, which
        # the retry, scheduled afresh, runs again
        assert len([p for p, _ in live_seen if p == "/v1/completions"]) == 6 + (dead_roles == ("decode",))
        for role in dead_roles:  # the conductor no longer lists it
            assert client.scheduling.deregister_engine("vllm/layer0", f"dead#{role}").known is False
    finally:
        if router is not None:
            router.close()
        live.close()
        close_pool()


def test_models_health_and_metrics(stack):
    url, _, _ = stack
    post(f"{url}/v1/completions", {"model": "tiny", "prompt": [1, 2, 3, 4, 5]})
    with urllib.request.urlopen(f"{url}/v1/models") as resp:
        assert [m["id"] for m in json.load(resp)["data"]] == ["tiny"]
    with urllib.request.urlopen(f"{url}/health") as resp:
        assert json.load(resp) == {"status": "ok", "engines": 2}
    with urllib.request.urlopen(f"{url}/metrics") as resp:
        text = resp.read().decode()
    assert 'kvstore_router_requests_total{outcome="ok"} 1' in text
    assert "kvstore_router_prefix_tokens_total 4" in text


def test_metrics_time_every_stage_of_a_streamed_request(stack):
    url, _, _ = stack
    for _ in range(2):
        post(f"{url}/v1/completions", {"model": "tiny", "prompt": [1, 2, 3, 4, 5], "max_tokens": 2, "stream": True})
    with urllib.request.urlopen(f"{url}/metrics") as resp:
        lines = resp.read().decode().splitlines()
    for stage in STAGES:
        seconds = next(
            line for line in lines if line.startswith(f'kvstore_router_stage_seconds_total{{stage="{stage}"}}')
        )
        assert float(seconds.rsplit(" ", 1)[1]) > 0, stage
        assert f'kvstore_router_stage_total{{stage="{stage}"}} 2' in lines, stage


def test_connector_role_keys_are_checked_at_start():
    from kvstore_client.errors import ConfigError
    from kvstore_client.vllm.engines import conductor_ids, engine_of
    from kvstore_client.vllm.settings import read_settings

    s = read_settings({"master": "m:1", "role": "prefill", "engine_url": "http://h:8001/"}, "kv_both")
    assert (s.role, s.engine_url, s.engine_id, s.load_report_interval) == (
        "prefill",
        "http://h:8001",
        "http://h:8001",
        0.5,
    )
    assert read_settings({"master": "m:1"}, "kv_both").role is None
    for extra, message in (
        ({"role": "decode"}, "engine_url"),
        ({"role": "mixed", "engine_url": "http://h:1"}, "role"),
        ({"engine_url": "h:1"}, "engine_url"),
        ({"engine_url": "http://h:1", "engine_id": "a#b"}, "engine_id"),
        ({"load_report_interval": 0}, "load_report_interval"),
        ({"rol": "decode"}, "unknown"),
    ):
        with pytest.raises(ConfigError, match=message):
            read_settings({"master": "m:1", **extra}, "kv_both")
    assert conductor_ids("E", "both") == {"prefill": "E#prefill", "decode": "E#decode"}
    assert engine_of("E#decode") == "E" and conductor_ids("E", "decode") == {"decode": "E"}


def test_an_engine_registers_on_a_live_node_of_its_own_machine_first():
    from kvstore_client.errors import KVStoreError
    from kvstore_client.proto import kvstore_pb2 as pb
    from kvstore_client.vllm.engines import local_node

    def status(*nodes):
        return pb.ClusterStatusReply(
            nodes=[pb.NodeStatus(info=pb.NodeInfo(node_id=n, machine_id=m), alive=a) for n, m, a in nodes]
        )

    assert local_node(status(("a", "other", True), ("b", "me", False), ("c", "me", True)), "me") == "c"
    assert local_node(status(("a", "other", True)), "me") == "a"
    with pytest.raises(KVStoreError):
        local_node(status(("a", "me", False)), "me")


def test_the_load_tracker_counts_waiting_and_running_requests():
    from types import SimpleNamespace

    from kvstore_client.vllm.engines import LoadTracker

    tracker = LoadTracker()
    a, b = SimpleNamespace(request_id="a", num_tokens=100), SimpleNamespace(request_id="b", num_tokens=40)
    tracker.seen(a), tracker.seen(b), tracker.allocated(a), tracker.seen(a)  # seen again: still running
    assert tracker.load() == {"queue_length": 2, "running_batch": 1, "context_tokens": 100}
    tracker.finished("a"), tracker.finished("b")
    assert tracker.load() == {"queue_length": 0, "running_batch": 0, "context_tokens": 0}


def test_the_router_runs_on_uvloop_where_it_is_installed():
    uvloop = pytest.importorskip("uvloop")
    from kvstore.cli import router_event_loop

    loop = router_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()
