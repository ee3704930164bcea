"""What of the SDK's device side runs without a GPU: which tensors it refuses and how, the
staging pool's accounting, arena mappings found and released, the SDK without torch, and
bench.gpu_check's answer on a machine without one. The CUDA copies themselves run only on a
GPU, in ``python -m bench.gpu_check``."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvstore_client import DeviceUnavailable, InvalidValue, make_key
from kvstore_client.arenamap import map_arena, mapping_at, on_unmap, unmap_arena
from kvstore_client.cuda import StagingPool, chunks, device_problem

ROOT = Path(__file__).resolve().parent.parent


def test_only_cpu_and_reachable_cuda_devices_are_buffers():
    assert device_problem("cuda", 0, True, 1) is None
    assert device_problem("cuda", None, True, 1) is None
    assert "sees 2 CUDA device(s)" in device_problem("cuda", 2, True, 2)
    assert "no usable CUDA" in device_problem("cuda", 0, False, 0)
    assert "CPU and CUDA tensors only" in device_problem("meta", None, False, 0)
    assert "CPU and CUDA tensors only" in device_problem("xpu", 0, True, 1)


def test_a_tensor_on_a_device_this_process_cannot_reach_is_refused_before_anything_is_sent():
    torch = pytest.importorskip("torch")
    from kvstore_client import Client

    meta = torch.empty(1024, device="meta")  # a real tensor outside host memory, on every torch build
    with Client("127.0.0.1:1", timeout=1.0) as client:  # no pool: the buffers are checked first
        for call in (
            lambda: client.put(make_key("d", b"k"), meta),
            lambda: client.batch_put([make_key("d", b"k")], [meta]),
            lambda: client.get_into(make_key("d", b"k"), meta),
            lambda: client.batch_get_into([make_key("d", b"k")], [meta]),
        ):
            with pytest.raises(DeviceUnavailable) as raised:
                call()
            assert raised.value.device == "meta" and isinstance(raised.value, InvalidValue)
        with pytest.raises(InvalidValue, match="contiguous"):
            client.put(make_key("d", b"k"), torch.zeros(8, 8)[:, ::2])


def test_staging_pool_lends_at_most_its_limit_and_never_waits_for_a_second_buffer():
    made = []
    pool = StagingPool(lambda n: made.append(bytearray(n)) or made[-1], chunk=4096, limit=3)
    first = pool.take(2)
    assert len(first) == 2 and pool.made == 2 and pool.lent == 2 and all(len(b) == 4096 for b in first)
    second = pool.take(3)  # one more exists: it gets that one and does not wait for the rest
    assert len(second) == 1 and pool.made == 3 and pool.lent == 3
    with pytest.raises(TimeoutError):
        pool.take(1, timeout=0.05)
    pool.give_back(first)
    again = pool.take(3)
    assert len(again) == 2 and pool.made == 3 and {id(b) for b in again} == {id(b) for b in first}
    pool.give_back(again + second)
    assert pool.lent == 0


def test_staging_pool_wakes_a_waiter_when_a_buffer_comes_back():
    pool = StagingPool(bytearray, chunk=16, limit=1)
    held = pool.take(1)
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.take(1, timeout=5)))
    waiter.start()
    pool.give_back(held)
    waiter.join(5)
    assert got == [held] and pool.lent == 1


def test_staging_pool_counts_nothing_for_a_buffer_that_could_not_be_made():
    def allocate(n):
        raise MemoryError("no pinned memory")

    pool = StagingPool(allocate, chunk=16, limit=2)
    with pytest.raises(MemoryError):
        pool.take(1)
    assert pool.made == 0 and pool.lent == 0
    with pytest.raises(ValueError):
        StagingPool(bytearray, chunk=16, limit=0)


def test_chunks_cover_a_transfer_exactly():
    assert chunks(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert chunks(8, 4) == [(0, 4), (4, 4)]
    assert chunks(3, 4) == [(0, 3)]
    assert chunks(0, 4) == []


def test_arena_mappings_are_found_by_address_and_say_when_they_go(tmp_path):
    path = tmp_path / "arena"
    path.write_bytes(bytes(1 << 20))
    handle, view = map_arena(str(path))
    import ctypes

    anchor = ctypes.c_char.from_buffer(view)
    base = ctypes.addressof(anchor)
    del anchor
    found = mapping_at(base + 4096)
    assert found is not None and found[0] == handle and len(found[1]) == 1 << 20
    assert mapping_at(base + (1 << 20)) is None or mapping_at(base + (1 << 20))[0] != handle
    gone = []
    assert on_unmap(handle, lambda: gone.append(True))
    second, other = map_arena(str(path))  # a second user of the same mapping
    assert second == handle
    other.release()
    unmap_arena(handle)
    assert gone == []  # one user left
    del found
    view.release()
    unmap_arena(handle)
    assert gone == [True] and mapping_at(base + 4096) is None
    assert not on_unmap(handle, lambda: None)


def test_the_sdk_imports_and_moves_host_buffers_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np\n"
        "import kvstore_client, kvstore_client.client, kvstore_client.shm, kvstore_client.cuda\n"
        "from kvstore_client.buffers import buffer_view\n"
        "assert bytes(buffer_view(b'abc')) == b'abc' and buffer_view(np.zeros(4, np.float32)).nbytes == 16\n"
        "import kvstore_client.vllm.layouts\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_gpu_check_without_a_gpu_says_so_and_exits_0():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: bench.gpu_check runs its checks")
    out = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["gpu"] is False and "CUDA" in result["reason"]
    assert "no GPU" in out.stderr  # progress goes to stderr, the JSON alone to stdout


def test_gpu_check_runs_every_check_on_cpu_tensors_as_a_dry_run():
    pytest.importorskip("torch")
    out = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--json", "--device", "cpu", "--sizes", "1", "--repeats", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    result = json.loads(out.stdout)
    assert [c for c in result["checks"] if not c["ok"]] == [] and out.returncode == 0, out.stderr[-3000:]
    assert result["gpu"] is False and result["device"] == "cpu"
    assert {(c["path"], c["dtype"]) for c in result["checks"]} >= {
        (p, d) for p in ("shm", "tcp") for d in ("bfloat16", "float16", "float32")
    }
    assert [r["size_mib"] for r in result["rates"]] == [1] and result["rates"][0]["shm_round_trip_ok"]
