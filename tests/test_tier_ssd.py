"""SsdTier on real lmdb files: round trips, exact accounting, reopen,
corruption, kill -9, a full map and concurrent readers."""

from __future__ import annotations

import array
import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time

import lmdb
import pytest
import xxhash

from kvstore_client.errors import BufferTooSmall
from kvstore.tiers.ssd import SsdTier

NS = "test"
KiB, MiB = 1 << 10, 1 << 20


def key(i: int, ns: str = NS):
    return (ns, i.to_bytes(16, "little"))


def raw_key(k) -> bytes:
    """The on-disk key layout: u8 namespace length, namespace, digest."""
    ns = k[0].encode()
    return bytes((len(ns),)) + ns + k[1]


def put(tier: SsdTier, k, data: bytes, depth: int = 0) -> bool:
    return tier.put(k, data, xxhash.xxh3_64_intdigest(data), depth)


def seeded(i: int, lo: int = 1 * KiB, hi: int = 300 * KiB) -> bytes:
    rnd = random.Random(i)
    return rnd.randbytes(rnd.randint(lo, hi))


# -- round trips and accounting ------------------------------------------------------------
def test_round_trip(tmp_path):
    tier = SsdTier(str(tmp_path / "ssd"), 4 * MiB)
    data = seeded(1)
    assert put(tier, key(1), data, depth=7)
    assert tier.contains(key(1)) and len(tier) == 1
    assert tier.size_of(key(1)) == len(data) and tier.depth_of(key(1)) == 7
    assert tier.get(key(1)) == data
    out = bytearray(len(data) + 10)
    assert tier.get_into(key(1), memoryview(out)) == len(data)
    assert bytes(out[: len(data)]) == data and out[len(data) :] == bytes(10)
    assert list(tier.keys()) == [key(1)]
    assert tier.discard(key(1)) and not tier.discard(key(1))
    assert tier.get(key(1)) is None and tier.get_into(key(1), memoryview(out)) is None
    assert not tier.contains(key(1)) and tier.size_of(key(1)) is None and tier.depth_of(key(1)) == 0
    assert tier.used_bytes == 0 and len(tier) == 0
    tier.close()


def test_typed_buffers(tmp_path):
    """Values and out buffers may be memoryviews of any item format; sizes are in bytes."""
    tier = SsdTier(str(tmp_path / "ssd"), 4 * MiB)
    words = array.array("I", range(1000))
    assert tier.put(key(1), memoryview(words), xxhash.xxh3_64_intdigest(words), 0)
    assert tier.size_of(key(1)) == 4000 and tier.get(key(1)) == words.tobytes()
    out = array.array("H", bytes(4000))
    assert tier.get_into(key(1), memoryview(out)) == 4000 and out.tobytes() == words.tobytes()
    tier.close()


def test_exact_accounting(tmp_path):
    tier = SsdTier(str(tmp_path / "ssd"), 4 * MiB)
    assert put(tier, key(1), b"a" * 100) and put(tier, key(2), b"b" * 200)
    assert tier.used_bytes == 300
    assert put(tier, key(1), b"c" * 50, depth=3)  # replace: smaller
    assert tier.used_bytes == 250 and tier.get(key(1)) == b"c" * 50 and tier.depth_of(key(1)) == 3
    assert tier.discard(key(2)) and tier.used_bytes == 50
    batch = [
        (key(5), b"x" * 10, xxhash.xxh3_64_intdigest(b"x" * 10), 1),
        (key(5), b"y" * 20, xxhash.xxh3_64_intdigest(b"y" * 20), 2),
        (key(6), b"z" * 30, xxhash.xxh3_64_intdigest(b"z" * 30), 0),
    ]
    assert tier.put_many(batch) == [True, True, True]
    assert tier.get(key(5)) == b"y" * 20 and tier.depth_of(key(5)) == 2
    assert tier.used_bytes == 50 + 20 + 30 and len(tier) == 3
    assert tier.discard_many([key(5), key(5), key(6), key(99)]) == 2
    assert tier.used_bytes == 50 and len(tier) == 1
    tier.close()


