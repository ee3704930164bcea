"""KV events out of the master, in vLLM's wire format (kvstore.master.kv_events).

The derivation (index changes -> events), the bounded buffers and the encoding
are checked in process; then a real `kvstore master --kv-events ...` with a real
node, the SDK and real ZMQ subscribers: every message is decoded as plain
msgpack, and with vLLM's own msgspec decoder where vLLM is installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request

import msgspec
import pytest
import zmq
from click.testing import CliRunner

from kvstore.cli import main as kvstore_cli
from kvstore.master.index import DRAM, SSD, STORED as IX_STORED, REMOVED as IX_REMOVED, PrefixIndex
from kvstore.master.kv_events import (
    CLEAR,
    CLEARED,
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    REMOVED,
    STORED,
    KVEventsOptions,
    append_events,
    check_endpoint,
    events_for,
    medium_of,
    open_publisher,
    split_events,
)
from kvstore.master.kv_events_buffers import ChangeQueue, ReplayBuffer
from kvstore.master.kv_events_wire import Encoder
from kvstore.security.access import AccessList
from kvstore_client.errors import ConfigError
from tests.processes import ROOT, start_master, start_node, wait_for

END_SEQ = b"\xff" * 8
PREFIX = "pool/"
NS0, NS1 = "kvt/model-a/layer0", "kvt/model-a/layer1"  # one namespace per attention layer, as vLLM's connector
KiB, MiB = 1 << 10, 1 << 20


def digest(i: int, ns: str = "") -> bytes:
    return (ns.encode() + i.to_bytes(4, "big")).rjust(32, b"\x07")  # 32 bytes, like vLLM's sha256 hashes


# -- derivation: index changes -> events ------------------------------------------------------


class Recorder:
    """A watch sink that keeps the events each index call gives."""

    def __init__(self, index: PrefixIndex):
        self.calls: list[tuple[dict, bool]] = []
        index.watch(self.sink)

    def sink(self, changes, emptied):
        self.calls.append(({ns: events_for(diff) for ns, diff in changes}, emptied))

    def take(self) -> list[tuple[dict, bool]]:
        calls, self.calls = self.calls, []
        return calls


def test_index_changes_become_events():
    index = PrefixIndex()
    rec = Recorder(index)
    a, b, x, y = "node-a", "node-b", digest(1), digest(2)
    index.add_node(a), index.add_node(b)
    assert rec.take() == []

    index.apply(a, [("ns", [(IX_STORED, DRAM, x), (IX_STORED, SSD, y)])])  # first copies
    assert rec.take() == [({"ns": [(STORED, MEDIUM_CPU, [x]), (STORED, MEDIUM_STORAGE, [y])]}, False)]
    index.apply(b, [("ns", [(IX_STORED, SSD, x)])])  # a replica: the same block to a router
    assert rec.take() == [({"ns": []}, False)]
    index.apply(a, [("ns", [(IX_STORED, SSD, x)])])  # the last DRAM copy demoted: medium CPU -> STORAGE
    assert rec.take() == [({"ns": [(REMOVED, MEDIUM_CPU, [x]), (STORED, MEDIUM_STORAGE, [x])]}, False)]
    index.apply(b, [("ns", [(IX_STORED, DRAM, y)])])  # an SSD-only block gets a DRAM copy: STORAGE -> CPU
    assert rec.take() == [({"ns": [(REMOVED, MEDIUM_STORAGE, [y]), (STORED, MEDIUM_CPU, [y])]}, False)]
    index.apply(a, [("ns", [(IX_STORED, DRAM, y), (IX_REMOVED, 0, y)])])  # a's copy goes, b's stays in DRAM
    assert rec.take() == [({"ns": []}, False)]
    index.apply(a, [("ns", [(IX_STORED, DRAM, digest(3)), (IX_REMOVED, 0, digest(3))])])  # nets to nothing
    assert rec.take() == []

    # an inventory resent unchanged says nothing; one that lacks a block held nowhere else removes it
    index.replace_inventory(a, [("ns", [(IX_STORED, SSD, x)])])
    assert rec.take() == []
    index.replace_inventory(b, [("ns", [(IX_STORED, SSD, x)])])  # b no longer has y
    assert rec.take() == [({"ns": [(REMOVED, MEDIUM_CPU, [y])]}, False)]
    index.drop_node(a)  # b still holds x
    assert rec.take() == [({"ns": []}, False)]
    index.drop_node(b)  # the last copy goes, and with it the index's last key
    assert rec.take() == [({"ns": [(REMOVED, MEDIUM_STORAGE, [x])]}, True)]

    index.add_node(a)
    index.apply(a, [("n1", [(IX_STORED, DRAM, x)]), ("n2", [(IX_STORED, DRAM, y)])])
    index.reset_node(a)  # a fresh registration: its blocks leave until its inventory comes
    assert rec.take()[-1] == ({"n1": [(REMOVED, MEDIUM_CPU, [x])], "n2": [(REMOVED, MEDIUM_CPU, [y])]}, True)
    index.watch(None)
    index.apply(a, [("ns", [(IX_STORED, DRAM, x)])])
    assert rec.take() == []


def test_medium_of_holders():
    assert medium_of(()) is None
    assert medium_of((("a", SSD),)) == MEDIUM_STORAGE
    assert medium_of((("a", SSD), ("b", DRAM))) == MEDIUM_CPU


def test_events_merge_and_split_in_order():
    out = []
    append_events(out, [(STORED, MEDIUM_CPU, [b"1"]), (STORED, MEDIUM_CPU, [b"2"])])
    append_events(out, [(STORED, MEDIUM_CPU, [b"3"]), (REMOVED, MEDIUM_CPU, [b"1"])])
    append_events(out, [CLEAR, CLEAR])
    assert out == [(STORED, MEDIUM_CPU, [b"1", b"2", b"3"]), (REMOVED, MEDIUM_CPU, [b"1"]), CLEAR, CLEAR]
    assert split_events(out, 2) == [
        [(STORED, MEDIUM_CPU, [b"1", b"2"])],
        [(STORED, MEDIUM_CPU, [b"3"]), (REMOVED, MEDIUM_CPU, [b"1"]), CLEAR, CLEAR],
    ]


def test_change_queue_is_bounded_and_reports_overflow():
    queue = ChangeQueue(max_pending=3, wake_at=2)
    try:
        queue.offer([("ns", [(b"1", (), ())])], False)
        assert queue.pending == 1
        queue.offer([("ns", [(b"2", (), ()), (b"3", (), ())])], False)
        queue.offer([("ns", [(b"4", (), ())])], True)  # 3 queued + 1 > 3: all four dropped
        assert (queue.pending, queue.dropped) == (0, 4)
        queue.offer([("ns", [(b"5", (), ())])], False)
        items, overflowed = queue.take()
        assert overflowed and items == [([("ns", [(b"5", (), ())])], False)]
        assert queue.take() == ([], False)
    finally:
        queue.close()


def test_replay_buffer_keeps_the_newest_within_count_and_bytes():
    buffer = ReplayBuffer(max_messages=3, max_bytes=10)
    for seq in range(5):
        buffer.add(seq, b"t", b"xx")
    assert [m[0] for m in buffer.since(0)] == [2, 3, 4] and buffer.nbytes == 6
    buffer.add(5, b"t", b"x" * 9)  # over the byte bound: older ones go
    assert [m[0] for m in buffer.since(0)] == [5]
    buffer.add(6, b"t", b"x" * 50)  # bigger than the bound alone: kept, being the newest
    assert [m[0] for m in buffer.since(6)] == [6] and list(buffer.since(7)) == []


# -- options and the command line ------------------------------------------------------------------


@pytest.mark.parametrize(
    "endpoint", ["tcp://127.0.0.1:5557", "tcp://*:0", "tcp://[::1]:5557", "tcp://host-a.lan:1", "ipc:///tmp/kv-events"]
)
def test_good_endpoints(endpoint):
    assert check_endpoint(endpoint) == endpoint


@pytest.mark.parametrize(
    "endpoint",
    [
        "127.0.0.1:5557",
        "tcp://127.0.0.1",
        "tcp://127.0.0.1:99999",
        "tcp://:5557",
        "udp://1.2.3.4:5",
        "tcp://a b:1",
        "ipc://",
    ],
)
def test_bad_endpoints(endpoint):
    with pytest.raises(ConfigError, match="tcp://HOST:PORT"):
        check_endpoint(endpoint)


def test_options_are_checked():
    with pytest.raises(ConfigError, match="replay endpoint must differ"):
        KVEventsOptions("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5557")
    with pytest.raises(ConfigError, match="hashes"):
        KVEventsOptions("tcp://127.0.0.1:0", hashes="hex")
    with pytest.raises(ConfigError, match="NUL"):
        KVEventsOptions("tcp://127.0.0.1:0", topic="a\0b")


@pytest.mark.parametrize("command", ["master", "up"])
def test_cli_rejects_a_malformed_endpoint(command):
    result = CliRunner().invoke(kvstore_cli, [command, "--kv-events", "localhost:5557"])
    assert result.exit_code == 2
    assert "Invalid value for '--kv-events'" in result.output and "tcp://HOST:PORT" in result.output
    result = CliRunner().invoke(kvstore_cli, [command, "--kv-events-replay", "tcp://127.0.0.1:0"])
    assert result.exit_code == 2 and "--kv-events-replay needs --kv-events" in result.output
    result = CliRunner().invoke(kvstore_cli, [command, "--kv-events-hashes", "int64"])
    assert result.exit_code == 2 and "--kv-events-hashes needs --kv-events" in result.output


def test_missing_pyzmq_is_a_clear_error():
    code = (
        "import sys; sys.modules['zmq'] = None; from kvstore.cli import main; "
        "main(['master', '--port', '0', '--metrics-port', '-1', '--kv-events', 'tcp://127.0.0.1:0'])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 1
    assert "needs pyzmq and msgspec" in result.stderr and "kvstore[events]" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_endpoint_in_use_is_a_clear_error():
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    try:
        port = taken.bind_to_random_port("tcp://127.0.0.1")
        with pytest.raises(ConfigError, match=f"--kv-events cannot bind tcp://127.0.0.1:{port}"):
            open_publisher(KVEventsOptions(f"tcp://127.0.0.1:{port}"), PrefixIndex())
        with pytest.raises(ConfigError, match="--kv-events-replay cannot bind"):
            open_publisher(KVEventsOptions("tcp://127.0.0.1:0", f"tcp://127.0.0.1:{port}"), PrefixIndex())
    finally:
        taken.close(0)
        ctx.term()


# -- helpers for the stream ---------------------------------------------------------------------------


def plain(payload: bytes):
    """A payload as plain msgpack: [ts, [event maps], data_parallel_rank]."""
    return msgspec.msgpack.decode(payload)


def fold(messages, state=None) -> dict:
    """What a router would hold after these messages: {(topic, hash): medium}."""
    state = {} if state is None else state
    for topic, _seq, payload in messages:
        for event in plain(payload)[1]:
            if event["type"] == CLEARED:
                state.clear()
            elif event["type"] == STORED:
                state.update({(topic, h): event["medium"] for h in event["block_hashes"]})
            else:
                for h in event["block_hashes"]:
                    if state.get((topic, h)) == event["medium"]:
                        del state[(topic, h)]
    return state


class Subscriber:
    """A ZMQ SUB on its own thread, keeping (topic, seq, payload) of every message."""

    def __init__(self, endpoint: str, topic: str = "", token: str | None = None):
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        if token is not None:  # ZMQ PLAIN: what a master with an access file asks for
            self._sock.setsockopt(zmq.PLAIN_USERNAME, b"kvstore")
            self._sock.setsockopt(zmq.PLAIN_PASSWORD, token.encode())
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sock.connect(endpoint)
        self._lock = threading.Lock()
        self._messages: list[tuple[bytes, int, bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            if self._sock.poll(50):
                topic, seq, payload = self._sock.recv_multipart()
                assert len(seq) == 8
                with self._lock:
                    self._messages.append((topic, int.from_bytes(seq, "big"), payload))

    @property
    def messages(self) -> list[tuple[bytes, int, bytes]]:
        with self._lock:
            return list(self._messages)

    def close(self):
        self._stop.set()
        self._thread.join()
        self._sock.close(0)
        self._ctx.term()


def replay(endpoint: str, start: bytes, token: str | None = None, wait_ms: int = 10_000) -> list[list[bytes]]:
    """vLLM's replay request from a DEALER; the replies up to and with the end marker."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        if token is not None:
            dealer.setsockopt(zmq.PLAIN_USERNAME, b"kvstore")
            dealer.setsockopt(zmq.PLAIN_PASSWORD, token.encode())
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start])
        replies = []
        while dealer.poll(wait_ms):
            frames = dealer.recv_multipart()
            replies.append(frames)
            if frames[2] == END_SEQ:
                return replies
        raise AssertionError(f"no end marker after {len(replies)} replies")
    finally:
        dealer.close(0)
        ctx.term()


