"""Overload by hand: why rejecting after prefill costs requests (arXiv §7.2), on the simulated cluster."""

from __future__ import annotations

import pytest

from kvstore.master.index import PrefixIndex
from kvstore.scheduler import Conductor, CostModel, CostParams, PolynomialPrefill, RejectReason, SimClock
from bench.simulation import SimRequest, Simulation

# Prefill takes 1 ms a token (no cache reuse: every request has its own blocks); a decode instance holds
# 800 context tokens, so one request of 800 fills it.
COST = CostModel(CostParams(decode_kv_tokens=800), prefill=PolynomialPrefill((0, 1e-3, 0, 0, 0, 0)))


def replay(admission: str, requests: list[tuple[str, float, int, int]]) -> dict:
    """Run (name, arrival s, input tokens, output tokens) on 1 prefill + 1 decode instance."""
    clock = SimClock()
    conductor = Conductor(PrefixIndex(), COST, admission=admission, ttft_slo=10.0, tbt_slo=0.1, clock=clock)
    sim = Simulation(conductor, clock, prefill=1, decode=1, cache_blocks=1000, sample_s=0)
    block = iter(range(10**6))
    sims = [
        SimRequest(i, t, n, o, [next(block).to_bytes(8, "little") for _ in range(n // 512)])
        for i, (_, t, n, o) in enumerate(requests)
    ]
    result = sim.run(sims)
    return {name: r for (name, *_), r in zip(requests, sims)} | {"wasted": result.wasted_prefill_s}


# A fills decode until ~6.3 s. D is admitted while A is still in prefill and decodes from 7 s to ~13 s.
# B arrives while A decodes; C arrives in the gap between A leaving decode and D entering it.
TRACE = [("A", 0.0, 500, 300), ("D", 0.1, 6500, 300), ("B", 0.6, 3000, 100), ("C", 6.5, 8000, 100)]


def test_baseline_prefill_wasted_on_a_request_decode_turns_away_crowds_out_another():
    none = replay("none", TRACE)
    b, c = none["B"], none["C"]
    # B passes the TTFT check, holds the only prefill instance from 7 s to 10 s, and decode (full with D)
    # turns it away: 3 s of prefill wasted ...
    assert b.decision is not None and b.rejected.stage == "decode"
    assert b.rejected.reason == RejectReason.DECODE_OVERLOADED and none["wasted"] == pytest.approx(3.0)
    # ... and C, queued behind it, would start its prefill only when B's is done: 0.5 + 3 + 8 s > 10 s.
    assert c.decision is None and c.rejected.reason == RejectReason.TTFT_SLO
    assert c.rejected.est_ttft_s > 10.0
    assert {n for n in "ABCD" if none[n].rejected is None} == {"A", "D"}


def test_early_rejection_turns_the_doomed_request_away_at_arrival_and_serves_the_other():
    early = replay("early", TRACE)
    b, c = early["B"], early["C"]
    assert b.decision is None and (b.rejected.stage, b.rejected.reason) == ("arrival", RejectReason.DECODE_OVERLOADED)
    assert early["wasted"] == 0.0
    # the prefill instance is free after D: C starts at 7 s, its TTFT is 8.5 s, and it decodes after D
    assert c.rejected is None and c.decision.est_queue_s == pytest.approx(0.5)
    assert c.prefill_end - c.arrival == pytest.approx(8.5)
    assert {n for n in "ABCD" if early[n].rejected is None} == {"A", "C", "D"}