def test_buffer_too_small_writes_nothing(tmp_path):
    tier = SsdTier(str(tmp_path / "ssd"), 4 * MiB)
    data = seeded(2, 5000, 5000)
    put(tier, key(2), data)
    out = bytearray(4999)
    with pytest.raises(BufferTooSmall) as info:
        tier.get_into(key(2), memoryview(out))
    assert info.value.needed == 5000 and out == bytearray(4999)
    tier.close()


def test_over_budget_put_returns_false_and_disturbs_nothing(tmp_path):
    tier = SsdTier(str(tmp_path / "ssd"), 1 * MiB)
    small = seeded(3, 1000, 1000)
    put(tier, key(3), small)
    assert not put(tier, key(4), b"x" * (MiB + 1))
    assert not put(tier, key(3), b"x" * (MiB + 1))  # failed replace keeps the old block
    assert tier.get(key(3)) == small and tier.used_bytes == 1000 and len(tier) == 1
    blocks = [b"p" * (300 * KiB), b"q" * (300 * KiB), b"r" * (300 * KiB), b"s" * (200 * KiB)]
    items = [(key(10 + i), b, xxhash.xxh3_64_intdigest(b), 0) for i, b in enumerate(blocks)]
    assert tier.put_many(items) == [True, True, True, False]
    assert tier.used_bytes == 1000 + 900 * KiB
    assert not put(tier, key(20), b"t" * (200 * KiB))  # budget full
    assert tier.discard(key(10)) and put(tier, key(20), b"t" * (200 * KiB))
    tier.close()


# -- persistence and corruption ----------------------------------------------------------------
def test_reopen_restores_inventory(tmp_path):
    path = str(tmp_path / "ssd")
    tier = SsdTier(path, 16 * MiB)
    for i in range(20):
        put(tier, key(i, ns=f"model-{i % 3}"), seeded(i), depth=i)
    inventory, used = sorted(tier.inventory()), tier.used_bytes
    tier.close()
    tier = SsdTier(path, 16 * MiB)
    assert sorted(tier.inventory()) == inventory and tier.used_bytes == used and len(tier) == 20
    for i in range(20):
        k = key(i, ns=f"model-{i % 3}")
        assert tier.depth_of(k) == i and tier.get(k) == seeded(i)
    assert tier.bad_records == 0 and tier.checksum_failures == 0
    tier.close()


def test_flipped_payload_byte_is_a_miss(tmp_path):
    path = str(tmp_path / "ssd")
    tier = SsdTier(path, 4 * MiB)
    for i in range(3):
        put(tier, key(i), seeded(i))
    tier.close()
    with lmdb.open(path) as env, env.begin(write=True) as txn:
        value = bytearray(txn.get(raw_key(key(1))))
        value[24 + 100] ^= 0x01  # 24-byte header, then payload
        txn.put(raw_key(key(1)), bytes(value))
    tier = SsdTier(path, 4 * MiB)
    assert tier.contains(key(1))  # the header is intact; only a read can tell
    assert tier.get(key(1)) is None and tier.checksum_failures == 1
    assert not tier.contains(key(1)) and tier.used_bytes == len(seeded(0)) + len(seeded(2))
    assert tier.get(key(0)) == seeded(0) and tier.get(key(2)) == seeded(2)
    tier.close()
    with lmdb.open(path) as env, env.begin() as txn:
        assert txn.get(raw_key(key(1))) is None  # deleted on disk, not just hidden


def test_flipped_byte_via_get_into(tmp_path):
    path = str(tmp_path / "ssd")
    tier = SsdTier(path, 4 * MiB)
    put(tier, key(1), seeded(1))
    tier.close()
    with lmdb.open(path) as env, env.begin(write=True) as txn:
        value = bytearray(txn.get(raw_key(key(1))))
        value[-1] ^= 0x80
        txn.put(raw_key(key(1)), bytes(value))
    tier = SsdTier(path, 4 * MiB)
    assert tier.get_into(key(1), memoryview(bytearray(400 * KiB))) is None
    assert tier.checksum_failures == 1 and len(tier) == 0 and tier.used_bytes == 0
    tier.close()


