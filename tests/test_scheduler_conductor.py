"""The conductor's lifecycle, admission modes (rejection under overload) and thread safety."""

from __future__ import annotations


import pytest

from kvstore.master.errors import InvalidRequest
from kvstore.master.index import DRAM, STORED, PrefixIndex
from kvstore.scheduler import (
    Conductor,
    CostModel,
    CostParams,
    Decision,
    DecodeAssignment,
    DecodeLoadPredictor,
    Rejected,
    RejectReason,
    SimClock,
)
from kvstore.scheduler.clock import MonotonicClock
from kvstore_client.errors import ConfigError
from tests.conftest import run_in_threads

NS = "test"
KEYS = [i.to_bytes(8, "big") for i in range(1, 9)]
# A decode instance holds 100k context tokens within the SLO (TBT SLO at 100k tokens).
COST = CostModel(CostParams(decode_kv_tokens=100_000))
TBT_SLO = 1.0


def make(admission: str, *, prefill: int = 2, decode: int = 1, ttft_slo: float = 1000.0, clock=None, **kw) -> Conductor:
    index = PrefixIndex()
    c = Conductor(
        index,
        COST,
        policy="kvcache_centric",
        admission=admission,
        ttft_slo=ttft_slo,
        tbt_slo=TBT_SLO,
        namespace=NS,
        clock=clock or SimClock(),
        **kw,
    )
    for i in range(prefill):
        index.add_node(f"n{i}")
        c.register_prefill(f"p{i}", f"n{i}")
    for i in range(decode):
        c.register_decode(f"d{i}", f"dn{i}")
    return c


def run_to_decode(c: Conductor, rid, tokens: int, now: float):
    d = c.schedule(KEYS, tokens - 100, 100, now=now, request_id=rid)
    assert isinstance(d, Decision), d
    c.prefill_started(rid, now=now)
    return c.prefill_finished(rid, now=now + d.est_ttft_s)


def test_lifecycle_keeps_queue_times():
    c = make("off", prefill=1)
    a = c.schedule(KEYS, 4000, 10, now=0.0, request_id="a")
    b = c.schedule(KEYS, 4000, 10, now=0.0, request_id="b")
    assert b.est_queue_s == pytest.approx(a.service_s)
    c.prefill_started("a", now=0.0)
    assert c.loads(now=a.service_s / 2)["prefill"]["p0"]["queue_s"] == pytest.approx(a.service_s * 1.5)
    assert isinstance(c.prefill_finished("a", now=a.service_s), DecodeAssignment)
    c.prefill_started("b", now=a.service_s)
    assert c.schedule(KEYS, 4000, 10, now=a.service_s, request_id="c").est_queue_s == pytest.approx(b.service_s)
    assert c.cancel("c") and not c.cancel("c")
    with pytest.raises(InvalidRequest):
        c.schedule(KEYS, 10, 1, now=0.0, request_id="b")  # already in flight
    with pytest.raises(InvalidRequest):
        c.prefill_started("nope", now=0.0)


def test_a_request_scheduled_with_start_prefill_is_as_one_reported_started():
    reported, started = make("off", prefill=1), make("off", prefill=1)
    a = reported.schedule(KEYS, 4000, 10, now=0.0, request_id="a")
    reported.prefill_started("a", now=0.0)
    b = started.schedule(KEYS, 4000, 10, now=0.0, request_id="a", start_prefill=True)
    assert a == b
    assert started.loads(now=1.0) == reported.loads(now=1.0)
    with pytest.raises(InvalidRequest):
        started.prefill_started("a", now=0.0)  # started already: not queued any more
    assert isinstance(started.prefill_finished("a", now=a.service_s), DecodeAssignment)


