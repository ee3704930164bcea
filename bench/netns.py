"""Simulated hosts on one machine: Linux network namespaces on a bridge, each with its own machine id.

A ``Network`` is a "switch" namespace holding a bridge; each ``Host`` is a namespace with
one veth (``eth0``) into that bridge, one address (``10.77.0.N/24`` by default) and
loopback. No address or route is added to the root namespace, so nothing outside the
namespaces can reach them, and two runs never collide: every name carries the pid of the
process that made it (``kvnet<pid>-<host>``).

The machine id: ``ip netns exec NAME cmd`` runs ``cmd`` in a fresh mount namespace in
which every file of ``/etc/netns/NAME/`` is bind-mounted over its namesake in ``/etc``
(man ip-netns). Each host gets ``/etc/netns/NAME/machine-id``, so
``kvstore_client.hostid.machine_id()`` differs from host to host and agrees within one:
a client in a node's host takes the shared-memory path, a client elsewhere TCP. /dev/shm
stays the machine's own, shared by all hosts; the machine id is what decides.

``Network.close()`` (also on ``with`` exit) kills what runs in its namespaces, deletes
them (which removes their veths) and their ``/etc/netns`` entries. A run that died before
that leaves its names behind; the next ``Network`` removes those whose pid is gone, killing
what still runs in them (runs that share ``/run/netns`` are taken to share a pid namespace).

Root only; ``unavailable()`` says why a machine cannot do this (for skips).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import die_with_parent

PREFIX = "kvnet"
ETC_NETNS = Path("/etc/netns")
ROOT = Path(__file__).resolve().parent.parent
_STALE = re.compile(rf"^{PREFIX}(\d+)-")


class NetnsUnavailable(RuntimeError):
    """This machine cannot make the namespaces (not root, no ``ip``, creation refused)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``ip ARGS``; NetnsUnavailable carrying its stderr if it fails and ``check``."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can (a throwaway one is tried)."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    name = f"{PREFIX}{os.getpid()}-probe"
    try:
        ip("netns", "add", name)
    except NetnsUnavailable as exc:
        return f"cannot create a network namespace: {exc}"
    ip("netns", "del", name, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_namespace(name: str) -> None:
    """Kill the processes in namespace ``name`` (by pid), delete it and its /etc/netns entry."""
    pids = ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    ip("netns", "del", name, check=False)
    shutil.rmtree(ETC_NETNS / name, ignore_errors=True)


def _cleanup_etc_netns() -> None:
    try:
        ETC_NETNS.rmdir()  # only when empty: another run's entries stay
    except OSError:
        pass


def sweep_stale() -> list[str]:
    """Remove namespaces and /etc/netns entries left by runs whose process is gone; their names."""
    names = [line.split()[0] for line in ip("netns", "list", check=False).stdout.splitlines() if line.strip()]
    if ETC_NETNS.is_dir():
        names += [entry for entry in os.listdir(ETC_NETNS) if entry not in names]
    stale = [n for n in names if (m := _STALE.match(n)) and not _pid_alive(int(m.group(1)))]
    for name in stale:
        _remove_namespace(name)
    if stale:
        _cleanup_etc_netns()
    return stale


class Host:
    """One simulated machine: a network namespace with an address and its own machine id."""

    def __init__(self, network: "Network", name: str, address: str, netns: str, machine_id: str):
        self.network, self.name, self.address, self.netns, self.machine_id = network, name, address, netns, machine_id
        self.port = f"p-{name}"  # its veth's other end, on the switch's bridge

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` as run inside this host."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 60)
        return subprocess.run(self.command(argv), **kwargs)

    def set_link(self, up: bool) -> None:
        """Plug this host's cable in or out (its bridge port up or down): the others stop
        reaching it and it them, while its own address still answers inside it."""
        ip("-n", self.network.switch, "link", "set", "dev", self.port, "up" if up else "down")

    def block(self, address: str) -> None:
        """Cut this host off from ``address`` alone: a ``prohibit`` route inside this host, so
        what it sends there is refused locally (new connections fail, established ones stall:
        their packets and replies go nowhere), while every other host still reaches it and it them."""
        ip("-n", self.netns, "route", "add", "prohibit", f"{address}/32")

    def unblock(self, address: str) -> None:
        """Undo ``block(address)``."""
        ip("-n", self.netns, "route", "del", "prohibit", f"{address}/32")

    def python(self, env: dict | None = None) -> "Interpreter":
        """A Python process in this host that runs code sent to it (see Interpreter)."""
        return self.network._track(Interpreter(self, env))


class Network:
    """A switch and the hosts plugged into it; ``close()`` removes all of it."""

    def __init__(self, subnet: str = "10.77.0"):
        sweep_stale()
        self.tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}"
        if len(self.tag) > 40:
            raise NetnsUnavailable(f"namespace prefix {self.tag!r} too long")
        self.subnet = subnet
        self.switch = f"{self.tag}-sw"
        self.hosts: list[Host] = []
        self._namespaces: list[str] = []
        self._interpreters: list[Interpreter] = []
        try:
            self._add_namespace(self.switch)
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "dev", "br0", "up")
        except BaseException:
            self.close()
            raise

    def _add_namespace(self, name: str) -> None:
        ip("netns", "add", name)
        self._namespaces.append(name)

    def add_host(self, name: str) -> Host:
        """A new host ``name`` (a few letters) at the subnet's next address, with its own machine id."""
        if not re.fullmatch(r"[a-z0-9]{1,8}", name) or any(h.name == name for h in self.hosts):
            raise ValueError(f"host name must be new and 1-8 lowercase letters or digits: {name!r}")
        netns = f"{self.tag}-{name}"
        address = f"{self.subnet}.{len(self.hosts) + 1}"
        machine_id = secrets.token_hex(16)
        self._add_namespace(netns)
        host = Host(self, name, address, netns, machine_id)
        for _ in range(5):  # another run may remove an empty /etc/netns between mkdir and the write
            try:
                (ETC_NETNS / netns).mkdir(parents=True, exist_ok=True)
                (ETC_NETNS / netns / "machine-id").write_text(machine_id + "\n")
                break
            except FileNotFoundError:
                time.sleep(0.01)
        ip("link", "add", "eth0", "netns", netns, "type", "veth", "peer", "name", host.port, "netns", self.switch)
        ip("-n", self.switch, "link", "set", "dev", host.port, "master", "br0")
        ip("-n", self.switch, "link", "set", "dev", host.port, "up")
        ip("-n", netns, "link", "set", "dev", "lo", "up")
        ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", netns, "link", "set", "dev", "eth0", "up")
        seen = host.run(["cat", "/etc/machine-id"]).stdout.strip()
        if seen != machine_id:
            raise NetnsUnavailable(
                f"`ip netns exec` did not bind /etc/netns/{netns}/machine-id over "
                f"/etc/machine-id (saw {seen!r}): hosts would share a machine id"
            )
        self.hosts.append(host)
        return host

    def _track(self, interpreter: "Interpreter") -> "Interpreter":
        self._interpreters.append(interpreter)
        return interpreter

    def close(self) -> None:
        """Stop the interpreters, kill whatever else runs in the hosts, delete every namespace
        (and with them the veths) and /etc/netns entry. Safe to call twice."""
        for interpreter in self._interpreters:
            interpreter.close()
        self._interpreters.clear()
        for name in reversed(self._namespaces):
            _remove_namespace(name)
        self._namespaces.clear()
        _cleanup_etc_netns()

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_AGENT = r"""
import json, os, sys, traceback
channel = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # what the code prints goes to stderr, not into the replies
scope = {"__name__": "agent"}
for line in sys.stdin:
    request = json.loads(line)
    try:
        if request["mode"] == "exec":
            exec(request["code"], scope)
            reply = json.dumps({"value": None})
        else:
            reply = json.dumps({"value": eval(request["code"], scope)})
    except BaseException:
        reply = json.dumps({"error": traceback.format_exc()})
    channel.write(reply + "\n")
    channel.flush()
"""


class AgentError(AssertionError):
    """Code sent to an Interpreter raised; the message is its traceback there."""


class Interpreter:
    """A Python process inside a host: ``exec(code)`` runs statements there, ``eval(expr)``
    returns an expression's value (anything JSON can carry). Its globals persist between
    calls, so a client made in one call serves the next. It runs this repository's code
    (PYTHONPATH), its stderr goes to a file (``stderr()``), and it dies with its parent."""

    def __init__(self, host: Host, env: dict | None = None):
        self.host = host
        self._err = tempfile.TemporaryFile("w+")
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(
            host.command([sys.executable, "-c", _AGENT]),
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            preexec_fn=die_with_parent,
        )
        self._buffer = b""

    def exec(self, code: str, timeout: float = 60, wait: bool = True) -> None:
        """Run statements; ``wait=False`` returns at once (``result()`` then waits for the end)."""
        self._send("exec", code)
        if wait:
            self.result(timeout)

    def eval(self, expr: str, timeout: float = 60):
        self._send("eval", expr)
        return self.result(timeout)

    def _send(self, mode: str, code: str) -> None:
        self.proc.stdin.write((json.dumps({"mode": mode, "code": code}) + "\n").encode())
        self.proc.stdin.flush()

    def result(self, timeout: float = 60):
        """The value of the oldest call not answered yet; AgentError if it raised there."""
        reply = json.loads(self._line(timeout))
        if "error" in reply:
            raise AgentError(f"in host {self.host.name}:\n{reply['error']}")
        return reply["value"]

    def _line(self, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise AgentError(f"host {self.host.name}: no reply within {timeout}s\n{self.stderr()[-3000:]}")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise AgentError(f"host {self.host.name}: the interpreter exited\n{self.stderr()[-3000:]}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def stderr(self) -> str:
        self._err.flush()
        self._err.seek(0)
        return self._err.read()

    def close(self) -> None:
        """End of input: the interpreter exits (killed if it has not within 10 s)."""
        try:
            self.proc.stdin.close()
        except OSError:  # it died already
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self._err.close()