def test_bad_header_is_dropped_on_open(tmp_path):
    path = str(tmp_path / "ssd")
    tier = SsdTier(path, 4 * MiB)
    put(tier, key(1), b"good")
    tier.close()
    with lmdb.open(path) as env, env.begin(write=True) as txn:
        txn.put(raw_key(key(2)), b"not a record")
        good = txn.get(raw_key(key(1)))
        txn.put(raw_key(key(3)), good + b"trailing")  # size field no longer matches
    tier = SsdTier(path, 4 * MiB)
    assert tier.bad_records == 2 and tier.inventory() == [(key(1), 4, 0)]
    tier.close()
    with lmdb.open(path) as env, env.begin() as txn:
        assert txn.stat()["entries"] == 1


def test_a_record_found_under_another_key_is_a_miss_never_that_keys_bytes(tmp_path):
    """Records swapped between keys in the file (pages mixed up, or edited): each names the key
    it was written for, so both read as misses, and neither comes back at the next open."""
    path = str(tmp_path / "ssd")
    tier = SsdTier(path, 4 * MiB)
    put(tier, key(1), b"one" * 1000)
    put(tier, key(2), b"two" * 1000)
    swap = (  # from another process: lmdb opens a file once per process, and the tier holds it
        "import lmdb, sys\n"
        "with lmdb.open(sys.argv[1]) as env, env.begin(write=True) as txn:\n"
        "    a, b = bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3])\n"
        "    one, two = txn.get(a), txn.get(b)\n"
        "    txn.put(a, two)\n"
        "    txn.put(b, one)\n"
    )
    subprocess.run([sys.executable, "-c", swap, path, raw_key(key(1)).hex(), raw_key(key(2)).hex()], check=True)
    assert tier.get(key(1)) is None and tier.get(key(2)) is None
    assert tier.checksum_failures == 2 and len(tier) == 0
    put(tier, key(4), b"four" * 1000)
    tier.close()
    with lmdb.open(path) as env, env.begin(write=True) as txn:
        txn.put(raw_key(key(5)), txn.get(raw_key(key(4))))  # key 4's record, copied under key 5
    tier = SsdTier(path, 4 * MiB)
    assert tier.bad_records == 1 and tier.inventory() == [(key(4), 4000, 0)]
    tier.close()


def test_records_of_the_earlier_format_are_dropped_at_open(tmp_path):
    import struct

    import xxhash

    path = str(tmp_path / "ssd")
    SsdTier(path, 4 * MiB).close()
    with lmdb.open(path) as env, env.begin(write=True) as txn:
        payload = b"old" * 100
        old = struct.pack("<4sIQQ", b"KVS\x01", 0, xxhash.xxh3_64_intdigest(payload), len(payload)) + payload
        txn.put(raw_key(key(1)), old)
    tier = SsdTier(path, 4 * MiB)
    assert tier.bad_records == 1 and tier.get(key(1)) is None
    tier.close()


# -- a damaged lmdb file at open ----------------------------------------------------------------
OPEN_CHILD = r"""
import sys
from kvstore_client.errors import ConfigError
from kvstore.tiers.ssd import SsdTier
try:
    tier = SsdTier(sys.argv[1], 64 << 20)
except ConfigError as exc:
    print("REFUSED", exc)
    sys.exit(3)
print("OPENED", len(tier), sum(len(tier.get(k) or b"") for k in tier.keys()))
"""


