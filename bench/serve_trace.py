"""The slice of the conversation trace that ``bench.serve`` replays, turned into token-id prompts.

The trace (``docs/scheduling.md``) gives per request a ``timestamp`` (ms), ``input_length`` and
``output_length`` (tokens) and ``hash_ids``, one per 512-token block, chained: equal ids at equal
positions are a shared prefix. Every request's first id is the same one (a common system prompt),
and the turns of one conversation are minutes apart (a median of about 147 s between a prefix's
first use and its reuse), so a few dozen consecutive requests share almost nothing beyond that
first block. The slice is therefore taken by conversation: a conversation is the requests whose
first two ids are equal; the slice is every request of the conversations with at least two turns
that begin at or after request ``start`` (trace order), in timestamp order, the first ``requests``
of them. On this trace about half of such a slice's blocks are a prefix some earlier request of
the slice already used (``reuse_bound``: what an unbounded cache would save).

Scaled down to what a CPU engine serves: each hash id becomes ``block_tokens`` token ids drawn
from a PRNG seeded by the id (equal ids give equal blocks, so prefixes are shared exactly as in
the trace); a prompt has ``input_length * block_tokens / 512`` tokens (its last block partial, as
in the trace, at least one token of it), at most ``max_output`` output tokens. Arrivals keep the
trace's inter-arrival times multiplied by ``time_scale``, or are ``1 / rate`` s apart.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from bench.trace import read_trace

TRACE_BLOCK = 512  # tokens per hash id in the published trace
FIRST_TOKEN = 3  # make_tokenizer's ids 0-2 are <unk>, <s>, </s>


@dataclass(frozen=True)
class Request:
    index: int  # position in the trace (timestamp order)
    arrival_s: float  # seconds after the replay starts
    prompt: list[int]
    max_tokens: int
    hash_ids: tuple[int, ...]


def conversation_slice(trace: list[dict], start: int, requests: int) -> list[dict]:
    """The trace requests of the slice (module doc), each with its trace ``index``, in timestamp order."""
    turns: dict[tuple, list[int]] = {}
    for i, r in enumerate(trace):
        if len(r["hash_ids"]) >= 2:
            turns.setdefault(tuple(r["hash_ids"][:2]), []).append(i)
    chosen: list[int] = []
    for indexes in sorted((v for v in turns.values() if v[0] >= start and len(v) >= 2), key=lambda v: v[0]):
        if len(chosen) >= requests:
            break
        chosen += indexes
    return [dict(trace[i], index=i) for i in sorted(chosen)[:requests]]


def block_tokens_of(hash_id: int, block_tokens: int, vocab: int) -> list[int]:
    rng = random.Random(hash_id)
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(block_tokens)]


def prompt_of(request: dict, block_tokens: int, vocab: int) -> list[int]:
    ids = request["hash_ids"]
    length = round(request["input_length"] * block_tokens / TRACE_BLOCK)
    length = min(max(length, (len(ids) - 1) * block_tokens + 1), len(ids) * block_tokens)
    tokens: list[int] = []
    for h in ids:
        tokens += block_tokens_of(h, block_tokens, vocab)
    return tokens[:length]


def build_requests(
    trace_path: str,
    *,
    start: int,
    requests: int,
    block_tokens: int,
    vocab: int,
    max_output: int,
    time_scale: float,
    rate: float | None,
) -> list[Request]:
    trace = read_trace(trace_path, ("input_length", "output_length"))
    picked = conversation_slice(trace, start, requests)
    if not picked:
        raise ValueError(f"no conversation of two or more turns begins at or after request {start}")
    t0 = picked[0]["timestamp"]
    out = []
    for n, r in enumerate(picked):
        arrival = n / rate if rate else (r["timestamp"] - t0) / 1000 * time_scale
        out.append(
            Request(
                r["index"],
                arrival,
                prompt_of(r, block_tokens, vocab),
                max(1, min(r["output_length"], max_output)),
                tuple(r["hash_ids"]),
            )
        )
    return out


def reuse_bound(requests: list[Request]) -> float:
    """Fraction of the slice's blocks that extend a prefix an earlier request of the slice used: the
    prefill an unbounded prefix cache seeing every request saves, in trace blocks."""
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        for h in r.hash_ids:
            if h not in seen:
                break
            hit += 1
        total += len(r.hash_ids)
        seen.update(r.hash_ids)
    return hit / total if total else 0.0