def test_time_comes_from_the_injected_clock():
    clock = SimClock(100.0)
    c = make("off", prefill=1, clock=clock)
    a = c.schedule(KEYS, 4000, 10, request_id="a")
    c.prefill_started("a")
    clock.advance(a.service_s / 2)
    assert c.loads()["prefill"]["p0"]["queue_s"] == pytest.approx(a.service_s / 2)
    assert isinstance(make("off", clock=MonotonicClock()).schedule(KEYS, 10, 1), Decision)


def test_schedule_accepts_engine_hash_ids_and_reads_the_index():
    c = make("off")
    c.index.apply("n1", [(NS, [(STORED, DRAM, (h).to_bytes(16, "little")) for h in (7, 8, 9)])])
    d = c.schedule([7, 8, 9, 10], 2048, 10, now=0.0)
    assert (d.prefill, d.prefix_blocks, d.prefix_len) == ("p1", 3, 1536)


def test_off_never_rejects():
    c = make("off", ttft_slo=0.001)
    for i in range(5):
        out = run_to_decode(c, i, 90_000, now=0.0)
        assert isinstance(out, DecodeAssignment)
    assert not out.within_slo  # the decode pool is far over its SLO, and still takes it


def test_ttft_slo_rejects_at_arrival_when_every_prefill_instance_is_overloaded():
    c = make("none", ttft_slo=5.0)
    for p in ("p0", "p1"):
        c.report_prefill_load(p, queue_len=20, busy_s=60.0, now=0.0)
    r = c.schedule(KEYS, 4000, 10, now=0.0)
    assert isinstance(r, Rejected) and (r.reason, r.stage) == (RejectReason.TTFT_SLO, "arrival")
    assert r.est_ttft_s > 60
    assert c.loads(0.0)["prefill"]["p0"]["assigned"] == 0  # nothing was queued


def test_none_rejects_after_prefill_when_decode_is_full():
    c = make("none")
    assert isinstance(run_to_decode(c, "big", 100_000, now=0.0), DecodeAssignment)  # the instance is full
    d = c.schedule(KEYS, 2_000, 100, now=1.0, request_id="late")
    assert isinstance(d, Decision)  # no decode check at arrival
    c.prefill_started("late", now=1.0)
    r = c.prefill_finished("late", now=5.0)
    assert isinstance(r, Rejected) and (r.reason, r.stage) == (RejectReason.DECODE_OVERLOADED, "decode")
    assert c.loads(5.0)["decode"]["d0"]["tokens"] == 100_000  # the wasted request left no trace


def test_decode_check_reads_the_instance_load_not_the_request():
    """Algorithm 1 compares the selected decode instance's TBT (its load) with the SLO: an instance
    below its limit takes a request even when the request pushes it over (the engine queues it)."""
    c = make("none")
    assert isinstance(run_to_decode(c, "big", 90_000, now=0.0), DecodeAssignment)
    out = run_to_decode(c, "late", 20_000, now=1.0)
    assert isinstance(out, DecodeAssignment) and not out.within_slo
    assert isinstance(run_to_decode(c, "tiny", 200, now=2.0), Rejected)  # now full: even a tiny one is turned away


def test_early_rejects_at_arrival_on_current_decode_load():
    c = make("early")
    assert isinstance(run_to_decode(c, "big", 100_000, now=0.0), DecodeAssignment)
    r = c.schedule(KEYS, 2_000, 100, now=1.0)
    assert isinstance(r, Rejected) and (r.reason, r.stage) == (RejectReason.DECODE_OVERLOADED, "arrival")
    c.decode_finished("big", now=2.0)
    assert isinstance(c.schedule(KEYS, 20_000, 100, now=2.0), Decision)  # room again