def filled_then_cut(tmp_path, keep: float) -> str:
    """An SSD tier of 100 blocks whose data file is then cut to ``keep`` of its size."""
    path = str(tmp_path / "ssd")
    tier = SsdTier(path, 64 * MiB)
    for i in range(100):
        assert put(tier, key(i), seeded(i, 16 * KiB, 64 * KiB))
    tier.close()
    data = os.path.join(path, "data.mdb")
    os.truncate(data, int(os.path.getsize(data) * keep))
    return path


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.001])
def test_a_cut_data_file_is_refused_with_a_message_never_sigbus(tmp_path, keep):
    path = filled_then_cut(tmp_path, keep)
    child = subprocess.run(
        [sys.executable, "-c", OPEN_CHILD, path], env=child_env(), capture_output=True, text=True, timeout=60
    )
    assert child.returncode == 3, f"rc {child.returncode}; stdout {child.stdout!r}; stderr {child.stderr[-2000:]}"
    assert "REFUSED" in child.stdout and "--ssd-damaged move-aside" in child.stdout
    assert "truncated" in child.stdout or "not an lmdb data file" in child.stdout
    assert os.path.exists(os.path.join(path, "data.mdb"))  # refusing leaves the operator's file alone


def test_a_cut_data_file_moved_aside_starts_the_tier_empty(tmp_path, caplog):
    path = filled_then_cut(tmp_path, 0.5)
    size = os.path.getsize(os.path.join(path, "data.mdb"))
    tier = SsdTier(path, 64 * MiB, on_damage="move-aside")
    assert len(tier) == 0 and tier.used_bytes == 0
    assert put(tier, key(7), seeded(7)) and tier.get(key(7)) == seeded(7)
    tier.close()
    aside = [name for name in os.listdir(path) if name.startswith("data.mdb.damaged-")]
    assert len(aside) == 1 and os.path.getsize(os.path.join(path, aside[0])) == size
    assert "moved it to" in caplog.text
    reopened = SsdTier(path, 64 * MiB)  # the new file is whole
    assert reopened.get(key(7)) == seeded(7)
    reopened.close()


def test_a_whole_data_file_opens_as_before(tmp_path):
    path = filled_then_cut(tmp_path, 1.0)
    child = subprocess.run(
        [sys.executable, "-c", OPEN_CHILD, path], env=child_env(), capture_output=True, text=True, timeout=60
    )
    expected = sum(len(seeded(i, 16 * KiB, 64 * KiB)) for i in range(100))
    assert child.stdout.split() == ["OPENED", "100", str(expected)], child.stderr[-2000:]


# -- kill -9 -------------------------------------------------------------------------------------
CHILD = r"""
import random, sys, xxhash
from kvstore.tiers.ssd import SsdTier
path, window = sys.argv[1], int(sys.argv[2])
tier = SsdTier(path, 64 << 20)
def block(i):
    rnd = random.Random(i)
    return rnd.randbytes(rnd.randint(1024, 300 * 1024))
def key(i):
    return ("kill", i.to_bytes(16, "little"))
i = 0
while True:
    if i - window >= 40:  # past the first 40, drop old blocks to stay under budget
        tier.discard_many([key(j) for j in range(i - window, i - window + 4)])
    batch = [(key(j), b, xxhash.xxh3_64_intdigest(b), j) for j in range(i, i + 4) for b in [block(j)]]
    assert all(tier.put_many(batch))
    i += 4
    print("READY", i, flush=True)
"""


def child_env() -> dict:
    """Environment whose PYTHONPATH finds kvstore and kvstore_client as this process does."""
    import kvstore
    import kvstore_client

    roots = []
    for module in (kvstore, kvstore_client):
        package_dir = os.path.dirname(os.path.abspath(module.__file__))
        if os.path.basename(package_dir) == module.__name__:  # else an installed finder maps it
            roots.append(os.path.dirname(package_dir))
    paths = roots + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


