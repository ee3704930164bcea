"""The pool under test (a master and one storage node) and the helper processes the benchmark starts."""

from __future__ import annotations

import signal
import tempfile
from contextlib import contextmanager


def _start_master_and_node(config, data_dir: str):
    """A master on a free loopback port and a node registered with it (or 10 s spent waiting)."""
    from kvstore.master.server import MasterServer
    from kvstore.node.daemon import NodeOptions, StorageNode

    master = MasterServer(host="127.0.0.1", port=0, ttl_s=5.0, heartbeat_interval_s=0.5).start()
    node = StorageNode(
        config, NodeOptions(master=master.address, port=0, data_dir=data_dir, register_wait_s=10)
    ).start()
    return master, node


@contextmanager
def embedded_pool(dram: int):
    """A master and one storage node in this process, on free loopback ports (for tests and
    examples; the benchmark runs its pool in a process of its own, see ``serve_pool``)."""
    from kvstore.node.config import StoreConfig

    with tempfile.TemporaryDirectory() as tmp:
        config = StoreConfig(dram_capacity=dram, max_block_bytes=min(dram, 64 << 20))
        master, node = _start_master_and_node(config, tmp)
        try:
            yield master.address
        finally:
            node.stop()
            master.stop()


def serve_pool(conn, dram: int, max_block: int) -> None:
    """A master and one node (DRAM only, prefaulted) until ``conn`` closes. Runs in its own process,
    with the services' garbage-collector setting (``kvstore.gc_pauses``)."""
    from kvstore import gc_pauses
    from kvstore.node.config import StoreConfig

    gc_pauses.install()
    with tempfile.TemporaryDirectory() as tmp:
        config = StoreConfig(dram_capacity=dram, max_block_bytes=max_block, prefault=True)
        master, node = _start_master_and_node(config, tmp)
        try:
            conn.send({"master": master.address})
            conn.recv()
        except (EOFError, OSError):  # the parent went away (before or after we were ready)
            pass
        finally:
            node.stop()
            master.stop()


@contextmanager
def sigint_held():
    """Hold SIGINT back while helper processes are started: they inherit the mask (it survives
    exec), so a Ctrl-C while their interpreter starts up cannot kill them half-made; the parent
    gets it when this ends."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def run_helper(target, *args) -> None:
    """The body of a helper process (started under ``sigint_held``): ``target(*args)``,
    ignoring SIGINT and ending quietly when the parent has gone. Ctrl-C reaches the whole
    process group, and the parent, which closes its helpers on the way out, is the one to act
    on it (a helper interrupted on its own would print a traceback and leave its socket)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        target(*args)
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the pipe to the parent: it has gone
        pass


class HelperProcess:
    """A spawned helper process that sends one message when ready and runs until ``close``."""

    def __init__(self, ctx, target, *args):
        self._conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=run_helper, args=(target, child_conn, *args), daemon=True)
        with sigint_held():
            self.proc.start()
        child_conn.close()
        try:
            if not self._conn.poll(120):
                raise RuntimeError(f"{target.__name__} did not start")
            self.info = self._conn.recv()
        except BaseException:  # Ctrl-C while it starts included: it stops, once started, by itself
            self.close()
            raise

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._conn.close()
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