def replayed(endpoint: str, start: int) -> list[tuple[bytes, int, bytes]]:
    replies = replay(endpoint, start.to_bytes(8, "big"))
    assert replies[-1] == [b"", b"", END_SEQ, b""]
    return [(topic, int.from_bytes(seq, "big"), payload) for _, topic, seq, payload in replies[:-1]]


def pool_state(client, namespaces) -> dict:
    """{(topic, digest): medium} from the master's own listing (what the events should add up to)."""
    out = {}
    for ns in namespaces:
        for key in client.list_keys(ns, limit=10_000).keys:
            holders = tuple((r.node_id, r.tier) for r in key.replicas)
            out[((PREFIX + ns).encode(), key.digest)] = medium_of(holders)
    return out


# -- publisher in process: resync after dropped changes ------------------------------------------------


def test_dropped_changes_are_followed_by_a_resync():
    index = PrefixIndex()
    options = KVEventsOptions(
        "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic=PREFIX, hashes="bytes", max_pending=3, flush_interval_s=0.02
    )
    publisher = open_publisher(options, index)
    gone, kept = (PREFIX + "gone").encode(), (PREFIX + "ns").encode()
    try:
        wait_for(lambda: replayed(publisher.replay_endpoint, 0))  # the start's resync is out
        index.add_node("a")
        index.apply("a", [("gone", [(IX_STORED, DRAM, digest(100)), (IX_STORED, DRAM, digest(101))])])
        wait_for(
            lambda: (
                fold(replayed(publisher.replay_endpoint, 0))
                == {(gone, digest(100)): MEDIUM_CPU, (gone, digest(101)): MEDIUM_CPU}
            )
        )
        # five changes a call, over max_pending: each call dropped whole, the removal of "gone" too
        index.apply(
            "a",
            [
                ("gone", [(IX_REMOVED, 0, digest(100)), (IX_REMOVED, 0, digest(101))]),
                ("ns", [(IX_STORED, DRAM, digest(j)) for j in range(3)]),
            ],
        )
        for i in range(3, 40, 5):
            index.apply("a", [("ns", [(IX_STORED, DRAM if i % 2 else SSD, digest(j)) for j in range(i, i + 5)])])
        index.apply("a", [("ns", [(IX_REMOVED, 0, digest(5))])])  # one that fits
        expected = {
            (kept, digest(j)): MEDIUM_CPU if j < 3 or ((j - 3) // 5 + 1) % 2 else MEDIUM_STORAGE
            for j in range(43)
            if j != 5
        }
        # a consumer that ignores topics, and one that subscribed to each namespace alone, both converge
        wait_for(lambda: fold(replayed(publisher.replay_endpoint, 0)) == expected)
        stream = replayed(publisher.replay_endpoint, 0)
        assert fold([m for m in stream if m[0] == gone]) == {}
        assert fold([m for m in stream if m[0] == kept]) == expected
        samples = {(name, tuple(labels.items())): value for name, _, _, labels, value in publisher.samples()}
        assert samples[("kvstore_master_kv_events_dropped_total", ())] >= 40
        assert samples[("kvstore_master_kv_events_resyncs_total", ())] >= 2  # the start, then after drops
    finally:
        publisher.stop()


def test_with_an_access_file_only_an_admin_token_reads_the_events(tmp_path):
    from tests.access_files import ADMIN, NS_A, TENANT_A, access_list

    index = PrefixIndex()
    options = KVEventsOptions("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", hashes="bytes", flush_interval_s=0.02)
    publisher = open_publisher(options, index, access_list(tmp_path))
    subscribers = {
        "anonymous": Subscriber(publisher.endpoint),
        "tenant": Subscriber(publisher.endpoint, token=TENANT_A),
        "admin": Subscriber(publisher.endpoint, token=ADMIN),
    }
    try:
        time.sleep(0.5)  # the handshakes (and ZMQ's slow joiner)
        index.add_node("a")
        index.apply("a", [(NS_A, [(IX_STORED, DRAM, digest(i)) for i in range(20)])])
        wait_for(lambda: len(fold(subscribers["admin"].messages)) == 20)
        time.sleep(0.3)
        assert subscribers["anonymous"].messages == [] and subscribers["tenant"].messages == []
        assert fold(replayed_with(publisher.replay_endpoint, ADMIN)) == fold(subscribers["admin"].messages)
        with pytest.raises(AssertionError, match="no end marker"):  # its handshake fails: no answer at all
            replay(publisher.replay_endpoint, (0).to_bytes(8, "big"), wait_ms=500)
        samples = {name: value for name, _, _, labels, value in publisher.samples() if not labels}
        assert samples["kvstore_master_kv_events_refused_subscribers_total"] >= 1  # the tenant (no PLAIN: no ZAP)
    finally:
        for subscriber in subscribers.values():
            subscriber.close()
        publisher.stop()


def test_a_reload_cuts_off_a_revoked_subscriber_and_keeps_the_others(tmp_path):
    from tests.access_files import ACCESS_TOML, ADMIN, NS_A, write_access_file

    second_admin = "admin2-token-0123456789abcdef"
    path = write_access_file(tmp_path, ACCESS_TOML + f'\n[tokens.root2]\nsecret = "{second_admin}"\nrole = "admin"\n')
    from kvstore.master.server import MasterServer

    access = AccessList.load(str(path))
    options = KVEventsOptions("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", hashes="bytes", flush_interval_s=0.02)
    master = MasterServer(access=access, kv_events=options).start()
    index = master.index
    kept, revoked = (
        Subscriber(master.kv_events_address, token=ADMIN),
        Subscriber(master.kv_events_address, token=second_admin),
    )
    try:
        time.sleep(0.5)
        index.add_node("a")
        index.apply("a", [(NS_A, [(IX_STORED, DRAM, digest(1))])])
        wait_for(lambda: len(fold(kept.messages)) == 1 and len(fold(revoked.messages)) == 1)
        path.write_text(ACCESS_TOML)  # root2 leaves the file
        assert access.reload()  # what SIGHUP does: the master's publisher binds its sockets again
        time.sleep(1.0)  # the sockets bound again; subscribers reconnect and authenticate anew
        before = len(revoked.messages)
        index.apply("a", [(NS_A, [(IX_STORED, DRAM, digest(2))])])
        wait_for(lambda: (NS_A.encode(), digest(2)) in fold(kept.messages))
        time.sleep(0.3)
        assert len(revoked.messages) == before  # cut off: nothing after the reload
        assert fold(replayed_with(master.kv_events_replay_address, ADMIN))  # replays still served to the kept token
        with pytest.raises(AssertionError, match="no end marker"):
            replay(master.kv_events_replay_address, (0).to_bytes(8, "big"), token=second_admin, wait_ms=500)
    finally:
        kept.close()
        revoked.close()
        master.stop()


def replayed_with(endpoint: str, token: str) -> list[tuple[bytes, int, bytes]]:
    replies = replay(endpoint, (0).to_bytes(8, "big"), token=token)
    return [(topic, int.from_bytes(seq, "big"), payload) for _, topic, seq, payload in replies[:-1]]


def test_replays_past_the_budget_get_the_end_marker_alone():
    index = PrefixIndex()
    options = KVEventsOptions(
        "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", flush_interval_s=0.02, replay_messages=100, replay_rate=1
    )
    publisher = open_publisher(options, index)
    try:
        index.add_node("a")
        index.apply("a", [(f"ns{i}", [(IX_STORED, DRAM, digest(i))]) for i in range(60)])  # a message each
        wait_for(lambda: len(replayed(publisher.replay_endpoint, 0)) >= 60)  # served: the budget held them
        assert replayed(publisher.replay_endpoint, 0) == []  # at 1 message a second, nothing left for a second
        samples = {name: value for name, _, _, labels, value in publisher.samples() if not labels}
        assert samples["kvstore_master_kv_events_replays_deferred_total"] >= 1
    finally:
        publisher.stop()


def test_encoding_is_vllms_layout_as_plain_msgpack():
    payload = Encoder().encode(1.5, [(STORED, MEDIUM_CPU, [b"a" * 32]), (REMOVED, MEDIUM_STORAGE, [b"b"]), CLEAR])
    assert plain(payload) == [
        1.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [b"a" * 32],
                "parent_block_hash": None,
                "token_ids": [],
                "block_size": 0,
                "lora_id": None,
                "medium": "CPU",
                "lora_name": None,
            },
            {"type": "BlockRemoved", "block_hashes": [b"b"], "medium": "STORAGE"},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]
    ints = plain(Encoder("int64").encode(0.0, [(REMOVED, MEDIUM_CPU, [b"\x01" * 24 + b"\xff" * 8])]))
    assert ints[1][0]["block_hashes"] == [(1 << 64) - 1]


