"""What the conductor needs from a prefix index: one lookup.

The conductor reads, for a request's chained block digests, how many leading
blocks each storage node holds. The master's :class:`kvstore.master.index.PrefixIndex`
answers that live; any object with the same ``match_prefix`` does (a test's
fake, a replay's index). The conductor depends on this protocol only, so the
scheduler never imports the master; the master hands its index in.
"""

from __future__ import annotations

from typing import Protocol, Sequence


class PrefixMatcher(Protocol):
    """A prefix index, as far as placement is concerned. Must be thread-safe: the
    conductor calls it outside its own lock, from any thread."""

    def match_prefix(self, namespace: str, digests: Sequence[bytes]) -> tuple[dict[str, int], int]:
        """({node_id: leading blocks of ``digests`` it holds itself}, leading blocks held
        by any mix of nodes); nodes that do not hold the first block are left out."""
        ...
