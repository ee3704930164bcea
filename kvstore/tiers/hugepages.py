"""Back a shared-memory arena with 2 MiB pages even where its tmpfs is mounted huge=never.

Same-host clients copy blocks out of the arena. Out of 4 KiB shmem pages that
copy runs at 0.55-0.6 of memcpy on this kind of host; out of 2 MiB folios at
memcpy speed, whichever way the reader maps them (measured: 13.5 against 22-25
GB/s for 1 MiB copies). Default tmpfs mounts (/dev/shm, docker's too) give 4 KiB
pages, and changing that takes root (a huge= mount option or the sysfs
``shmem_enabled`` knob).

Since Linux 6.1, ``madvise(MADV_COLLAPSE)`` builds huge pages for a range on
request, whatever the sysfs setting short of "deny". For a shmem file the range
must be mapped at an address congruent to its file offset modulo 2 MiB, and
hold at least one page already (a range of holes is refused). So
``collapse_to_huge_pages`` writes one byte per 2 MiB, maps the file 2 MiB-aligned
(``kvstore_client.sharedmap``), collapses it 256 MiB at a time and unmaps.
The huge folios stay in the file's page cache for its life; every later mapping,
the node's and the clients', reads them. Whatever could not be collapsed (an
older kernel, memory too fragmented) stays as it was, and the arena's
fallocate fills it with 4 KiB pages as before. Best effort, never an error.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import sys
import time

from kvstore_client.sharedmap import HUGE_PAGE, map_aligned

log = logging.getLogger(__name__)

MADV_COLLAPSE = 25  # linux/mman.h; Python's mmap module does not name it
SECTION_CHUNKS = 128  # 256 MiB per madvise call
TIME_BUDGET_S = 10.0  # no new section after this long
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP)


def collapse_to_huge_pages(
    fd: int, size: int, budget_s: float = TIME_BUDGET_S, section_chunks: int = SECTION_CHUNKS
) -> int:
    """Turn the whole 2 MiB chunks of the shmem file ``fd`` (``size`` bytes, not yet written)
    into huge pages; returns how many bytes now are. Linux only; 0 where unsupported.

    A section of ``section_chunks`` chunks per call (each call drains every CPU's page
    lists, about 4 ms); no new section once ``budget_s`` has passed: where memory is too
    fragmented for the kernel to find 2 MiB quickly, a large arena would otherwise hold
    the node's start for minutes (the rest stays on 4 KiB pages)."""
    chunks = size // HUGE_PAGE
    if not chunks or not sys.platform.startswith("linux"):
        return 0
    try:
        for chunk in range(chunks):
            os.pwrite(fd, b"\0", chunk * HUGE_PAGE)  # collapse needs a page present in each chunk
    except OSError as exc:  # a file system that takes no write(2), as hugetlbfs
        log.info("arena stays as it is: %s", exc)
        return 0
    mapped = map_aligned(fd, chunks * HUGE_PAGE)
    if mapped is None:
        return 0
    reservation, offset = mapped
    started, collapsed = time.monotonic(), 0
    try:
        for first in range(0, chunks, section_chunks):
            if first and time.monotonic() - started > budget_s:
                log.info(
                    "huge pages for %d of %d MiB of the arena; stopped after %.1f s (memory fragmented)",
                    collapsed * HUGE_PAGE >> 20,
                    chunks * HUGE_PAGE >> 20,
                    time.monotonic() - started,
                )
                break
            count = min(section_chunks, chunks - first)
            try:
                reservation.madvise(MADV_COLLAPSE, offset + first * HUGE_PAGE, count * HUGE_PAGE)
                collapsed += count
            except OSError as exc:
                if not first and exc.errno in _UNSUPPORTED:  # a kernel before 6.1, or shmem THP "deny"
                    log.info("arena stays on 4 KiB pages: MADV_COLLAPSE refused (%s; needs Linux >= 6.1)", exc.strerror)
                    return 0
                collapsed += _collapse_halves(reservation, offset + first * HUGE_PAGE, count)
    finally:
        reservation.close()
    return collapsed * HUGE_PAGE


def _collapse_halves(mapping: mmap.mmap, offset: int, chunks: int) -> int:
    """How many of the ``chunks`` 2 MiB chunks at ``offset`` become huge pages when some do
    not (no free 2 MiB of memory: EAGAIN, ENOMEM): each half is tried, down to single chunks."""
    if chunks == 1:
        return 0
    total = 0
    for start, count in ((0, chunks // 2), (chunks // 2, chunks - chunks // 2)):
        try:
            mapping.madvise(MADV_COLLAPSE, offset + start * HUGE_PAGE, count * HUGE_PAGE)
            total += count
        except OSError:
            total += _collapse_halves(mapping, offset + start * HUGE_PAGE, count)
    return total


__all__ = ["HUGE_PAGE", "collapse_to_huge_pages"]