@pytest.mark.parametrize("delay", [0.0, 0.013, 0.037])
def test_kill_9_loses_no_committed_block(tmp_path, delay):
    path, window = str(tmp_path / "ssd"), 40
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, path, str(window)],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(10, proc.kill)
    watchdog.start()
    try:
        committed = 0
        while committed < 40 + 2 * window:  # all 40 and some discards are behind us
            line = proc.stdout.readline()
            assert line.startswith("READY"), f"child said {line!r}; stderr: {proc.stderr.read()}"
            committed = int(line.split()[1])
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        rest, _ = proc.communicate(timeout=5)
    finally:
        watchdog.cancel()
    assert proc.returncode == -signal.SIGKILL
    for line in rest.splitlines():  # READY lines printed before the kill landed
        committed = int(line.split()[1])

    tier = SsdTier(path, 64 << 20)
    must_have = set(range(40)) | set(range(max(40, committed - window + 4), committed))
    present = {int.from_bytes(k[1], "little") for k in tier.keys()}
    assert must_have <= present
    assert max(present) < committed + 4  # nothing beyond the batch in flight
    for i in present:
        k = ("kill", i.to_bytes(16, "little"))
        data = tier.get(k)
        assert data == seeded(i), f"block {i} came back wrong"
        assert tier.depth_of(k) == i
    assert tier.checksum_failures == 0 and tier.bad_records == 0
    assert tier.used_bytes == sum(len(seeded(i)) for i in present)
    tier.close()


# -- a full lmdb map -------------------------------------------------------------------------------
def test_full_map_returns_false(tmp_path):
    # 4100-byte payloads take two 4 KiB overflow pages each, so the map
    # (capacity * 1.25 + 32 MiB) fills at about 56 MiB of payload, before the budget.
    tier = SsdTier(str(tmp_path / "ssd"), 64 * MiB)
    payload = b"\xab" * 4100
    checksum = xxhash.xxh3_64_intdigest(payload)
    stored, i, results = [], 0, [True]
    while all(results):
        items = [(key(i + j), payload, checksum, 0) for j in range(2000)]
        results = tier.put_many(items)
        stored += [i + j for j, ok in enumerate(results) if ok]
        i += 2000
    assert results[0] and False in results  # the batch that hit the map stored a prefix
    assert tier.used_bytes == len(stored) * 4100 < tier.capacity_bytes
    assert len(tier) == len(stored)
    for extra in range(10**6, 10**6 + 100):  # single puts: False once full, never an exception
        if not put(tier, key(extra), payload):
            break
        stored.append(extra)
    else:
        pytest.fail("single puts never reported a full map")
    for j in random.Random(0).sample(stored, 50):
        assert tier.get(key(j)) == payload
    assert tier.discard_many([key(j) for j in stored[:100]]) == 100  # deletes still commit when full
    assert put(tier, key(2 * 10**6), payload)  # the freed pages are usable again
    assert tier.used_bytes == (len(stored) - 100 + 1) * 4100
    tier.close()


# -- concurrency -------------------------------------------------------------------------------------
def versioned(k: int, version: int) -> bytes:
    rnd = random.Random(k * 1_000_003 + version)
    return struct.pack("<II", k, version) + rnd.randbytes(rnd.randint(1, 64 * KiB))


def test_concurrent_readers_with_one_writer(tmp_path):
    tier = SsdTier(str(tmp_path / "ssd"), 16 * MiB)
    stop, errors, reads = threading.Event(), [], [0] * 4

    def writer():
        rnd, version = random.Random(1), 0
        try:
            while not stop.is_set():
                version += 1
                k, op = rnd.randrange(32), rnd.random()
                if op < 0.6:
                    put(tier, key(k), versioned(k, version))
                elif op < 0.8:
                    blocks = [(j, versioned(j, version)) for j in rnd.sample(range(32), 4)]
                    tier.put_many([(key(j), d, xxhash.xxh3_64_intdigest(d), 0) for j, d in blocks])
                else:
                    tier.discard(key(k))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    def reader(n: int):
        rnd, out = random.Random(100 + n), memoryview(bytearray(64 * KiB + 8))
        try:
            while not stop.is_set():
                k = rnd.randrange(32)
                if rnd.random() < 0.5:
                    data = tier.get(key(k))
                else:
                    size = tier.get_into(key(k), out)
                    data = None if size is None else bytes(out[:size])
                if data is not None:
                    kid, version = struct.unpack_from("<II", data)
                    assert kid == k and data == versioned(k, version), f"wrong bytes for key {k}"
                    reads[n] += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join(10)
    assert not errors, errors
    assert all(reads), reads
    assert tier.checksum_failures == 0
    assert tier.used_bytes == sum(tier.size_of(k) for k in tier.keys())
    tier.close()
