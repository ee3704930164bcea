"""kvstore_client.vllm.cpu_amx: the connector asks for AMX tile permission where the CPU has
AMX, so that vLLM's AMX attention may run before anything else asked (a decode engine's first
step). Each check runs in a fresh interpreter: the permission, once given, is the process's."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from tests.processes import ROOT

pytestmark = pytest.mark.skipif(
    not (sys.platform == "linux" and platform.machine() == "x86_64"), reason="AMX is x86-64 Linux's"
)

PROBE = """
import json, threading
from kvstore_client.vllm.cpu_amx import amx_permitted, permit_amx
before = amx_permitted()
granted = permit_amx()
seen = []
thread = threading.Thread(target=lambda: seen.append(amx_permitted()))
thread.start(); thread.join()
print(json.dumps({"before": before, "granted": granted, "after": amx_permitted(), "thread": seen[0]}))
"""


def cpu_has_amx_tiles() -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and " amx_tile" in line for line in f)


def test_permit_amx_grants_the_process_amx_tiles_exactly_where_the_cpu_has_them():
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    result = json.loads(out.stdout)
    assert result["before"] is False  # a fresh interpreter has not asked
    has_amx = cpu_has_amx_tiles()
    assert result == {"before": False, "granted": has_amx, "after": has_amx, "thread": has_amx}
