"""The kvstore command, run as a user would."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

COMMANDS = [["--help"], ["demo", "--help"]]


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
    result = kvstore("demo", "--data-dir", str(tmp_path), "--dram", "8MiB", "--ssd", "32MiB",
                     "--blocks", "24", "--block-size", "512KiB", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["matched"] == report["verified"] == 24
    assert report["stats"]["dram"]["demotions"] > 0
    assert report["stats"]["ssd"]["checksum_failures"] == 0


def test_demo_table_output(tmp_path):
    result = kvstore("demo", "--data-dir", str(tmp_path), "--dram", "4MiB", "--ssd", "8MiB", "--blocks", "8",
                     "--block-size", "256KiB")
    assert result.returncode == 0, result.stderr
    assert "dram" in result.stdout and "ssd" in result.stdout and "read back byte-exact" in result.stdout


def test_bad_size_is_a_clear_error():
    result = kvstore("demo", "--dram", "lots")
    assert result.returncode == 2 and "not a size" in result.stderr
