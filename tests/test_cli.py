"""The kvstore command, run as a user would."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from kvstore.tiers.arena import shm_dir

COMMANDS = [["--help"]] + [[c, "--help"] for c in ("demo", "up", "master", "node", "status", "keys", "bench")]


def kvstore(*args: str, cwd=None) -> subprocess.CompletedProcess:
    exe = shutil.which("kvstore")
    cmd = [exe] if exe else [sys.executable, "-m", "kvstore.cli"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.mark.parametrize("args", COMMANDS)
def test_help(args):
    result = kvstore(*args)
    assert result.returncode == 0, result.stderr
    assert "Usage:" in result.stdout


def test_demo_stores_overflows_and_verifies(tmp_path):
    result = kvstore(
        "demo",
        "--data-dir",
        str(tmp_path),
        "--dram",
        "8MiB",
        "--ssd",
        "32MiB",
        "--blocks",
        "24",
        "--block-size",
        "512KiB",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["matched"] == report["verified"] == 24
    assert report["stats"]["dram"]["demotions"] > 0
    assert report["stats"]["ssd"]["checksum_failures"] == 0


def test_demo_table_output(tmp_path):
    result = kvstore(
        "demo",
        "--data-dir",
        str(tmp_path),
        "--dram",
        "4MiB",
        "--ssd",
        "8MiB",
        "--blocks",
        "8",
        "--block-size",
        "256KiB",
    )
    assert result.returncode == 0, result.stderr
    assert "dram" in result.stdout and "ssd" in result.stdout and "read back byte-exact" in result.stdout


def test_bad_size_is_a_clear_error():
    result = kvstore("demo", "--dram", "lots")
    assert result.returncode == 2 and "not a size" in result.stderr


def test_up_serves_status_keys_and_stops_cleanly_on_sigterm(tmp_path):
    from kvstore_client import BlockHasher, Client
    from tests.processes import Service, wait_for

    up = Service(
        [
            "up",
            "--port",
            "0",
            "--data-port",
            "0",
            "--metrics-port",
            "0",
            "--data-dir",
            str(tmp_path),
            "--dram",
            "64MiB",
            "--ssd",
            "128MiB",
        ]
    )
    try:
        master = up.record["master"]
        keys = BlockHasher("cli-test", 4).keys(list(range(12)))
        with Client(master, location_ttl=0) as client:  # exists() then reflects the master's index only
            client.batch_put(keys, [b"v" * 1000] * len(keys))
            wait_for(lambda: all(client.batch_exists(keys)))
        status = json.loads(kvstore("status", "--master", master, "--json").stdout)
        assert [n["node_id"] for n in status["nodes"]] == [up.record["node_id"]]
        assert status["indexed_keys"] == 3 and status["nodes"][0]["alive"]
        assert up.record["node_id"] in kvstore("status", "--master", master).stdout
        listed = json.loads(kvstore("keys", "--master", master, "--namespace", "cli-test", "--json").stdout)
        assert sorted(bytes.fromhex(k["digest"]) for k in listed["keys"]) == sorted(k[1] for k in keys)
        unknown = kvstore("keys", "--master", master, "--namespace", "cli-tset")
        assert unknown.returncode == 1 and "namespace 'cli-tset'" in unknown.stderr and "cli-test" in unknown.stderr
        assert up.terminate() == 0
        assert not os.path.exists(up.record["unix_socket"])
        assert not os.path.exists(os.path.join(shm_dir(), up.record["shm_arena"]))
    finally:
        up.close()


def test_status_of_an_unreachable_master_is_a_clear_error():
    result = kvstore("status", "--master", "127.0.0.1:1")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "unreachable" in (result.stderr + result.stdout).lower()


def test_node_puts_its_arena_in_the_shm_dir_it_is_given(tmp_path):
    from tests.processes import Service

    arenas = tmp_path / "arenas"
    arenas.mkdir()
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
            str(tmp_path / "d"),
            "--dram",
            "16MiB",
            "--ssd",
            "0",
            "--shm-dir",
            str(arenas),
            "--advertise",
            "localhost",
        ]
    )
    try:
        mine = arenas / f"kvstore.{os.getuid()}"  # this user's directory in the shm dir, 0700
        assert os.path.exists(mine / up.record["shm_arena"]) and os.stat(mine).st_mode & 0o777 == 0o700
        assert up.record["data"].startswith("localhost:")  # what clients elsewhere are told to dial
        assert up.record["unix_socket"].startswith(str(arenas))
        status = json.loads(kvstore("status", "--master", up.record["master"], "--json").stdout)
        pages = status["nodes"][0]["arena_pages"]
        assert pages in ("huge", "4KiB")  # what backs the arena, as the node found it (tests/test_arena.py)
        assert f"dram ({pages} pages)" in kvstore("status", "--master", up.record["master"]).stdout
        assert up.terminate() == 0
        assert os.listdir(mine) == []  # arena, block directory and socket all removed
    finally:
        up.close()


def test_a_missing_shm_dir_is_a_clear_error(tmp_path):
    result = kvstore("up", "--shm-dir", str(tmp_path / "nowhere"))
    assert result.returncode == 2 and "not a directory" in result.stderr


def test_an_shm_dir_too_deep_for_a_unix_socket_is_a_clear_error(tmp_path):
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    result = kvstore(
        "up", "--port", "0", "--metrics-port", "-1", "--data-dir", str(tmp_path / "data"), "--shm-dir", str(deep)
    )
    assert result.returncode != 0 and "choose a shorter --shm-dir" in result.stderr
    assert "Traceback" not in result.stderr


def test_stop_signals_catch_a_signal_sent_before_serving_then_stop_in_order():
    import signal

    from kvstore.serving import StopSignals

    before = signal.getsignal(signal.SIGTERM)
    signals = StopSignals()
    os.kill(os.getpid(), signal.SIGTERM)  # during start-up, say
    stopped = []
    signals.serve([lambda: stopped.append("node"), lambda: stopped.append("master")])
    assert stopped == ["node", "master"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_stop_signals_wait_sleeps_until_a_signal_from_another_thread():
    """wait() blocks without waking up to poll (a few schedules of the main thread in 1.5 s,
    where polling every 0.1 s took fifteen or more) and returns on a signal sent meanwhile."""
    import signal
    import threading

    from kvstore.serving import StopSignals

    def main_thread_runs() -> int:  # times the scheduler put this (main) thread on a CPU
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[2])

    signals = StopSignals()
    sender = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM))
    sender.start()
    before = main_thread_runs()
    signals.serve([])
    assert main_thread_runs() - before < 10  # the signal's wake-up, and handing the GIL to and fro
    sender.join()
    assert signal.set_wakeup_fd(-1) == -1  # the wakeup pipe was handed back
