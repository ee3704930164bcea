"""The conductor: engine registry, cost model, prefill/decode placement, admission control.

Pure Python (numpy for fitting), no grpc: the master's gRPC adapter calls
:class:`Conductor` live; ``bench.replay`` drives the same code under a
:class:`SimClock`.
"""

from kvstore.scheduler.admission import ADMISSIONS, DecodeLoadPredictor, make_admission
from kvstore.scheduler.clock import Clock, MonotonicClock, SimClock
from kvstore.scheduler.conductor import Conductor, Decision, DecodeAssignment, Rejected, RejectReason
from kvstore.scheduler.cost_model import CostModel, CostParams, PolynomialPrefill
from kvstore.scheduler.policies import PREFILL_POLICIES, PrefillChoice, Prefix, make_prefill_policy, select_decode
from kvstore.scheduler.registry import DecodeInstance, PrefillInstance, Registry

__all__ = [
    "ADMISSIONS",
    "Clock",
    "Conductor",
    "CostModel",
    "CostParams",
    "Decision",
    "DecodeAssignment",
    "DecodeInstance",
    "DecodeLoadPredictor",
    "MonotonicClock",
    "PREFILL_POLICIES",
    "PrefillChoice",
    "PolynomialPrefill",
    "Prefix",
    "PrefillInstance",
    "Registry",
    "RejectReason",
    "Rejected",
    "SimClock",
    "make_admission",
    "make_prefill_policy",
    "select_decode",
]
