"""Admission control under overload: who may enter, and who is turned away where.

Four modes (``make_admission(name)``):

- ``off``: never reject (measure only; the FAST'25 Fig. 5 setting). A request
  that reaches decode goes to the least-loaded decode instance even above the
  TBT SLO.
- ``none``: no early rejection, the paper's baseline. At arrival the prefill
  side refuses a request whose estimated TTFT exceeds the TTFT SLO; the decode
  side is checked only when prefill is done, and a request whose decode
  instance is full then is rejected: its prefill is wasted.
- ``early``: both checks at arrival, the decode one against the decode pool's
  *current* load (arXiv §7.2: the greater of the two pools' loads). An
  admitted request is committed: the decode stage takes it even if the pool
  has filled meanwhile (it waits there for KV memory). Requests admitted but
  still in prefill are invisible to the check, so admission overshoots, then
  shuts, and decode load oscillates.
- ``prediction``: as ``early``, but the decode check is against the decode
  load *predicted for the moment the request would reach decode*
  (now + estimated TTFT), see :class:`DecodeLoadPredictor`.

The decode checks of ``none`` and ``early`` read the decode side's load
(context tokens over what it holds within the TBT SLO and its KV memory) and
reject when it is full, whatever the request's size: Algorithm 1 compares the
selected instance's TBT with the SLO (``SelectDecodingInstance(D)`` never sees
the request), and one taken just below the limit waits for memory in the
engine's queue. ``prediction`` follows §7.4: the requests that will have left
prefill by the time this one does, this one included, against the pool's limit.

Not thread-safe: the conductor calls these under its lock.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore_client.errors import ConfigError

if TYPE_CHECKING:  # numpy is imported where it is used: a master that never schedules never loads it
    import numpy as np


@dataclass
class _Tracked:
    tokens: int
    start: float  # predicted decode start (in prefill) or actual decode start (decoding)
    decoding: bool = False


class DecodeLoadPredictor:
    """System-level prediction of the decode pool's context tokens at a future time.

    Requests' own output lengths are not known in advance, so, as in the
    paper, the prediction is system-level: every request's decode time is
    drawn from the same distribution (the paper takes one uniform ``t_d``; we
    keep the whole distribution), learnt from the decode times of the last
    ``window`` requests that finished (until the first one finishes: a fixed
    ``initial_output_tokens`` x the TBT SLO). A request counts at time T with
    the probability that it is still decoding then:

    - decoding since ``s``: ``S(T - s) / S(now - s)`` (it has survived so far);
    - admitted, still in prefill, predicted to reach decode at ``s`` (admission
      time + estimated TTFT): ``S(T - s)`` if ``s <= T``, else 0;

    where ``S(x)`` is the probability that a decode lasts longer than ``x``.
    The prediction is the expected context tokens, sum of tokens x
    probability.

    ``S`` is the Kaplan-Meier estimate over the finished decode times *and*
    the requests decoding now as right-censored observations (decoding for
    ``now - s`` so far, so longer than that). Finished times alone are biased
    short whenever the long decodes have not finished yet: at the start of a
    replay the first thousand to finish are the shortest ones. Measured on the
    conversation trace (8P+1D, 2x, admission ``prediction``), predicted minus
    actual pool tokens at the predicted time, in units of the pool's limit:
    -0.31 over the first 200 s and -0.09 over the run with finished times
    only; -0.20 and -0.06 with the censored ones (the rest is mostly requests
    admitted later that reach decode first, which no arrival-time check can
    see). That error grows with how far ahead the check looks (8P+1D, 2x:
    -0.02 of the limit 10-15 s ahead, -0.07 at 20-25 s, -0.23 at 25-30 s), so
    a request with a long prefill sees a pool emptier than it will be: the
    paper's system-level prediction counts only requests already admitted.
    With no request decoding the estimate is the plain fraction of finished
    times longer than ``x``, as before.
    O((window + requests in flight) log) per prediction, vectorised.
    """

    def __init__(self, tbt_slo: float, initial_output_tokens: float = 512.0, window: int = 1000) -> None:
        tbt = tbt_slo if tbt_slo != float("inf") else 0.1
        self._durations: list[float] = [initial_output_tokens * tbt]  # sorted
        self._recent: deque = deque()
        self._window = window
        self._seeded = True
        self._tracked: dict = {}

    @property
    def decode_time(self) -> float:
        """Mean of the recent decode times."""
        return sum(self._durations) / len(self._durations)

    def admitted(self, request_id, tokens: int, predicted_decode_start: float) -> None:
        self._tracked[request_id] = _Tracked(tokens, predicted_decode_start)

    def decoding(self, request_id, tokens: int, now: float) -> None:
        self._tracked[request_id] = _Tracked(tokens, now, True)

    def finished(self, request_id, now: float | None = None) -> None:
        """The request left (``now`` given: it finished decoding then, and its decode time counts)."""
        r = self._tracked.pop(request_id, None)
        if now is None or r is None or not r.decoding:
            return
        if self._seeded:
            self._durations.clear()
            self._seeded = False
        d = now - r.start
        insort(self._durations, d)
        self._recent.append(d)
        if len(self._recent) > self._window:
            old = self._recent.popleft()
            del self._durations[bisect_left(self._durations, old)]

    def _survival_curve(self, now: float, decoding_starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Kaplan-Meier: event times ascending and ``S`` just after each (see the class doc)."""
        import numpy as np

        done = np.asarray(self._durations, dtype=float)
        censored = now - decoding_starts
        times = np.concatenate([done, censored])
        died = np.concatenate([np.ones(len(done)), np.zeros(len(censored))])
        order = np.lexsort((-died, times))  # by time; a death before a censoring at the same time
        times, died = times[order], died[order]
        at_risk = len(times) - np.arange(len(times))
        return times, np.cumprod(1.0 - died / at_risk)

    @staticmethod
    def _s(times: np.ndarray, surv: np.ndarray, x: np.ndarray) -> np.ndarray:
        import numpy as np

        i = np.searchsorted(times, x, side="right")
        return np.where(i > 0, surv[np.maximum(i - 1, 0)], 1.0)

    def tokens_at(self, t: float, now: float) -> float:
        """Expected context tokens in the decode pool at time ``t`` (>= ``now``)."""
        import numpy as np

        tracked = self._tracked.values()
        if not tracked:
            return 0.0
        tokens = np.fromiter((r.tokens for r in tracked), float, len(tracked))
        start = np.fromiter((r.start for r in tracked), float, len(tracked))
        decoding = np.fromiter((r.decoding for r in tracked), bool, len(tracked))
        times, surv = self._survival_curve(now, start[decoding])
        p = self._s(times, surv, t - start)
        alive = self._s(times, surv, now - start)
        p = np.where(decoding, np.divide(p, alive, out=np.ones_like(p), where=alive > 0), p)
        p[start > t] = 0.0
        return float(tokens @ p)


class Admission:
    """Which checks run where. Subclasses set the flags."""

    name = ""
    check_ttft_at_arrival = True
    check_decode_at_arrival = False
    predict_decode = False
    reject_at_decode = False


class NoRejection(Admission):
    name = "off"
    check_ttft_at_arrival = False


class NoEarlyRejection(Admission):
    name = "none"
    reject_at_decode = True


class EarlyRejection(Admission):
    name = "early"
    check_decode_at_arrival = True


class PredictiveEarlyRejection(Admission):
    name = "prediction"
    check_decode_at_arrival = True
    predict_decode = True


ADMISSIONS = {cls.name: cls for cls in (NoRejection, NoEarlyRejection, EarlyRejection, PredictiveEarlyRejection)}


def make_admission(name: str) -> Admission:
    try:
        return ADMISSIONS[name]()
    except KeyError:
        raise ConfigError(f"unknown admission mode {name!r}; choose one of {sorted(ADMISSIONS)}") from None
