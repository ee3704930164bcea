"""Bad trace files for bench.replay and bench.hit_rate: a clear error naming the file and line, exit
status non-zero; never a traceback, never a report of zeros. Traces are written here, small."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

GOOD = {"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]}
BENCHES = {"replay": ["--prefill", "1", "--decode", "1"], "hit_rate": []}


def write_trace(path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def good_line(**changes) -> str:
    return json.dumps({**GOOD, **changes})


def run_bench(name: str, trace: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", f"bench.{name}", "--trace", trace, "--json", *BENCHES[name]],
        capture_output=True,
        text=True,
        timeout=300,
    )


def without(field: str) -> str:
    return json.dumps({k: v for k, v in GOOD.items() if k != field})


# (the trace's lines, which line is wrong, what the error says); both benches need timestamp and hash_ids
BAD = {
    "truncated": ([good_line(), good_line(timestamp=5)[:30]], 2, "not a JSON object"),
    "no timestamp": ([good_line(), "", without("timestamp")], 3, "missing field timestamp"),
    "no hash_ids": ([without("hash_ids")], 1, "missing field hash_ids"),
    "hash_ids not a list": ([good_line(), good_line(hash_ids="abc")], 2, "hash_ids must be a list of integers"),
    "a hash id not an int": ([good_line(hash_ids=[1, "2"])], 1, "hash_ids must be a list of integers"),
    "timestamp not a number": ([good_line(timestamp="soon")], 1, "timestamp must be a number"),
    "not an object": ([good_line(), "[1, 2]"], 2, "expected a JSON object"),
}


@pytest.mark.parametrize("name", sorted(BENCHES))
@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_line_names_the_file_and_line(tmp_path, name, case):
    lines, number, what = BAD[case]
    trace = write_trace(tmp_path / "t.jsonl", lines)
    result = run_bench(name, trace)
    assert result.returncode != 0 and result.stdout == ""
    assert "Traceback" not in result.stderr, result.stderr
    assert f"{trace}:{number}: {what}" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("field", ["input_length", "output_length"])
def test_replay_needs_the_lengths(tmp_path, field):
    trace = write_trace(tmp_path / "t.jsonl", [good_line(), good_line(**{field: -3}), without(field)])
    result = run_bench("replay", trace)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert f"{trace}:2: {field} must be a non-negative integer" in result.stderr
    trace = write_trace(tmp_path / "t.jsonl", [good_line(), without(field)])
    assert f"{trace}:2: missing field {field}" in run_bench("replay", trace).stderr


def test_hit_rate_does_not_need_the_lengths(tmp_path):
    trace = write_trace(
        tmp_path / "t.jsonl",
        [json.dumps({"timestamp": 0, "hash_ids": [1, 2]}), json.dumps({"timestamp": 1, "hash_ids": [1, -3]})],
    )
    result = run_bench("hit_rate", trace)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["hit_blocks"] == 1


@pytest.mark.parametrize("name", sorted(BENCHES))
@pytest.mark.parametrize("lines", [[], ["", "   "]], ids=["empty", "blank lines"])
def test_an_empty_trace_is_an_error(tmp_path, name, lines):
    trace = write_trace(tmp_path / "t.jsonl", lines)
    result = run_bench(name, trace)
    assert result.returncode != 0 and result.stdout == "" and "Traceback" not in result.stderr
    assert f"{trace}: the trace holds no requests" in result.stderr


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_a_missing_trace_is_an_error(tmp_path, name):
    result = run_bench(name, str(tmp_path / "nowhere.jsonl"))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "nowhere.jsonl: cannot read the trace" in result.stderr


def test_one_reader_for_both():
    from bench import hit_rate, replay
    from bench.trace import read_trace

    assert "read_trace" in hit_rate.load_trace.__code__.co_names
    assert "read_trace" in replay.load_requests.__code__.co_names
    assert read_trace  # bench.trace is where traces are read


def test_the_reader_keeps_timestamp_order_and_the_limit(tmp_path):
    from bench.trace import read_trace

    trace = write_trace(tmp_path / "t.jsonl", [good_line(timestamp=t, hash_ids=[t]) for t in (3, 1, 2, 1)])
    assert [r["timestamp"] for r in read_trace(trace)] == [1, 1, 2, 3]
    assert [r["hash_ids"] for r in read_trace(trace, limit=2)] == [[1], [1]]
