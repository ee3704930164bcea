"""Engine registry: prefill and decode instances, each attached to a storage node, and their loads.

A prefill instance runs one request at a time from a FIFO queue; its load is
the work assigned to it and not finished: ``queue_time(now)`` = what is left
of the running request's estimate + the estimates of the queued ones. A
decode instance runs a continuous batch; its load is the context tokens of the
requests assigned to it (input + output tokens each), plus, apart, the
tokens of requests paired with it at arrival and still in prefill
(``reserved``).

The conductor keeps these numbers from the lifecycle it sees (assign, start,
finish). An engine may also report its own view (``report_prefill_load``,
``report_decode_load``: queue length and busy seconds, running batch and
context tokens); a reported load counts when it is larger than the
bookkept one, and a prefill backlog ages out with the time passed since the
report. A report replaces the previous one, so an idle report (zeros) clears
a high one.

Not thread-safe on its own: the :class:`~kvstore.scheduler.conductor.Conductor`
calls it under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.errors import InvalidRequest


@dataclass
class PrefillInstance:
    """One prefill engine: FIFO, one request at a time, on storage node ``node_id``."""

    instance_id: str
    node_id: str
    queued: dict = field(default_factory=dict)  # request id -> estimated seconds, FIFO order
    queued_s: float = 0.0
    running: object = None  # request id or None
    run_start: float = 0.0
    run_est: float = 0.0
    reported_busy_s: float = 0.0  # engine-reported backlog, at reported_at
    reported_at: float = 0.0
    reported_queue_len: int = 0

    def assigned(self) -> int:
        """Requests assigned and not finished (queued + running)."""
        return len(self.queued) + (self.running is not None)

    def queue_time(self, now: float) -> float:
        """Seconds before a request assigned now would start."""
        left = self.queued_s
        if self.running is not None:
            left += max(0.0, self.run_start + self.run_est - now)
        reported = self.reported_busy_s - (now - self.reported_at)
        return left if left >= reported else reported

    def load(self) -> int:
        return max(self.assigned(), self.reported_queue_len)


@dataclass
class DecodeInstance:
    """One decode engine: a continuous batch, on storage node ``node_id``."""

    instance_id: str
    node_id: str
    token_limit: int = 0  # context tokens it holds within the TBT SLO
    running: dict = field(default_factory=dict)  # request id -> context tokens
    context_tokens: int = 0
    reserved: dict = field(default_factory=dict)  # request id -> tokens: paired at arrival, still in prefill
    reserved_tokens: int = 0
    reported_tokens: int = 0
    reported_batch: int = 0

    def tokens(self) -> int:
        return max(self.context_tokens, self.reported_tokens)

    def batch(self) -> int:
        return max(len(self.running), self.reported_batch)

    def load(self) -> float:
        """Context tokens held / the most it holds within the TBT SLO and its KV memory (>= 1: full)."""
        return self.tokens() / self.token_limit if self.token_limit > 0 else float("inf")


class Registry:
    """Prefill and decode instances by id, and which storage node each is attached to."""

    def __init__(self) -> None:
        self.prefill: dict[str, PrefillInstance] = {}
        self.decode: dict[str, DecodeInstance] = {}
        self._prefill_list: list[PrefillInstance] = []
        self._decode_list: list[DecodeInstance] = []

    # -- membership -------------------------------------------------------------------------
    def add_prefill(self, instance_id: str, node_id: str) -> PrefillInstance:
        self._check_new(instance_id, node_id)
        inst = self.prefill[instance_id] = PrefillInstance(instance_id, node_id)
        self._prefill_list = list(self.prefill.values())
        return inst

    def add_decode(self, instance_id: str, node_id: str, token_limit: int) -> DecodeInstance:
        self._check_new(instance_id, node_id)
        inst = self.decode[instance_id] = DecodeInstance(instance_id, node_id, token_limit)
        self._decode_list = list(self.decode.values())
        return inst

    def role(self, instance_id: str) -> str | None:
        """The role the instance registered with, "prefill" or "decode"; None if unknown."""
        if instance_id in self.prefill:
            return "prefill"
        if instance_id in self.decode:
            return "decode"
        return None

    def remove(self, instance_id: str) -> bool:
        """Forget an instance (its assigned requests are dropped with it). False if unknown."""
        if self.prefill.pop(instance_id, None) is not None:
            self._prefill_list = list(self.prefill.values())
            return True
        if self.decode.pop(instance_id, None) is not None:
            self._decode_list = list(self.decode.values())
            return True
        return False

    def _check_new(self, instance_id: str, node_id: str) -> None:
        if not instance_id or not node_id:
            raise InvalidRequest("an instance needs an id and a storage node id")
        if instance_id in self.prefill or instance_id in self.decode:
            raise InvalidRequest(f"instance {instance_id!r} is already registered")

    def prefill_instances(self) -> list[PrefillInstance]:
        return self._prefill_list

    def decode_instances(self) -> list[DecodeInstance]:
        return self._decode_list

    def get_prefill(self, instance_id: str) -> PrefillInstance:
        try:
            return self.prefill[instance_id]
        except KeyError:
            raise InvalidRequest(f"unknown prefill instance {instance_id!r}") from None

    def get_decode(self, instance_id: str) -> DecodeInstance:
        try:
            return self.decode[instance_id]
        except KeyError:
            raise InvalidRequest(f"unknown decode instance {instance_id!r}") from None

    # -- prefill lifecycle ------------------------------------------------------------------
    @staticmethod
    def assign_prefill(inst: PrefillInstance, request_id, est_s: float) -> None:
        inst.queued[request_id] = est_s
        inst.queued_s += est_s

    @staticmethod
    def start_prefill(inst: PrefillInstance, request_id, now: float) -> None:
        est = inst.queued.pop(request_id, None)
        if est is None:
            raise InvalidRequest(f"request {request_id!r} is not queued on {inst.instance_id}")
        inst.queued_s = max(0.0, inst.queued_s - est) if inst.queued else 0.0
        inst.running, inst.run_start, inst.run_est = request_id, now, est

    @staticmethod
    def finish_prefill(inst: PrefillInstance, request_id) -> None:
        if inst.running == request_id:
            inst.running = None
            return
        est = inst.queued.pop(request_id, None)  # finished or cancelled without a start report
        if est is not None:
            inst.queued_s = max(0.0, inst.queued_s - est) if inst.queued else 0.0

    # -- decode lifecycle -------------------------------------------------------------------
    @staticmethod
    def reserve_decode(inst: DecodeInstance, request_id, tokens: int) -> None:
        inst.reserved[request_id] = tokens
        inst.reserved_tokens += tokens

    @staticmethod
    def release_decode(inst: DecodeInstance, request_id) -> None:
        tokens = inst.reserved.pop(request_id, None)
        if tokens is not None:
            inst.reserved_tokens -= tokens

    @staticmethod
    def assign_decode(inst: DecodeInstance, request_id, tokens: int) -> None:
        inst.running[request_id] = tokens
        inst.context_tokens += tokens

    @staticmethod
    def finish_decode(inst: DecodeInstance, request_id) -> None:
        tokens = inst.running.pop(request_id, None)
        if tokens is not None:
            inst.context_tokens -= tokens

    # -- engine reports ---------------------------------------------------------------------
    def report_prefill_load(self, instance_id: str, queue_len: int, busy_s: float, now: float) -> None:
        inst = self.get_prefill(instance_id)
        inst.reported_queue_len, inst.reported_busy_s, inst.reported_at = int(queue_len), float(busy_s), now

    def report_decode_load(self, instance_id: str, batch: int, context_tokens: int) -> None:
        inst = self.get_decode(instance_id)
        inst.reported_batch, inst.reported_tokens = int(batch), int(context_tokens)
