"""Discrete-event simulation of a serving cluster around the real Conductor (used by bench.replay).

It lives in bench/, above both the master and the conductor, because it wires the two: the
simulated nodes report their blocks to the master's real index and the conductor reads it.

Nothing here decides anything: every placement and rejection comes from
:class:`~kvstore.scheduler.conductor.Conductor`, reading prefix lengths from
the real :class:`~kvstore.master.index.PrefixIndex`. The simulation plays
the engines and storage nodes:

- :class:`SimNode`: one storage node's DRAM cache, ``capacity`` blocks, ordered
  by a real eviction policy (``kvstore.policy.make_policy``); every store and
  eviction is reported to the index as STORED / REMOVED events, as a live
  node does.
- :class:`SimPrefill`: one prefill engine, FIFO, one request at a time. At the
  decision it reads its local prefix (touch) and, when the decision fetches,
  the source node is read and the fetched blocks are replicated to its node.
  It is then busy for the decision's fetch + prefill time; when done it
  stores all the request's blocks on its node.
- :class:`SimDecode`: one decode engine, continuous batching as a fluid model:
  every running request advances one token per step, a step takes
  ``cost.tbt(context tokens in the batch)``; a request finishes after its
  output length in steps. Requests beyond the instance's HBM (``decode_kv_tokens``)
  wait for room, FIFO.

TTFT = arrival to end of prefill (queue wait + fetch + prefill). Time is a
:class:`SimClock` advanced by the event loop. Single-threaded.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from kvstore.master.index import DRAM, REMOVED, STORED, PrefixIndex
from kvstore.policy import make_policy
from kvstore.scheduler.clock import SimClock
from kvstore.scheduler.conductor import Conductor, Decision, Rejected


@dataclass
class SimRequest:
    rid: int
    arrival: float
    input_len: int
    output_len: int
    digests: list
    decision: Decision | None = None
    prefill_end: float = 0.0
    rejected: Rejected | None = None


class SimNode:
    """A storage node's DRAM block cache in replay, reporting to the PrefixIndex. As in the
    real store (BlockStore.request), a request's own blocks are not evicted to make room for
    the rest of it: they leave the policy while the others are evicted, then come back with
    their hits, in chain order."""

    def __init__(self, node_id: str, capacity: int, eviction: str, index: PrefixIndex, namespace: str) -> None:
        self.node_id, self.capacity, self.index, self.namespace = node_id, capacity, index, namespace
        self.policy = make_policy(eviction)
        self.keys: dict = {}  # digest -> [depth, hits]
        self.evictions = 0
        index.add_node(node_id)

    def read(self, digests) -> None:
        """Blocks used by a request: an access for the eviction policy."""
        touch, keys = self.policy.touch, self.keys
        for d in digests:
            if d in keys:
                touch(d)
                keys[d][1] += 1

    def store(self, digests, first_depth: int = 0) -> None:
        """Store blocks (chain positions from ``first_depth``); evict down to capacity; report."""
        keys, policy = self.keys, self.policy
        events = []
        chain = list(dict.fromkeys(digests))
        for depth, d in enumerate(chain, first_depth):
            if d in keys:
                policy.touch(d)
                keys[d][1] += 1
            else:
                keys[d] = [depth, 0]
                policy.add(d, depth=depth)
                events.append((STORED, DRAM, d))
        if len(keys) > self.capacity:
            for d in chain:  # the request's blocks are not candidates while the others go
                policy.discard(d)
            self._evict(events)
            for d in chain:
                if d in keys:
                    policy.add(d, depth=keys[d][0], hits=keys[d][1])
            self._evict(events)  # a request longer than the cache keeps what fits
        if events:
            self.index.apply(self.node_id, [(self.namespace, events)])

    def _evict(self, events: list) -> None:
        keys, policy = self.keys, self.policy
        while len(keys) > self.capacity and len(policy):
            victim = policy.pop_victim()
            del keys[victim]
            events.append((REMOVED, DRAM, victim))
            self.evictions += 1


class SimPrefill:
    def __init__(self, instance_id: str, node: SimNode) -> None:
        self.instance_id, self.node = instance_id, node
        self.queue: deque = deque()
        self.busy = False
        self.busy_s = 0.0


class SimDecode:
    """Fluid continuous batching: virtual clock ``v`` = tokens every running request has made."""

    def __init__(self, instance_id: str, cost, hbm_tokens: int, slo_tokens: int) -> None:
        self.instance_id, self.cost = instance_id, cost
        self.hbm_tokens, self.slo_tokens = hbm_tokens, slo_tokens
        self.v = 0.0
        self.t = 0.0
        self.tokens = 0
        self.finish: list = []  # heap of (finish v, rid)
        self.active: dict = {}  # rid -> tokens
        self.waiting: deque = deque()  # (rid, tokens, output_len)
        self.version = 0
        self.busy_s = 0.0
        self.over_slo_s = 0.0
        self.waits: list = []  # seconds each request waited for HBM room

    def advance(self, now: float) -> None:
        dt = now - self.t
        if dt > 0 and self.active:
            self.v += dt / self.cost.tbt(self.tokens)
            self.busy_s += dt
            if self.tokens > self.slo_tokens:
                self.over_slo_s += dt
        self.t = now

    def add(self, rid, tokens: int, output_len: int) -> None:
        if self.active and self.tokens + tokens > self.hbm_tokens:
            self.waiting.append((rid, tokens, output_len, self.t))
        else:
            self._activate(rid, tokens, output_len, self.t)

    def _activate(self, rid, tokens: int, output_len: int, since: float) -> None:
        self.waits.append(self.t - since)
        self.active[rid] = tokens
        self.tokens += tokens
        heapq.heappush(self.finish, (self.v + max(output_len - 1, 0), rid))

    def pop_finished(self) -> list:
        done = []
        while self.finish and self.finish[0][0] <= self.v + 1e-9:
            _, rid = heapq.heappop(self.finish)
            self.tokens -= self.active.pop(rid)
            done.append(rid)
        while self.waiting and (not self.active or self.tokens + self.waiting[0][1] <= self.hbm_tokens):
            self._activate(*self.waiting.popleft())
        return done

    def next_event(self) -> float | None:
        if not self.finish:
            return None
        return self.t + max(self.finish[0][0] - self.v, 0.0) * self.cost.tbt(self.tokens)


@dataclass
class SimResult:
    requests: list
    prefills: list
    decodes: list
    nodes: list
    wasted_prefill_s: float = 0.0
    samples: list = field(default_factory=list)  # (t, decode pool load, mean prefill queue s)
    end_time: float = 0.0


ARRIVE, PREFILL_DONE, DECODE_TICK, SAMPLE = range(4)


class Simulation:
    """Replays requests through a Conductor with ``prefill`` + ``decode`` simulated instances."""

    def __init__(
        self,
        conductor: Conductor,
        clock: SimClock,
        prefill: int,
        decode: int,
        cache_blocks: int,
        eviction: str = "lru",
        sample_s: float = 10.0,
    ) -> None:
        self.conductor, self.clock, self.cost = conductor, clock, conductor.cost
        index, ns = conductor.index, conductor.namespace
        self.nodes = [SimNode(f"node-p{i}", cache_blocks, eviction, index, ns) for i in range(prefill)]
        self.prefills = {}
        for i, node in enumerate(self.nodes):
            inst = self.prefills[f"prefill-{i}"] = SimPrefill(f"prefill-{i}", node)
            conductor.register_prefill(inst.instance_id, node.node_id)
        self.node_by_id = {n.node_id: n for n in self.nodes}
        limit = conductor.cost.decode_token_limit(conductor.tbt_slo)
        self.decodes = {}
        for i in range(decode):
            conductor.register_decode(f"decode-{i}", f"node-d{i}")
            self.decodes[f"decode-{i}"] = SimDecode(f"decode-{i}", self.cost, self.cost.params.decode_kv_tokens, limit)
        self.sample_s = sample_s
        self._events: list = []
        self._seq = itertools.count()

    def _push(self, t: float, kind: int, data) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, data))

    def run(self, requests: list[SimRequest]) -> SimResult:
        result = SimResult(requests, list(self.prefills.values()), list(self.decodes.values()), self.nodes)
        for r in requests:
            self._push(r.arrival, ARRIVE, r)
        last_arrival = requests[-1].arrival if requests else 0.0
        if self.sample_s > 0:
            self._push(0.0, SAMPLE, None)
        handlers = {ARRIVE: self._arrive, PREFILL_DONE: self._prefill_done, DECODE_TICK: self._decode_tick}
        events = self._events
        while events:
            t, _, kind, data = heapq.heappop(events)
            self.clock.advance_to(t)
            if kind == SAMPLE:
                result.samples.append(self._sample(t))
                if t + self.sample_s <= last_arrival:
                    self._push(t + self.sample_s, SAMPLE, None)
                continue
            handlers[kind](t, data, result)
        result.end_time = self.clock.now()
        return result

    def _sample(self, t: float) -> tuple:
        loads = self.conductor.loads(t)["prefill"].values()
        queue = sum(v["queue_s"] for v in loads) / max(len(loads), 1)
        return (t, self.conductor.decode_pool_load(), queue)

    # -- prefill ------------------------------------------------------------------------------
    def _arrive(self, t: float, r: SimRequest, result: SimResult) -> None:
        d = self.conductor.schedule(r.digests, r.input_len, r.output_len, now=t, request_id=r.rid)
        if isinstance(d, Rejected):
            r.rejected = d
            return
        r.decision = d
        inst = self.prefills[d.prefill]
        inst.node.read(r.digests[: d.local_blocks])
        if d.fetch_blocks:
            self.node_by_id[d.fetch_from].read(d.fetch_blocks)
            inst.node.store(d.fetch_blocks, d.local_blocks)  # hotspot migration: replicate to the chosen node
        inst.queue.append(r)
        if not inst.busy:
            self._start(t, inst)

    def _start(self, t: float, inst: SimPrefill) -> None:
        r = inst.queue.popleft()
        inst.busy = True
        self.conductor.prefill_started(r.rid, now=t)
        service = r.decision.service_s
        inst.busy_s += service
        self._push(t + service, PREFILL_DONE, (inst, r))

    def _prefill_done(self, t: float, data, result: SimResult) -> None:
        inst, r = data
        inst.node.store(r.digests)
        r.prefill_end = t
        out = self.conductor.prefill_finished(r.rid, now=t)
        if isinstance(out, Rejected):
            r.rejected = out
            result.wasted_prefill_s += r.decision.service_s
        else:
            dec = self.decodes[out.decode]
            dec.advance(t)
            dec.add(r.rid, r.input_len + r.output_len, r.output_len)
            self._finish_decodes(t, dec)
        inst.busy = False
        if inst.queue:
            self._start(t, inst)

    # -- decode -------------------------------------------------------------------------------
    def _decode_tick(self, t: float, data, result: SimResult) -> None:
        dec, version = data
        if version == dec.version:
            dec.advance(t)
            self._finish_decodes(t, dec)

    def _finish_decodes(self, t: float, dec: SimDecode) -> None:
        for rid in dec.pop_finished():
            self.conductor.decode_finished(rid, now=t)
        dec.version += 1
        nxt = dec.next_event()
        if nxt is not None:
            self._push(nxt, DECODE_TICK, (dec, dec.version))