# -- vLLM's own structs --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_events():
    pytest.importorskip("vllm")
    from vllm.distributed import kv_events

    return kv_events


@pytest.mark.vllm
@pytest.mark.parametrize("hashes", ["bytes", "int64"])
def test_bytes_match_vllms_encoder(vllm_events, hashes):
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    k = vllm_events
    digests = [digest(i) for i in range(3)]
    wire = [maybe_convert_block_hash(d) for d in digests] if hashes == "int64" else digests
    theirs = k.KVEventBatch(
        ts=12.25,
        data_parallel_rank=0,
        events=[
            k.BlockRemoved(block_hashes=wire[:1], medium=k.MEDIUM_CPU),
            k.BlockStored(
                block_hashes=wire,
                parent_block_hash=None,
                token_ids=[],
                block_size=0,
                lora_id=None,
                medium=k.MEDIUM_STORAGE,
                lora_name=None,
            ),
            k.AllBlocksCleared(),
        ],
    )
    ours = Encoder(hashes).encode(12.25, [(REMOVED, MEDIUM_CPU, digests[:1]), (STORED, MEDIUM_STORAGE, digests), CLEAR])
    assert ours == msgspec.msgpack.encode(theirs)
    assert msgspec.msgpack.Decoder(k.KVEventBatch).decode(ours) == theirs


