"""A client of another user on a node's host: the node's socket and arena sit in a 0700
directory of the node's user, so that client uses TCP (and says so once), and works.

Real master and node processes (this user); the client is a process of uid 65534 (nobody),
which needs this test to run as root.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import sysconfig

import pytest

from tests.processes import ROOT, start_master, start_node

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another user")
NOBODY = 65534

CLIENT = r"""
import logging, site, sys
site.addsitedir(sys.argv[2])  # the test's environment (its .pth files map kvstore_client)
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
from kvstore_client import Client
key, value = ("other-uid", b"k" * 16), bytes(range(256)) * 512
with Client(sys.argv[1]) as client:
    client.put(key, value)
    assert client.get(key) == value
print("ROUND TRIP OK", flush=True)
"""


def as_nobody(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd="/", user=NOBODY, group=NOBODY, extra_groups=[], capture_output=True, text=True, **kwargs
    )


def interpreter_for_nobody() -> str:
    """This Python, or the system's of the same version when this one is in a place (a home
    directory) that user cannot enter."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (sys.executable, f"/usr/bin/{version}", f"/usr/local/bin/{version}"):
        try:
            if as_nobody([candidate, "-c", "pass"], timeout=30).returncode == 0:
                return candidate
        except OSError:
            continue
    pytest.skip(f"no {version} that uid {NOBODY} may run")


def test_a_client_of_another_user_uses_tcp_and_works(tmp_path):
    python = interpreter_for_nobody()
    master = start_master()
    node = start_node(master.record["master"], tmp_path / "node")
    try:
        socket_path = node.record["unix_socket"]
        private = os.path.dirname(socket_path)
        assert stat.S_IMODE(os.stat(private).st_mode) == 0o700 and os.stat(private).st_uid == os.getuid()
        child = as_nobody(
            [python, "-c", CLIENT, master.record["master"], sysconfig.get_paths()["purelib"]],
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            timeout=60,
        )
        assert child.returncode == 0, child.stderr[-3000:]
        assert "ROUND TRIP OK" in child.stdout
        assert child.stderr.count("runs as another user") == 1  # said once, not per connection
        assert "Traceback" not in child.stderr
    finally:
        node.close()
        master.close()
