"""The conductor: places each request on a prefill and a decode instance, or rejects it.

``Conductor.schedule(block_keys, input_len, output_len, now)`` reads the
prefix every storage node holds from a prefix index (a
:class:`~kvstore.scheduler.prefix.PrefixMatcher`: live, the master's
``PrefixIndex``), asks the prefill policy for a placement,
pairs it with a decode instance (the least loaded, counting requests already
paired and still in prefill; Algorithm 1 picks both at once because the KV
cache streams from prefill to that decode instance), applies the admission
mode (:mod:`~kvstore.scheduler.admission`: which load is compared with which
limit, and when), and returns a :class:`Decision` or a typed :class:`Rejected`.
The engines then report the request's lifecycle: ``prefill_started``,
``prefill_finished`` (which places it on decode, or rejects it there under
admission ``none``), ``decode_finished``.

Engines come and go: ``report_load`` reads a report by the role the engine
registered with (an idle decode engine reports zeros), and ``deregister``
forgets an engine and ends the requests in flight on it. A request with no
report for ``request_ttl`` seconds (a lost engine or client) expires, as if
cancelled; expiry runs lazily, at the next call, on the conductor's clock.

What a conductor holds is bounded: at most ``max_requests`` requests in flight,
and, given a :class:`~kvstore.scheduler.ledger.Ledger` (``budget``), each
request counts against its ``owner``'s requests in flight over every namespace
until it ends. Deadlines of ended requests are dropped from the expiry heap
once they outnumber the live ones, so scheduling and cancelling keeps nothing.

The conductor decides; it moves no bytes. A Decision that fetches lists the
blocks to replicate to the chosen instance's node (hotspot migration); the
caller (the master's gRPC adapter live, the simulated nodes in replay) copies
them, and the node's STORED events update the index.

Pure Python, no grpc; time comes from the ``now`` argument or the injected
clock, so replay drives this very code under a simulated clock.

Thread-safety: every public method is atomic under ``_lock``, which guards the
registry, the policy state, the admission predictor and the request table.
The prefix lookup runs before ``_lock`` is taken (the index has its own lock),
so the conductor never holds its lock while calling out. Lock order where both
are held by callers: Conductor._lock is never taken inside the index's lock.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
from dataclasses import dataclass
from enum import Enum
from typing import Sequence

from kvstore.errors import InvalidRequest
from kvstore.scheduler.admission import DecodeLoadPredictor, make_admission
from kvstore.scheduler.clock import Clock, MonotonicClock
from kvstore.scheduler.cost_model import CostModel
from kvstore.scheduler.ledger import Ledger, Owner
from kvstore.scheduler.policies import PrefillChoice, Prefix, decode_fit, make_prefill_policy, select_decode
from kvstore.scheduler.prefix import PrefixMatcher
from kvstore.scheduler.registry import Registry
from kvstore_client.errors import ConfigError
from kvstore_client.keys import digest_of

INF = math.inf
DEFAULT_MAX_REQUESTS = 100_000  # requests in flight per namespace; past it, schedule rejects


class RejectReason(str, Enum):
    TTFT_SLO = "ttft_slo"  # estimated TTFT above the TTFT SLO
    DECODE_OVERLOADED = "decode_overloaded"  # the decode instance (pool, at arrival) is at its limit now
    DECODE_PREDICTED = "decode_predicted_overloaded"  # predicted decode load too high at arrival in decode
    NO_INSTANCE = "no_instance"  # no prefill or decode instance registered
    TOO_MANY_REQUESTS = "too_many_requests"  # max_requests, or the owner's limit, in flight: memory stays bounded


@dataclass(frozen=True)
class Decision:
    """Where a request runs. Block counts are in blocks of ``block_tokens``; times in seconds."""

    request_id: object
    prefill: str  # prefill instance id
    prefill_node: str  # its storage node (where fetched blocks are replicated)
    decode: str | None  # decode instance paired with the request (KV streams there)
    prefix_blocks: int  # blocks reused (local + fetched)
    prefix_len: int  # tokens reused
    local_blocks: int  # blocks already on the prefill node
    fetch_from: str | None  # node to fetch the missing prefix blocks from
    fetch_blocks: tuple  # digests to copy from fetch_from to prefill_node, in chain order
    est_queue_s: float
    est_transfer_s: float
    est_prefill_s: float
    est_ttft_s: float
    est_tbt_s: float
    # prefill_finished will hand the request to ``decode`` (unless that instance leaves) and
    # cannot reject it: the admission rejects at arrival, if at all
    decode_final: bool = False

    @property
    def service_s(self) -> float:
        """Seconds the prefill instance is busy with the request (fetch, then prefill)."""
        return self.est_transfer_s + self.est_prefill_s


@dataclass(frozen=True)
class Rejected:
    """A request turned away (HTTP 429 / RESOURCE_EXHAUSTED at the edge)."""

    request_id: object
    reason: RejectReason
    stage: str  # "arrival" or "decode" (after prefill: the prefill was wasted)
    est_ttft_s: float = INF
    detail: str = ""

    @property
    def message(self) -> str:
        """Human-readable: "reason: detail"."""
        return f"{self.reason.value}: {self.detail}" if self.detail else self.reason.value


@dataclass(frozen=True)
class DecodeAssignment:
    request_id: object
    decode: str
    tbt_s: float
    within_slo: bool


@dataclass
class _Request:
    prefill: str
    tokens: int  # context tokens in decode: input + output
    paired: str | None = None  # decode instance chosen at arrival
    decode: str | None = None  # decode instance running it
    deadline: float = INF  # expires then unless reported again (request_ttl after the last report)
    owner: Owner | None = None  # charged for it in the budget until it ends


class Conductor:
    """Prefill/decode placement with the FAST'25 Algorithm 1 and early rejection. See the module doc."""

    def __init__(
        self,
        index: PrefixMatcher,
        cost: CostModel | None = None,
        *,
        policy: str = "kvcache_centric",
        admission: str = "off",
        ttft_slo: float = INF,
        tbt_slo: float = INF,
        namespace: str = "default",
        clock: Clock | None = None,
        seed: int = 0,
        balancing_threshold: int = 0,
        request_ttl: float = INF,
        max_requests: int = DEFAULT_MAX_REQUESTS,
        budget: Ledger | None = None,
    ) -> None:
        if not request_ttl > 0:
            raise ConfigError(f"request_ttl must be positive, got {request_ttl}")
        if max_requests < 1:
            raise ConfigError(f"max_requests must be at least 1, got {max_requests}")
        self.max_requests = int(max_requests)
        self.budget = budget  # counts each owner's requests in flight over every namespace
        self.index = index
        self.cost = cost or CostModel()
        self.policy = make_prefill_policy(policy, seed=seed, balancing_threshold=balancing_threshold)
        self.admission = make_admission(admission)
        self.ttft_slo, self.tbt_slo = float(ttft_slo), float(tbt_slo)
        self.namespace = namespace
        self.clock = clock or MonotonicClock()
        self.registry = Registry()
        self.predictor = DecodeLoadPredictor(self.tbt_slo)
        self._token_limit = self.cost.decode_token_limit(self.tbt_slo)
        self.request_ttl = float(request_ttl)
        self.expired = 0  # requests forgotten by the TTL, ever
        self._requests: dict[object, _Request] = {}
        self._deadlines: list = []  # heap of (deadline, seq, request id); stale entries skipped
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._lock = threading.Lock()

    # -- registry ---------------------------------------------------------------------------
    def register_prefill(self, instance_id: str, node_id: str) -> None:
        with self._lock:
            self.registry.add_prefill(instance_id, node_id)

    def register_decode(self, instance_id: str, node_id: str) -> None:
        with self._lock:
            self.registry.add_decode(instance_id, node_id, self._token_limit)

    def deregister(self, instance_id: str, now: float | None = None) -> int | None:
        """Forget an engine: no new work goes to it, and the requests in flight on it end (a
        prefill engine's queued or running prefills, a decode engine's decodes; requests only
        paired with a decode engine are paired again at decode). Returns how many ended, None
        if the engine was not registered."""
        now = self._now(now)
        with self._lock:
            self._expire(now)
            role = self.registry.role(instance_id)
            if role is None:
                return None
            if role == "prefill":  # not yet in decode: its prefill is lost
                ended = [rid for rid, r in self._requests.items() if r.prefill == instance_id and r.decode is None]
            else:
                ended = [rid for rid, r in self._requests.items() if r.decode == instance_id]
            for rid in ended:
                self._end(rid)
            for req in self._requests.values():
                if req.paired == instance_id:
                    req.paired = None  # the reservation leaves with the instance
            self.registry.remove(instance_id)
            return len(ended)

    def report_load(
        self,
        instance_id: str,
        *,
        queue_len: int = 0,
        busy_s: float = 0.0,
        batch: int = 0,
        context_tokens: int = 0,
        now: float | None = None,
    ) -> str:
        """An engine's own view of its load, read by the role it registered with (the other
        role's fields are ignored); zeros mean idle. Returns the role; InvalidRequest if unknown."""
        now = self._now(now)
        with self._lock:
            self._expire(now)
            role = self.registry.role(instance_id)
            if role == "prefill":
                self.registry.report_prefill_load(instance_id, queue_len, busy_s, now)
            elif role == "decode":
                self.registry.report_decode_load(instance_id, batch, context_tokens)
            else:
                raise InvalidRequest(f"unknown engine {instance_id!r}: register it first")
            return role

    def report_prefill_load(self, instance_id: str, queue_len: int, busy_s: float, now: float | None = None) -> None:
        now = self._now(now)
        with self._lock:
            self.registry.report_prefill_load(instance_id, queue_len, busy_s, now)

    def report_decode_load(self, instance_id: str, batch: int, context_tokens: int) -> None:
        with self._lock:
            self.registry.report_decode_load(instance_id, batch, context_tokens)

    # -- the decision -----------------------------------------------------------------------
    def schedule(
        self,
        block_keys: Sequence,
        input_len: int,
        output_len: int = 0,
        now: float | None = None,
        request_id=None,
        start_prefill: bool = False,
        owner: Owner | None = None,
    ) -> Decision | Rejected:
        """Place one request (Algorithm 1 + admission). ``block_keys``: the request's chained block
        digests (bytes) or engine hash ids (ints / hex), one per ``block_tokens`` tokens.
        ``start_prefill``: the caller sends it to the prefill instance at once (as a router does),
        so it starts there now, as on a ``prefill_started`` report, one call fewer. ``owner``: whom
        the request counts against in the budget (TOO_MANY_REQUESTS past its limit)."""
        now = self._now(now)
        if input_len < 0 or output_len < 0:
            raise InvalidRequest("input_len and output_len cannot be negative")
        digests = [k if type(k) is bytes else digest_of(k) for k in block_keys]
        per_node = self.index.match_prefix(self.namespace, digests)[0] if digests else {}
        prefix = Prefix.from_match(per_node)
        tokens = int(input_len) + int(output_len)
        with self._lock:
            self._expire(now)
            if request_id is None:
                request_id = next(self._ids)
            elif request_id in self._requests:
                raise InvalidRequest(f"request {request_id!r} is already scheduled")
            if len(self._requests) >= self.max_requests:  # callers that never report must not grow the master
                return Rejected(
                    request_id,
                    RejectReason.TOO_MANY_REQUESTS,
                    "arrival",
                    detail=f"{len(self._requests)} requests in flight in namespace {self.namespace!r}",
                )
            instances = self.registry.prefill_instances()
            if not instances:
                return Rejected(request_id, RejectReason.NO_INSTANCE, "arrival", detail="no prefill instance")
            placement = self.policy.choose(int(input_len), prefix, instances, self.cost, now)
            pick = select_decode(self.registry.decode_instances(), tokens, self.cost)
            rejected = self._arrival_check(request_id, placement, pick, tokens, now) or self._admit(request_id, owner)
            if rejected is not None:
                return rejected
            inst = placement.instance
            self.registry.assign_prefill(inst, request_id, placement.service_s)
            req = self._requests[request_id] = _Request(inst.instance_id, tokens, owner=owner)
            self._touch(request_id, req, now)
            if pick.instance is not None:
                self.registry.reserve_decode(pick.instance, request_id, tokens)
                req.paired = pick.instance.instance_id
            self.predictor.admitted(request_id, tokens, now + placement.ttft_s)
            if start_prefill:
                self.registry.start_prefill(inst, request_id, now)
        return self._decision(request_id, placement, pick, digests, input_len)

    def _admit(self, request_id, owner: Owner | None) -> Rejected | None:
        """Count the request against its owner's requests in flight; a rejection past the limit."""
        why = self.budget.admit(owner) if self.budget is not None and owner is not None else None
        return None if why is None else Rejected(request_id, RejectReason.TOO_MANY_REQUESTS, "arrival", detail=why)

    def _arrival_check(self, request_id, placement: PrefillChoice, pick, tokens: int, now: float) -> Rejected | None:
        adm = self.admission
        ttft = placement.ttft_s
        if adm.check_ttft_at_arrival and ttft > self.ttft_slo:
            return Rejected(
                request_id,
                RejectReason.TTFT_SLO,
                "arrival",
                ttft,
                f"estimated TTFT {ttft:.2f}s > SLO {self.ttft_slo:.2f}s",
            )
        if not adm.check_decode_at_arrival:
            return None
        if pick.instance is None:
            return Rejected(request_id, RejectReason.NO_INSTANCE, "arrival", ttft, "no decode instance")
        if adm.predict_decode:
            predicted = self.predictor.tokens_at(now + ttft, now) + tokens
            limit = sum(d.token_limit for d in self.registry.decode_instances())
            if predicted > limit:
                return Rejected(
                    request_id,
                    RejectReason.DECODE_PREDICTED,
                    "arrival",
                    ttft,
                    f"predicted decode tokens {predicted:.0f} > {limit}",
                )
        else:
            load = self._decode_pool_load()
            if load >= 1.0:
                return Rejected(
                    request_id, RejectReason.DECODE_OVERLOADED, "arrival", ttft, f"decode pool load {load:.2f} >= 1"
                )
        return None

    def _decision(self, request_id, placement: PrefillChoice, pick, digests: list, input_len: int) -> Decision:
        inst = placement.instance
        fetch = tuple(digests[placement.local_blocks : placement.prefix_blocks]) if placement.fetch_from else ()
        return Decision(
            request_id=request_id,
            prefill=inst.instance_id,
            prefill_node=inst.node_id,
            decode=pick.instance.instance_id if pick.instance else None,
            prefix_blocks=placement.prefix_blocks,
            prefix_len=self.cost.cached_tokens(input_len, placement.prefix_blocks),
            local_blocks=placement.local_blocks,
            fetch_from=placement.fetch_from,
            fetch_blocks=fetch,
            est_queue_s=placement.queue_s,
            est_transfer_s=placement.transfer_s,
            est_prefill_s=placement.prefill_s,
            est_ttft_s=placement.ttft_s,
            est_tbt_s=pick.tbt_s,
            decode_final=pick.instance is not None and not self.admission.reject_at_decode,
        )

    # -- lifecycle reports --------------------------------------------------------------------
    def prefill_started(self, request_id, now: float | None = None) -> None:
        now = self._now(now)
        with self._lock:
            self._expire(now)
            req = self._get(request_id)
            self.registry.start_prefill(self.registry.get_prefill(req.prefill), request_id, now)
            self._touch(request_id, req, now)

    def prefill_finished(self, request_id, now: float | None = None) -> DecodeAssignment | Rejected:
        """Prefill done: the request moves to its paired decode instance (picked again if that one
        left), or is rejected there when that instance is full (admission ``none`` only)."""
        now = self._now(now)
        with self._lock:
            self._expire(now)
            req = self._get(request_id)
            inst = self.registry.prefill.get(req.prefill)
            if inst is not None:
                self.registry.finish_prefill(inst, request_id)
            paired = self.registry.decode.get(req.paired) if req.paired else None
            if paired is not None:
                self.registry.release_decode(paired, request_id)
                pick = decode_fit(paired, req.tokens, self.cost)
            else:
                pick = select_decode(self.registry.decode_instances(), req.tokens, self.cost)
            reject = None
            if pick.instance is None:
                reject = Rejected(request_id, RejectReason.NO_INSTANCE, "decode", detail="no decode instance")
            elif self.admission.reject_at_decode and pick.full:
                reject = Rejected(
                    request_id,
                    RejectReason.DECODE_OVERLOADED,
                    "decode",
                    detail=f"{pick.instance.instance_id} load {pick.load:.2f} >= 1",
                )
            if reject is not None:
                self._pop(request_id)
                self.predictor.finished(request_id)
                return reject
            self.registry.assign_decode(pick.instance, request_id, req.tokens)
            req.decode = pick.instance.instance_id
            self._touch(request_id, req, now)
            self.predictor.decoding(request_id, req.tokens, now)
            return DecodeAssignment(request_id, req.decode, pick.tbt_s, pick.fits)

    def decode_finished(self, request_id, now: float | None = None) -> None:
        now = self._now(now)
        with self._lock:
            self._expire(now)
            req = self._pop(request_id)
            if req is None:
                return
            if req.decode is not None and req.decode in self.registry.decode:
                self.registry.finish_decode(self.registry.decode[req.decode], request_id)
            self.predictor.finished(request_id, now)

    def cancel(self, request_id, now: float | None = None) -> bool:
        """Forget a request wherever it is (client gone, engine failed). False if unknown."""
        now = self._now(now)
        with self._lock:
            self._expire(now)
            return self._end(request_id)

    def expire(self, now: float | None = None) -> int:
        """Forget the requests past their TTL now; returns how many (other calls do this too)."""
        now = self._now(now)
        with self._lock:
            return self._expire(now)

    def in_flight(self) -> int:
        """Requests scheduled and not yet finished, cancelled, rejected or expired."""
        with self._lock:
            return len(self._requests)

    def engines(self) -> int:
        """Engines registered, prefill and decode."""
        with self._lock:
            return len(self.registry.prefill) + len(self.registry.decode)

    def footprint(self) -> dict:
        """How many entries this conductor holds: engines, requests in flight, expiry deadlines."""
        with self._lock:
            engines = len(self.registry.prefill) + len(self.registry.decode)
            return {"engines": engines, "requests": len(self._requests), "deadlines": len(self._deadlines)}

    def close(self) -> int:
        """End every request in flight (their charges go back to the budget); how many. For a
        conductor its owner drops (the last engine left)."""
        with self._lock:
            ended = [rid for rid in list(self._requests) if self._end(rid)]
            self._deadlines.clear()
            return len(ended)

    def _pop(self, request_id) -> _Request | None:
        """Take a request out of the table, and its charge out of its owner's budget."""
        req = self._requests.pop(request_id, None)
        if req is not None and req.owner is not None and self.budget is not None:
            self.budget.release(req.owner)
        return req

    def _end(self, request_id) -> bool:
        """Drop a request from every instance's books (cancel, expiry, deregistration)."""
        req = self._pop(request_id)
        if req is None:
            return False
        if req.prefill in self.registry.prefill:
            self.registry.finish_prefill(self.registry.prefill[req.prefill], request_id)
        if req.paired in self.registry.decode:
            self.registry.release_decode(self.registry.decode[req.paired], request_id)
        if req.decode is not None and req.decode in self.registry.decode:
            self.registry.finish_decode(self.registry.decode[req.decode], request_id)
        self.predictor.finished(request_id)
        return True

    def _touch(self, request_id, req: _Request, now: float) -> None:
        """A report came: the request lives ``request_ttl`` more seconds."""
        if self.request_ttl != INF:
            req.deadline = now + self.request_ttl
            heapq.heappush(self._deadlines, (req.deadline, next(self._seq), request_id))
            if len(self._deadlines) > 2 * len(self._requests) + 64:
                self._compact_deadlines()

    def _compact_deadlines(self) -> None:
        """Rebuild the expiry heap from the live requests: entries of ended or re-reported ones
        would otherwise stay until their deadline (an hour by default). Amortised O(1) a push."""
        live = [(r.deadline, next(self._seq), rid) for rid, r in self._requests.items() if r.deadline != INF]
        heapq.heapify(live)
        self._deadlines = live

    def _expire(self, now: float) -> int:
        n = 0
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, _, request_id = heapq.heappop(heap)
            req = self._requests.get(request_id)
            if req is not None and req.deadline == deadline and self._end(request_id):  # else stale: reported since
                n += 1
        self.expired += n
        return n

    # -- views ------------------------------------------------------------------------------
    def loads(self, now: float | None = None) -> dict:
        """Current load: per prefill instance (assigned, queue seconds), per decode (tokens, limit)."""
        now = self._now(now)
        with self._lock:
            self._expire(now)
            return {
                "prefill": {
                    i.instance_id: {"assigned": i.assigned(), "queue_s": i.queue_time(now)}
                    for i in self.registry.prefill_instances()
                },
                "decode": {
                    d.instance_id: {"batch": d.batch(), "tokens": d.tokens(), "token_limit": d.token_limit}
                    for d in self.registry.decode_instances()
                },
            }

    def decode_pool_load(self) -> float:
        """Context tokens assigned to decode / tokens the pool holds within the TBT SLO."""
        with self._lock:
            return self._decode_pool_load()

    def _decode_pool_load(self) -> float:
        ds = self.registry.decode_instances()
        limit = sum(d.token_limit for d in ds)
        return sum(d.tokens() for d in ds) / limit if limit else 0.0

    def _get(self, request_id) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise InvalidRequest(f"unknown request {request_id!r}") from None

    def _now(self, now: float | None) -> float:
        return self.clock.now() if now is None else float(now)