# -- a real pool -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    """A real master with KV events and a real node; the SDK puts, removes, then the node is killed.

    Yields what two subscribers (everything; NS1 only) received and what the SDK did.
    """
    from kvstore_client import Client

    master = start_master(
        ttl=1.0,
        extra=(
            "--kv-events",
            "tcp://127.0.0.1:0",
            "--kv-events-replay",
            "tcp://127.0.0.1:0",
            "--kv-events-topic",
            PREFIX,
            "--kv-events-hashes",
            "bytes",
        ),
    )
    everything = Subscriber(master.record["kv_events"])
    one = Subscriber(master.record["kv_events"], PREFIX + NS1)
    node = None
    try:
        time.sleep(0.5)  # let the subscriptions reach the master (ZMQ's slow joiner)
        node = start_node(master.record["master"], tmp_path_factory.mktemp("node"), dram="8MiB", ssd="64MiB")
        with Client(master.record["master"]) as client:
            big = [(NS0, digest(i, NS0)) for i in range(14)]  # 14 MiB into 8 MiB of DRAM: some go to SSD
            for key in big:
                client.put(key, key[1] * (MiB // 32))
            small = [(NS1, digest(i, NS1)) for i in range(10)]
            client.batch_put(small, [key[1] * 128 for key in small])
            wait_for(lambda: len(pool_state(client, [NS0, NS1])) == 24, timeout=30)
            settled = wait_for(
                lambda: (s := pool_state(client, [NS0, NS1])) == fold(everything.messages) and s, timeout=30
            )
            gone = small[:3]
            for key in gone:
                assert client.remove(key)
            wait_for(
                lambda: not any(((PREFIX + ns).encode(), d) in fold(everything.messages) for ns, d in gone), timeout=30
            )
            node.kill()  # -9: the master drops it when its lease runs out
            wait_for(lambda: (m := everything.messages) and plain(m[-1][2])[1] == [{"type": CLEARED}], timeout=30)
            time.sleep(0.3)
        yield {
            "master": master,
            "all": everything.messages,
            "one": one.messages,
            "big": big,
            "small": small,
            "gone": gone,
            "settled": settled,
        }
    finally:
        everything.close()
        one.close()
        if node is not None:
            node.close()
        master.close()


def stored_and_removed(messages) -> tuple[set, set]:
    stored, removed = set(), set()
    for topic, _, payload in messages:
        for event in plain(payload)[1]:
            target = stored if event["type"] == STORED else removed if event["type"] == REMOVED else None
            if target is not None:
                target.update((topic, h) for h in event["block_hashes"])
    return stored, removed


def test_stream_adds_up_to_what_the_sdk_did(stream):
    messages = stream["all"]
    seqs = [seq for _, seq, _ in messages]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # +1 each: a subscriber of everything misses none
    topics = {PREFIX.encode(), (PREFIX + NS0).encode(), (PREFIX + NS1).encode()}
    assert {topic for topic, _, _ in messages} <= topics
    for topic, _, payload in messages:
        ts, events, rank = plain(payload)
        assert isinstance(ts, float) and rank == 0 and events
        if topic == PREFIX.encode():
            assert events == [{"type": CLEARED}]  # the bare prefix topic carries only the clears
    put = {((PREFIX + ns).encode(), d) for ns, d in stream["big"] + stream["small"]}
    stored, removed = stored_and_removed(messages)
    assert stored == put and removed == put  # removed: three by the SDK, the rest when the node died
    settled = stream["settled"]  # the events matched the master's own listing, media included
    assert set(settled) == put and set(settled.values()) == {MEDIUM_CPU, MEDIUM_STORAGE}
    assert fold(messages) == {}


def test_a_subscriber_of_one_namespace_gets_only_it(stream):
    mine = stream["one"]
    assert mine and {topic for topic, _, _ in mine} == {(PREFIX + NS1).encode()}
    by_seq = {seq: (topic, payload) for topic, seq, payload in stream["all"]}
    assert all(by_seq[seq] == (topic, payload) for topic, seq, payload in mine)  # the same messages, seq and all
    stored, removed = stored_and_removed(mine)
    assert stored == removed == {((PREFIX + NS1).encode(), d) for _, d in stream["small"]}


def test_replay_returns_the_batches_from_a_sequence_number(stream):
    endpoint = stream["master"].record["kv_events_replay"]
    live = stream["all"]
    start = live[len(live) // 2][1]
    assert replayed(endpoint, start) == [m for m in live if m[1] >= start]
    everything = replayed(endpoint, 0)
    assert everything[0][:2] == (PREFIX.encode(), 0) and plain(everything[0][2])[1] == [{"type": CLEARED}]
    assert everything[-len(live) :] == live and [s for _, s, _ in everything] == list(range(len(everything)))
    assert replayed(endpoint, 1 << 40) == []
    assert replay(endpoint, b"short") == [[b"", b"", END_SEQ, b""]]  # malformed: just the end marker


@pytest.mark.vllm
def test_vllms_decoder_reads_every_message(stream, vllm_events):
    k = vllm_events
    decoder = msgspec.msgpack.Decoder(k.KVEventBatch)
    kinds = set()
    for _topic, _seq, payload in stream["all"]:
        batch = decoder.decode(payload)
        assert batch.data_parallel_rank == 0
        for event, raw in zip(batch.events, plain(payload)[1], strict=True):
            kinds.add(type(event).__name__)
            if isinstance(event, k.BlockStored):
                assert (event.parent_block_hash, event.token_ids, event.block_size, event.lora_name) == (
                    None,
                    [],
                    0,
                    None,
                )
                assert event.medium in (k.MEDIUM_CPU, k.MEDIUM_STORAGE) and event.block_hashes == raw["block_hashes"]
            elif isinstance(event, k.BlockRemoved):
                assert event.medium in (k.MEDIUM_CPU, k.MEDIUM_STORAGE) and event.block_hashes == raw["block_hashes"]
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


def test_metrics_count_what_was_published(stream):
    url = f"http://{stream['master'].record['metrics']}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert int(values["kvstore_master_kv_events_messages_total"]) == stream["all"][-1][1] + 1
    assert values["kvstore_master_kv_events_dropped_total"] == "0"
    assert int(values['kvstore_master_kv_events_blocks_total{type="BlockStored"}']) >= 24


# -- without the flag -------------------------------------------------------------------------------------


def listening_tcp_ports(pid: int) -> set[int]:
    """TCP ports the process listens on (its socket inodes matched in /proc/net/tcp*)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def loads_zmq(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "zmq" in f.read()


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_without_the_flag_the_master_opens_no_zmq_socket(stream):
    plain_master = start_master(ttl=1.0)
    try:
        expected = {port_of(plain_master.record[k]) for k in ("master", "metrics", "conductor")}
        assert listening_tcp_ports(plain_master.proc.pid) == expected
        assert not loads_zmq(plain_master.proc.pid) and "kv_events" not in plain_master.record
    finally:
        plain_master.close()
    with_events = stream["master"]  # the check itself sees the sockets when there are some
    record = with_events.record
    assert listening_tcp_ports(with_events.proc.pid) == {
        port_of(record[k]) for k in ("master", "metrics", "conductor", "kv_events", "kv_events_replay")
    }
    assert loads_zmq(with_events.proc.pid)


def test_up_publishes_too(tmp_path):
    from kvstore_client import Client
    from tests.processes import Service

    up = Service(
        [
            "up",
            "--port",
            "0",
            "--data-port",
            "0",
            "--metrics-port",
            "-1",
            "--data-dir",
            str(tmp_path),
            "--dram",
            "16MiB",
            "--ssd",
            "0",
            "--kv-events",
            "tcp://127.0.0.1:0",
            "--kv-events-hashes",
            "int64",
        ]
    )
    sub = Subscriber(up.record["kv_events"], NS0)
    try:
        assert up.record["kv_events_replay"] is None
        time.sleep(0.5)
        key = (NS0, digest(1))
        with Client(up.record["master"]) as client:
            client.put(key, b"v" * 4 * KiB)
        wanted = {(NS0.encode(), int.from_bytes(key[1], "big") & ((1 << 64) - 1)): MEDIUM_CPU}
        wait_for(lambda: fold(sub.messages) == wanted, timeout=30)
    finally:
        sub.close()
        up.close()
