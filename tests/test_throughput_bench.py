"""`kvstore bench` (kvstore.benchmark, bench.throughput) in a tiny configuration, without Redis."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvstore.benchmark import OPS, Settings, format_table, run
from kvstore.cli import main

SIZES = [16 << 10, 64 << 10]
FIELDS = ("kvstore_gbps", "redis_gbps", "redis_c_gbps", "socket_gbps", "memcpy_gbps", "p50_ms", "p99_ms")


@pytest.fixture(scope="module")
def result():
    settings = Settings(
        sizes=SIZES, clients=[1, 2], bytes_per_client=256 << 10, batch=4, rounds=1, redis=False, progress=False
    )
    return run(settings)


def test_one_record_per_size_op_transport_clients(result):
    records = result["records"]
    assert {(r["size"], r["op"], r["transport"], r["clients"]) for r in records} == {
        (s, op, t, c) for s in SIZES for op in OPS for t in ("tcp", "shm") for c in (1, 2)
    }
    assert len(records) == len(SIZES) * len(OPS) * 2 * 2
    for r in records:
        assert all(f in r for f in FIELDS)
        assert r["kvstore_gbps"] > 0 and r["kvstore_ops_s"] > 0
        assert 0 < r["p50_ms"] <= r["p99_ms"]
        assert r["socket_gbps"] > 0 and r["memcpy_gbps"] > 0 and r["vs_socket"] > 0 and r["vs_memcpy"] > 0
        assert r["batch"] == (4 if r["op"].startswith("batch") else 1)


def test_missing_redis_is_null_with_a_note(result):
    assert any("--no-redis" in n for n in result["notes"])
    for r in result["records"]:
        assert r["redis_gbps"] is None and r["redis_c_gbps"] is None
        assert r["vs_redis"] is None and r["vs_redis_c"] is None
        assert any("Redis" in n for n in r["notes"]) and any("redis-benchmark" in n for n in r["notes"])
    redis_targets = [t for t in result["targets"] if "Redis" in t["target"] or "redis" in t["target"]]
    assert redis_targets and all(t["met"] is None for t in redis_targets)
    json.dumps(result)  # plain JSON


def test_table_lists_every_record_and_the_notes(result):
    text = format_table(result)
    assert text.count("\n| ") >= len(result["records"])
    assert "--no-redis" in text


def test_cli_json(tmp_path):
    args = [
        "bench",
        "--sizes",
        "16KiB",
        "--ops",
        "put,get_into",
        "--transports",
        "tcp",
        "--clients",
        "1",
        "--bytes",
        "64KiB",
        "--batch",
        "2",
        "--rounds",
        "1",
        "--no-redis",
        "--quiet",
        "--json",
    ]
    try:
        import matplotlib  # noqa: F401

        args += ["--plot", str(tmp_path / "bench.png")]
    except ImportError:
        pass
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 0, out.output
    records = json.loads(out.output)["records"]
    assert [(r["op"], r["transport"], r["clients"]) for r in records] == [("put", "tcp", 1), ("get_into", "tcp", 1)]
    assert all(r["kvstore_gbps"] > 0 and r["redis_gbps"] is None for r in records)
    if "--plot" in args:
        assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_rejects_unknown_op():
    out = CliRunner().invoke(main, ["bench", "--ops", "scan", "--no-redis"])
    assert out.exit_code != 0 and "scan" in out.output


def test_ctrl_c_stops_the_benchmark_cleanly(tmp_path):
    """Ctrl-C reaches the whole process group: the pool, the client processes and the parent.
    Sent once measuring has begun (a progress line), when every helper is up.

    Nothing here depends on how fast the machine is: the run is far too long to end before the
    Ctrl-C (--rounds), the working set is small so a loaded machine gets to measuring soon, and
    the waits are for events (the progress line, the exit) with wide limits. The benchmark gets
    SIGINT's default disposition, as from a terminal, even when the tests run where SIGINT is
    ignored (a shell's background job), which a child would otherwise inherit."""
    import os
    import signal
    import subprocess
    import sys
    import threading

    from tests.processes import wait_for

    def as_from_a_terminal() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    env = dict(os.environ, KVSTORE_SHM_DIR=str(tmp_path))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore.cli",
            "bench",
            "--sizes",
            "1MiB",
            "--no-redis",
            "--clients",
            "2",
            "--bytes",
            "8MiB",
            "--batch",
            "4",
            "--rounds",
            "100000",
        ],
        start_new_session=True,
        preexec_fn=as_from_a_terminal,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    err = bytearray()

    def collect() -> None:
        for chunk in iter(lambda: proc.stderr.read1(4096), b""):
            err.extend(chunk)

    reader = threading.Thread(target=collect)
    reader.start()
    try:
        wait_for(lambda: b"clients" in err or proc.poll() is not None, timeout=600)
        assert proc.poll() is None, err.decode(errors="replace")  # still measuring
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(30)
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode != 0 and b"Traceback" not in err, err.decode(errors="replace")
    mine = tmp_path / f"kvstore.{os.getuid()}"  # this user's shm directory stays, for the next node
    assert os.listdir(tmp_path) == [mine.name] and os.listdir(mine) == []  # arena, directory, socket removed


@pytest.mark.parametrize(
    "args",
    [
        ["--clients", "0"],
        ["--clients", "2,-1"],
        ["--rounds", "0"],
        ["--batch", "-1"],
        ["--sizes", "0"],
        ["--bytes", "0"],
    ],
)
def test_settings_that_cannot_run_are_a_usage_error(args, capsys):
    from bench import throughput

    with pytest.raises(SystemExit) as exit_:
        throughput.main(args + ["--no-redis", "--quiet", "--ops", "put", "--transports", "tcp"])
    assert exit_.value.code == 2 and args[0][2:] in capsys.readouterr().err
