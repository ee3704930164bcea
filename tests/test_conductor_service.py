"""The Conductor gRPC service in process (no storage nodes): load reports by role, deregistration,
request TTLs on an injected clock, and rejection reasons as a field."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from click.testing import CliRunner

from kvstore.cli import main, start_master
from kvstore.master.conductor_service import ConductorServicer, SchedulingOptions
from kvstore.master.index import PrefixIndex
from kvstore.scheduler import SimClock
from kvstore_client import BlockHasher, Client, Overloaded
from kvstore_client.errors import ConfigError
from kvstore_client.proto import kvstore_pb2 as pb
from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc
from kvstore_client.scheduling import SchedulingCalls, rejection_of

NS = "model-a"
KEYS = BlockHasher(NS, 16).keys(list(range(64)))
NODES = ("node-p0", "node-p1", "node-d0")  # the storage nodes engines() puts its engines on


@pytest.fixture
def serve():
    """serve(**options) -> (calls, conductor servicer, clock, address); the calls raise raw RpcErrors."""
    started = []

    def start(**options):
        clock = SimClock()
        index = PrefixIndex()
        for node_id in NODES:  # engines go only on nodes the master knows
            index.add_node(node_id)
        servicer = ConductorServicer(index, None, SchedulingOptions(**options), lambda *a: None, clock=clock)
        server = grpc.server(ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_ConductorServicer_to_server(servicer, server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        server.start()
        channel = grpc.insecure_channel(address)
        started.append((server, channel))
        return SchedulingCalls(channel, lambda method, request: method(request, timeout=30)), servicer, clock, address

    yield start
    for server, channel in started:
        channel.close()
        server.stop(None)


def engines(calls, prefill=("p0",), decode=("d0",)):
    for e in prefill:
        calls.register_engine(NS, e, "prefill", "node-" + e)
    for e in decode:
        calls.register_engine(NS, e, "decode", "node-" + e)


def test_an_idle_decode_report_is_a_decode_report_and_clears_the_high_load(serve):
    calls, servicer, _, _ = serve(admission="early")
    engines(calls)
    limit = servicer.conductor(NS).loads()["decode"]["d0"]["token_limit"]
    calls.report_load(NS, "d0", running_batch=64, context_tokens=limit)
    with pytest.raises(Overloaded) as rejected:
        calls.schedule(KEYS, 64)
    assert rejected.value.reason == "decode_overloaded"
    calls.report_load(NS, "d0", running_batch=0, context_tokens=0)  # idle; was "unknown prefill instance"
    assert servicer.conductor(NS).loads()["decode"]["d0"]["tokens"] == 0
    assert calls.schedule(KEYS, 64).decode_engine == "d0"
    calls.report_load(NS, "p0")  # an idle prefill engine's zeros are a prefill report
    with pytest.raises(grpc.RpcError) as unknown:
        calls.report_load(NS, "nobody", running_batch=1)
    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown engine" in unknown.value.details()


def test_a_rejection_carries_its_reason_as_a_field(serve):
    calls, _, _, address = serve(admission="early", ttft_slo_s=30.0)
    engines(calls)
    calls.report_load(NS, "p0", queue_length=50, busy_s=100.0)
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as raw:
        pb_grpc.ConductorStub(channel).Schedule(
            pb.ScheduleRequest(namespace=NS, digests=[k[1] for k in KEYS], input_length=64), timeout=30
        )
    assert raw.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    reply = rejection_of(raw.value)
    assert (reply.reason, reply.estimated_ttft_s > 30.0) == ("ttft_slo", True)
    assert "TTFT" in reply.detail and reply.detail in raw.value.details()  # the message stays readable
    with pytest.raises(Overloaded) as sdk:  # the SDK takes the field (this call maps nothing itself)
        calls.schedule(KEYS, 64)
    assert sdk.value.reason == "ttft_slo" and "TTFT" in str(sdk.value)
    with Client(address) as client:  # and so does Client.schedule, through the client's error mapping
        with pytest.raises(Overloaded) as through_client:
            client.schedule(KEYS, 64)
    assert through_client.value.reason == "ttft_slo"


def test_a_rejection_after_prefill_carries_reason_and_detail(serve):
    calls, servicer, _, _ = serve(admission="none")
    engines(calls)
    limit = servicer.conductor(NS).loads()["decode"]["d0"]["token_limit"]
    placement = calls.schedule(KEYS, 64, request_id="r")
    calls.report_request(NS, "r", "prefill_started")
    calls.report_load(NS, "d0", running_batch=64, context_tokens=limit)  # full by the time prefill ends
    reply = calls.report_request(NS, placement.request_id, "prefill_finished")
    assert reply.rejected and reply.reason == "decode_overloaded" and "d0 load" in reply.detail


def test_schedule_with_start_prefill_needs_no_prefill_started_report(serve):
    calls, servicer, _, _ = serve(admission="none")
    engines(calls)
    calls.schedule(KEYS, 64, request_id="s", start_prefill=True)
    with pytest.raises(grpc.RpcError) as twice:  # started already
        calls.report_request(NS, "s", "prefill_started")
    assert twice.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert calls.report_request(NS, "s", "prefill_finished").decode_engine == "d0"


def test_deregister_engine(serve):
    calls, servicer, _, _ = serve(admission="early")
    engines(calls, prefill=("p0", "p1"))
    queued = calls.schedule(KEYS, 64, request_id="q")
    gone = calls.deregister_engine(NS, queued.prefill_engine)
    assert (gone.known, gone.ended_requests) == (True, 1)
    with pytest.raises(grpc.RpcError) as ended:  # the request in flight on it ended
        calls.report_request(NS, "q", "prefill_started")
    assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    other = ({"p0", "p1"} - {queued.prefill_engine}).pop()
    assert {calls.schedule(KEYS, 64).prefill_engine for _ in range(4)} == {other}  # no new work for it
    assert calls.deregister_engine(NS, queued.prefill_engine).known is False  # twice: nothing to do
    assert calls.deregister_engine(NS, "d0").ended_requests == 0  # paired only, not decoding
    calls.deregister_engine(NS, other)
    with pytest.raises(Overloaded) as none_left:
        calls.schedule(KEYS, 64)
    assert none_left.value.reason == "no_instance"
    assert servicer.conductor(NS).loads() == {"prefill": {}, "decode": {}}


def test_requests_expire_after_the_request_ttl(serve):
    calls, servicer, clock, _ = serve(admission="off", request_ttl_s=60.0)
    engines(calls)
    lost = calls.schedule(KEYS, 64)
    kept = calls.schedule(KEYS, 64)
    clock.advance(50.0)
    calls.report_request(NS, kept.request_id, "prefill_started")
    clock.advance(20.0)  # 70 s: "lost" had no report for 70 s, "kept" for 20 s
    calls.report_request(NS, kept.request_id, "prefill_finished")
    with pytest.raises(grpc.RpcError) as expired:
        calls.report_request(NS, lost.request_id, "prefill_started")
    assert expired.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert servicer.conductor(NS).expired == 1
    assert servicer.conductor(NS).loads()["prefill"]["p0"]["assigned"] == 0


def test_the_request_ttl_is_a_master_option():
    with pytest.raises(ConfigError):
        SchedulingOptions(request_ttl_s=0)
    assert CliRunner().invoke(main, ["master", "--request-ttl", "0"]).exit_code == 2  # refused before serving
    server = start_master("127.0.0.1", 0, -1, 5.0, 1, request_ttl=7.5)
    try:
        assert server.conductor.conductor(NS).request_ttl == 7.5
    finally:
        server.stop()


def test_calls_naming_new_namespaces_keep_no_conductor(serve):
    """Regression (bench.fuzz): Schedule, ReportEngineLoad, ReportRequest and DeregisterEngine on a
    namespace no engine registered in keep nothing in the master (each kept a Conductor, ~2.5 KB,
    so a caller naming ever new namespaces grew the master without bound); RegisterEngine keeps one."""
    calls, servicer, _, address = serve()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.ConductorStub(channel)
        for i in range(50):
            ns = f"new-{i}"
            for call in (
                lambda: stub.Schedule(pb.ScheduleRequest(namespace=ns, digests=[b"d" * 16], input_length=8)),
                lambda: stub.ReportEngineLoad(pb.EngineLoad(namespace=ns, engine_id="e")),
                lambda: stub.ReportRequest(pb.RequestEvent(namespace=ns, request_id="r")),
                lambda: stub.DeregisterEngine(pb.EngineDeregistration(namespace=ns, engine_id="e")),
            ):
                try:
                    call()
                except grpc.RpcError as exc:
                    assert exc.code() != grpc.StatusCode.UNKNOWN, exc
    assert servicer._conductors == {}
    engines(calls)
    assert list(servicer._conductors) == [NS]
