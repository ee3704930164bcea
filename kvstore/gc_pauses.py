"""Keep Python's cyclic garbage collector from pausing a service for the whole of its state.

A node holds two GC-tracked objects per block (its BlockMeta and its Extent), the
master some per indexed block. CPython's full collection scans every tracked
object, about 180 ms per million of them here (``python -m bench.gc_pauses``), holding the
GIL, so every serving thread stops meanwhile; and it runs whenever a quarter of
the long-lived objects are new, which a cache that keeps replacing blocks makes
happen again and again. So the pause grows with the size of the store.

``install()`` freezes (``gc.freeze``) whatever survives each full collection:
frozen objects move to a generation that later collections do not scan, and a
full collection then scans only what became long-lived since the last one.
Frozen objects are still freed by reference counting the moment they are dropped;
blocks, extents and index entries hold no reference cycles, so nothing they use
is kept. What is kept is cyclic garbage that was still reachable at a freeze and
became garbage later; the services' own paths make none (tracebacks of handled
errors are dropped before the next collection). For the services' processes
(``kvstore node``, ``master``, ``up``), not for libraries embedding the store.
"""

from __future__ import annotations

import gc


def _freeze_after_full_collection(phase: str, info: dict) -> None:
    if phase == "stop" and info.get("generation") == 2:
        gc.freeze()


def install() -> None:
    """From now on, freeze what survives each full collection (once per process; idempotent)."""
    if _freeze_after_full_collection not in gc.callbacks:
        gc.collect()
        gc.freeze()  # what start-up made (modules, classes, configuration) is never garbage
        gc.callbacks.append(_freeze_after_full_collection)


def installed() -> bool:
    return _freeze_after_full_collection in gc.callbacks


__all__ = ["install", "installed"]
