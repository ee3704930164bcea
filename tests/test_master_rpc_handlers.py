"""Malformed gRPC request bodies get INVALID_ARGUMENT and cost the master no memory.

grpcio's server keeps every call whose request deserializer fails (about 20 KiB each,
never freed), so the master parses request bytes in its own handlers
(kvstore/master/rpc_handlers.py). These tests send raw bytes through a generic channel
call to a master in its own process and read its anonymous RSS from /proc.
"""

from __future__ import annotations

import grpc
import pytest

from kvstore_client.auth import bearer_metadata
from kvstore_client.proto import kvstore_pb2 as pb
from tests.access_files import ADMIN, write_access_file
from tests.processes import start_master

MALFORMED = b"\xff\xff\xff\x00"  # field 31 with wire type 7: no valid message starts so


def anon_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/PID/status")


def send(channel: grpc.Channel, method: str, body: bytes, n: int, metadata=()) -> dict[str, int]:
    """``n`` calls of ``method`` with ``body``, 64 in flight; the status codes they got, counted."""
    call = channel.unary_unary(method)
    codes: dict[str, int] = {}
    for start in range(0, n, 64):
        futures = [call.future(body, timeout=30, metadata=metadata) for _ in range(min(64, n - start))]
        for future in futures:
            try:
                future.result()
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            codes[code] = codes.get(code, 0) + 1
    return codes


@pytest.fixture(scope="module")
def master():
    service = start_master(ttl=3.0)
    yield service
    service.close()


def test_a_malformed_body_is_invalid_argument_naming_the_message(master):
    with grpc.insecure_channel(master.record["master"]) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary("/kvstore.v1.Master/Place")(MALFORMED, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "PlaceRequest" in caught.value.details()


def test_well_formed_requests_are_still_served(master):
    with grpc.insecure_channel(master.record["master"]) as channel:
        raw = channel.unary_unary("/kvstore.v1.Master/ClusterStatus")(
            pb.ClusterStatusRequest().SerializeToString(), timeout=10
        )
    assert pb.ClusterStatusReply.FromString(raw).nodes == []


def test_malformed_bodies_do_not_grow_the_master(master):
    methods = [f"/{s.full_name}/{m.name}" for s in pb.DESCRIPTOR.services_by_name.values() for m in s.methods]
    with grpc.insecure_channel(master.record["master"]) as channel:
        for method in methods:  # warm-up: thread pool, channel, allocator arenas
            send(channel, method, MALFORMED, 64)
        before = anon_rss_kib(master.proc.pid)
        codes: dict[str, int] = {}
        for method in methods:
            for code, n in send(channel, method, MALFORMED, 600).items():
                codes[code] = codes.get(code, 0) + n
        grown_mib = (anon_rss_kib(master.proc.pid) - before) / 1024
    assert codes == {"INVALID_ARGUMENT": 600 * len(methods)}
    # Through gRPC's own deserializer these ~8,400 calls kept about 170 MiB.
    assert grown_mib < 48, f"anonymous RSS grew {grown_mib:.0f} MiB over {600 * len(methods)} malformed calls"


def test_callers_without_a_token_are_refused_before_the_body_is_read(tmp_path):
    service = start_master(ttl=3.0, extra=("--auth", str(write_access_file(tmp_path))))
    try:
        with grpc.insecure_channel(service.record["master"]) as channel:
            assert send(channel, "/kvstore.v1.Master/Locate", MALFORMED, 64) == {"UNAUTHENTICATED": 64}
            with_token = [bearer_metadata(ADMIN)]
            assert send(channel, "/kvstore.v1.Master/Locate", MALFORMED, 64, with_token) == {"INVALID_ARGUMENT": 64}
    finally:
        service.close()
