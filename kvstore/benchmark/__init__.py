"""``kvstore bench``: throughput and latency of a pool through the SDK, next to baselines.

    kvstore bench [--master HOST:PORT] [--sizes 64KiB,1MiB,4MiB] [--clients 1,4] [--json] [--plot FILE]
    python -m bench.throughput ...          (the same, from a checkout)

What runs where (nothing measured shares an interpreter with what it talks to):

- the pool: by default a master and one storage node in a process of their
  own (``kvstore up`` in miniature: DRAM only, prefaulted, sized so the
  working set never evicts), or the pool at ``--master``;
- clients: ``--clients`` levels of 1..N processes (multiprocessing, spawn),
  each with its own ``Client`` per transport; every measurement starts them
  together at a barrier; aggregate GB/s = all bytes / the slowest client's
  wall time;
- baselines, with the same values, the same working set and the same client
  processes: ``memcpy`` (numpy.copyto of each value into a preallocated
  buffer), ``socket`` (a raw Python request/response server in a process of its
  own: a 16-byte request answered with the value via sendall / received with
  recv_into, one byte back for a put), ``redis`` (redis-server started here on a
  free loopback port, persistence off; redis-py GET / SET, pipelines of
  ``--batch`` for the batch ops) and ``redis_c`` (redis-benchmark, the C
  client, on the same server: ``-t get|set -d SIZE -n N -c CLIENTS -P 1`` or
  ``-P BATCH`` for batch ops, ``-r`` over a preloaded working set of the same
  size). A missing baseline is null in the JSON with a note, never estimated.

Rounds of all measures are interleaved and each figure is the median over
``--rounds`` rounds; each ratio is the median of the per-round ratios.
Latency is per call (a batch call or a pipeline counts once), pooled over
clients and rounds. Client location caches are kept warm for the run: the
figures are the data path, not the master's Locate.

Layout: ``settings`` (ops, transports, Settings, each op's baselines), ``pool`` (the pool under test,
helper processes), ``workers`` (client processes and the timed calls), ``baselines`` (raw socket,
redis-server, redis-benchmark), ``report`` (records, targets, table, plot, progress), ``runner`` (``run``).
"""

from kvstore.benchmark.pool import embedded_pool
from kvstore.benchmark.report import emit, format_table, plot, targets
from kvstore.benchmark.runner import run
from kvstore.benchmark.settings import MiB, OPS, TRANSPORTS, Settings, parse_list

__all__ = [
    "MiB",
    "OPS",
    "TRANSPORTS",
    "Settings",
    "embedded_pool",
    "emit",
    "format_table",
    "parse_list",
    "plot",
    "run",
    "targets",
]