def test_early_reads_the_whole_decode_pool():
    """Early rejection compares the decode pool's load now with its limit: one full instance does not
    turn a request away while another has room, even if requests in prefill are paired with that one."""
    c = make("early", decode=2)
    assert isinstance(run_to_decode(c, "a", 100_000, now=0.0), DecodeAssignment)  # d0 full
    for i in range(2):  # paired with d1, still in prefill
        assert isinstance(c.schedule(KEYS, 74_900, 100, now=1.0, request_id=f"q{i}"), Decision)
    assert c.loads(1.0)["decode"]["d0"]["tokens"] == 100_000 and c.decode_pool_load() == 0.5
    assert isinstance(c.schedule(KEYS, 2_000, 100, now=1.0), Decision)
    for i in range(2):
        c.prefill_started(f"q{i}", now=1.0)
        assert isinstance(c.prefill_finished(f"q{i}", now=2.0), DecodeAssignment)
    r = c.schedule(KEYS, 2_000, 100, now=2.0)  # 250k of 200k: the pool is full
    assert isinstance(r, Rejected) and r.reason == RejectReason.DECODE_OVERLOADED


def test_early_commits_admitted_requests_to_decode():
    c = make("early")
    for i in range(3):  # all admitted against an empty pool, 60k tokens each
        assert isinstance(c.schedule(KEYS, 59_900, 100, now=0.0, request_id=i), Decision)
    outs = []
    for i in range(3):
        c.prefill_started(i, now=float(i))
        outs.append(c.prefill_finished(i, now=float(i) + 1))
    assert all(isinstance(o, DecodeAssignment) for o in outs)  # no wasted prefill
    assert not outs[-1].within_slo  # the overshoot shows up as TBT above the SLO


def _warm_predictor(c: Conductor, decode_time: float) -> None:
    """Teach the predictor that decode takes ``decode_time`` seconds."""
    for i in range(5):
        rid = f"w{i}"
        run_to_decode(c, rid, 1000, now=0.0)
        c.decode_finished(rid, now=c.predictor._tracked[rid].start + decode_time)


def test_prediction_admits_when_decode_will_have_drained_by_then():
    early, pred = make("early"), make("prediction")
    for c in (early, pred):
        _warm_predictor(c, decode_time=2.0)
        c.report_prefill_load("p0", 5, 10.0, now=10.0)  # the request reaches decode in >= 10 s
        c.report_prefill_load("p1", 5, 10.0, now=10.0)
        assert isinstance(run_to_decode(c, "big", 100_000, now=10.0), DecodeAssignment)  # decode full now
    assert isinstance(early.schedule(KEYS, 20_000, 100, now=10.0), Rejected)
    d = pred.schedule(KEYS, 20_000, 100, now=10.0)
    assert isinstance(d, Decision) and d.est_ttft_s > 10  # "big" will be gone by then


def test_prediction_rejects_when_admitted_prefills_will_fill_decode():
    early, pred = make("early"), make("prediction")
    for c in (early, pred):
        _warm_predictor(c, decode_time=60.0)
        for i in range(2):  # 2 x 45k admitted, still in prefill: invisible to the current decode load
            assert isinstance(c.schedule(KEYS, 44_900, 100, now=1.0, request_id=f"q{i}"), Decision)
    assert isinstance(early.schedule(KEYS, 20_000, 100, now=1.0), Decision)
    r = pred.schedule(KEYS, 20_000, 100, now=1.0)
    assert isinstance(r, Rejected) and r.reason == RejectReason.DECODE_PREDICTED


def test_predictor_survival_model():
    p = DecodeLoadPredictor(tbt_slo=0.1, initial_output_tokens=100)
    assert p.decode_time == pytest.approx(10.0)
    p.decoding("a", 1000, now=0.0)
    assert p.tokens_at(5.0, now=0.0) == 1000 and p.tokens_at(10.0, now=0.0) == 0
    for i, d in enumerate([4.0, 8.0]):
        p.decoding(i, 1, now=0.0)
        p.finished(i, now=d)
    assert p.decode_time == pytest.approx(6.0)
    p.admitted("b", 500, predicted_decode_start=3.0)
    assert p.tokens_at(2.0, now=0.0) == 1000  # "a" survives 2 s surely; "b" is not in decode yet
    assert p.tokens_at(5.0, now=0.0) == 500 + 500  # "a" half likely past 5 s; "b" surely there
    assert p.tokens_at(5.0, now=4.5) == 500 + 1000  # "a" has survived 4.5 s: it lasts 8 s


def test_predictor_counts_running_decodes_as_censored():
    """Only short decodes have finished, two have run 10 s and still go on: finished times alone say no
    decode outlasts 2 s; with the running ones as censored observations (Kaplan-Meier, at risk at 2 s: 5,
    3 die) a decode outlasts 2 s, and so 5 s, with probability 2/5."""
    p = DecodeLoadPredictor(tbt_slo=0.1)
    for i in range(3):
        p.decoding(i, 1, now=0.0)
        p.finished(i, now=2.0)
    p.decoding("long0", 1000, now=0.0)
    p.decoding("long1", 1000, now=0.0)
    p.admitted("b", 500, predicted_decode_start=11.0)
    assert p.tokens_at(16.0, now=10.0) == pytest.approx(2000 + 500 * 2 / 5)  # "long*" outlived every death
    assert p.tokens_at(10.5, now=10.0) == pytest.approx(2000)  # "b" not in decode yet
    p.finished("long0", now=12.0)
    p.finished("long1", now=12.0)
    assert p.tokens_at(13.0, now=12.0) == pytest.approx(500 * 2 / 5)  # S(2) = 2/5 from 3 x 2 s, 2 x 12 s


def test_no_instances_and_bad_modes():
    c = Conductor(PrefixIndex(), COST, namespace=NS, clock=SimClock())
    r = c.schedule(KEYS, 100, 1, now=0.0)
    assert isinstance(r, Rejected) and r.reason == RejectReason.NO_INSTANCE
    c.register_prefill("p0", "n0")
    c.schedule(KEYS, 100, 1, now=0.0, request_id="x")
    c.prefill_started("x", now=0.0)
    assert c.prefill_finished("x", now=1.0).reason == RejectReason.NO_INSTANCE
    with pytest.raises(InvalidRequest):
        c.register_prefill("p0", "n1")
    with pytest.raises(ConfigError):
        Conductor(PrefixIndex(), admission="sometimes")


def test_load_reports_follow_the_registered_role_and_an_idle_decode_report_clears_its_load():
    c = make("early")
    limit = c.loads(0.0)["decode"]["d0"]["token_limit"]
    assert c.report_load("d0", batch=40, context_tokens=limit, now=0.0) == "decode"
    r = c.schedule(KEYS, 2_000, 100, now=0.0)
    assert isinstance(r, Rejected) and r.reason == RejectReason.DECODE_OVERLOADED
    assert c.report_load("d0", now=1.0) == "decode"  # idle: all zeros, still a decode report
    assert c.loads(1.0)["decode"]["d0"] == {"batch": 0, "tokens": 0, "token_limit": limit}
    assert isinstance(c.schedule(KEYS, 2_000, 100, now=1.0), Decision)
    assert c.report_load("p1", queue_len=3, busy_s=50.0, batch=9, context_tokens=9, now=1.0) == "prefill"
    assert c.loads(1.0)["prefill"]["p1"]["queue_s"] >= 50.0
    assert c.loads(1.0)["decode"]["d0"]["batch"] == 0  # a prefill engine's decode fields are ignored
    with pytest.raises(InvalidRequest):
        c.report_load("nope", now=1.0)


def test_a_deregistered_engine_gets_no_new_work_and_its_requests_end():
    c = make("off", decode=2)
    dec = run_to_decode(c, "dec", 1_000, now=0.0)  # decoding on dec.decode
    q = c.schedule(KEYS, 4000, 10, now=1.0, request_id="q")  # queued on q.prefill
    assert c.deregister(q.prefill, now=1.0) == 1  # "q" ends; "dec" had left prefill
    assert c.deregister(q.prefill, now=1.0) is None and c.in_flight() == 1
    with pytest.raises(InvalidRequest):
        c.prefill_started("q", now=1.0)
    assert all(d.reserved_tokens == 0 for d in c.registry.decode_instances())  # q's pairing released
    r = c.schedule(KEYS, 4000, 10, now=2.0, request_id="r")
    assert r.prefill != q.prefill and r.decode != dec.decode  # paired with the idle decode engine
    assert c.deregister(r.decode, now=2.0) == 0  # r was only paired with it
    c.prefill_started("r", now=2.0)
    out = c.prefill_finished("r", now=3.0)
    assert isinstance(out, DecodeAssignment) and out.decode == dec.decode  # paired again at decode
    assert list(c.loads(3.0)["decode"]) == [dec.decode]
    assert c.deregister(dec.decode, now=3.0) == 2 and c.in_flight() == 0
    c.decode_finished("dec", now=4.0)  # a late report of an ended request: ignored
    assert c.loads(4.0)["decode"] == {}


def test_a_request_never_reported_finished_expires_after_the_ttl():
    clock = SimClock()
    c = make("off", prefill=1, clock=clock, request_ttl=10.0)
    c.schedule(KEYS, 4000, 10, request_id="lost")  # never reported again
    c.schedule(KEYS, 4000, 10, request_id="live")
    clock.advance(6.0)
    c.prefill_started("live")  # a report: 10 s more from now
    clock.advance(5.0)
    assert c.expire() == 1 and c.expired == 1 and c.in_flight() == 1
    assert c.loads()["prefill"]["p0"]["assigned"] == 1
    with pytest.raises(InvalidRequest):
        c.prefill_started("lost")
    clock.advance(5.0)  # 16 s: "live" is past its TTL too
    assert c.loads()["prefill"]["p0"]["assigned"] == 0 and c.expired == 2
    assert isinstance(c.schedule(KEYS, 4000, 10, request_id="lost"), Decision)  # the id is free again

    d = make("off", request_ttl=10.0)  # a decode that is never reported finished
    out = run_to_decode(d, "x", 5_000, now=0.0)
    assert d.loads(now=1.0)["decode"][out.decode]["tokens"] == 5_000
    assert d.loads(now=1.0 + 10.0 + 60.0)["decode"][out.decode]["tokens"] == 0
    assert make("off").expire(now=1e12) == 0  # no TTL by default (replay)
    with pytest.raises(ConfigError):
        make("off", request_ttl=0)


def test_schedule_is_thread_safe():
    c = make("off", prefill=4, decode=2, clock=MonotonicClock())
    c.index.apply("n0", [(NS, [(STORED, DRAM, k) for k in KEYS])])
    decisions = []

    def worker(t):
        for i in range(200):
            decisions.append(c.schedule(KEYS, 4096, 10, request_id=(t, i)))

    errors = run_in_threads(worker, 8)
    assert not errors and len(decisions) == 1600
    loads = c.loads()["prefill"]
    assert sum(v["assigned"] for v in loads.values()) == 1600
    assert sum(c.registry.prefill[p].queued_s for p in loads) == pytest.approx(sum(d.service_s for d in decisions))


def test_requests_in_flight_are_capped_so_silent_callers_cannot_grow_the_master():
    from kvstore.master.index import PrefixIndex
    from kvstore.scheduler.conductor import Conductor, Rejected, RejectReason

    conductor = Conductor(PrefixIndex(), max_requests=2)
    conductor.register_prefill("p0", "node-a")
    conductor.register_decode("d0", "node-a")
    first, second = (conductor.schedule([], 100, 10, now=0.0) for _ in range(2))
    third = conductor.schedule([], 100, 10, now=0.0)
    assert isinstance(third, Rejected) and third.reason is RejectReason.TOO_MANY_REQUESTS
    assert conductor.cancel(first.request_id, now=0.0)
    assert not isinstance(conductor.schedule([], 100, 10, now=0.0), Rejected)
