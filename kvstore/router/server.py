"""The router: OpenAI-compatible HTTP in front of prefill and decode vLLM engines, placed by the conductor.

Per ``/v1/completions`` or ``/v1/chat/completions`` request:

1. tokenize: a prompt of token ids as it is; text or chat messages through an engine's
   ``/tokenize`` (the engines' own tokenizer and chat template, so the ids are theirs);
2. hash the ids into block keys with ``VLLMBlockHasher`` under the settings the engines
   announced (block size, hash algorithm, ``PYTHONHASHSEED``; a request's ``cache_salt`` too),
   in the conductor namespace they registered in (their last layer's pool namespace);
3. ``Schedule`` at the conductor, with ``start_prefill`` (the prefill goes out at once, so
   no prefill_started report follows): a rejection is HTTP 429 with ``Retry-After``;
4. send the request to the chosen prefill engine with ``max_tokens`` 1, not streamed: its
   connector stores the prompt's KV in the pool; ``report_request`` prefill_finished (which
   names the decode engine, or rejects: 429 again; its reply is not waited for when Schedule
   said the decode engine is final, as under every admission but ``none``), while waiting
   (at most ``index_wait_s``) until the master's index holds the prompt's blocks (its partial last block too, under
   ``vllm_hashing.tail_hash``, when the prefill engine stores those), so the decode engine's
   lookup finds what was just stored;
5. send the request as it came to the decode engine, which loads the prefix from the pool and
   generates; its answer (or SSE stream) goes back unchanged, then decode_finished (cancelled
   on any failure).

Every other field passes through unchanged. Engines are found from the records their
connectors keep in the pool (``kvstore_client.vllm.engines``). Every engine call has a
connect timeout and a timeout between bytes: an engine that dies or stalls ends a request
with a 502/504 JSON error, or a stream with an SSE ``error`` event and ``[DONE]``; never a hang.

An engine that refuses or resets the connection before any byte of its answer (killed, its
host gone) is dead to the router: it deregisters the engine's conductor ids at once, so the
next Schedule does not pick it, and, nothing having reached the client yet, runs the request
once more from Schedule on whatever engines the conductor picks now (``Router._engine_down``
says why a router may deregister). A failure after the answer began is not retried.
The response carries ``x-kvstore-request-id``, ``x-kvstore-prefill-engine``,
``x-kvstore-decode-engine``, ``x-kvstore-prefix-blocks`` and ``x-kvstore-prefix-tokens`` (the
conductor's reply: how much of the prompt the pool already held).

The conductor calls go to the master's conductor port from the event loop, or over gRPC
(``conductor_calls.ConductorCalls``); the other pool calls are the synchronous SDK, run in
threads (``asyncio.to_thread``). The HTTP side is aiohttp (server and client in one package,
with streaming both ways).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import (
    ClientConnectorError,
    ClientError,
    ClientOSError,
    ClientSession,
    ClientTimeout,
    ServerDisconnectedError,
    TCPConnector,
    web,
)

from kvstore.router.conductor_calls import ConductorCalls
from kvstore_client.errors import KVStoreError, Overloaded

log = logging.getLogger(__name__)

#: fields a chat request's /tokenize call takes from the request (the rest would be refused there)
CHAT_TOKENIZE_FIELDS = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "mm_processor_kwargs",
)
COMPLETION_TOKENIZE_FIELDS = ("prompt", "add_special_tokens")
#: fields dropped or set for the prefill call (one token, one sequence, not streamed)
PREFILL_DROPPED = ("stream_options", "best_of", "min_tokens")
# vLLM's OpenAI server (uvicorn) closes a keep-alive connection idle for 5 s: a pooled one kept
# longer may be reused just as the engine closes it, and that reset would read as a dead engine.
ENGINE_KEEPALIVE_S = 2.0
# What the router times per request (kvstore_router_stage_seconds_total): from its arrival to
# the conductor's Schedule (the body, the engine records, tokens, hashes); Schedule; from then
# to the prefill call; the prefill call; from its answer to the decode call (prefill_finished
# and the index wait, side by side); the decode engine's first streamed byte.
STAGES = ("accept", "schedule", "to_prefill", "prefill", "to_decode", "decode_first_byte")
# The index is polled for a prefill's blocks every INDEX_POLL_S[0] s at first (a node reports a
# burst of blocks a few ms after its last one), backing off to INDEX_POLL_S[1] s.
INDEX_POLL_S = (0.002, 0.01)
_ARRIVED = web.RequestKey("kvstore_arrived", float)  # perf_counter() when the request came in


@dataclass(frozen=True)
class EngineRecord:
    """What a connector announces about its engine (kvstore_client.vllm.engines)."""

    engine_id: str
    url: str
    role: str
    ids: dict
    conductor_namespace: str
    block_size: int
    hash_algo: str
    hash_seed: str | None
    model: str
    partial_blocks: bool | None = None  # stores prompts' partial last blocks (None: an older engine, which does not)

    @classmethod
    def from_json(cls, value: bytes) -> "EngineRecord":
        data = json.loads(value)
        return cls(**{f: data.get(f) for f in cls.__dataclass_fields__})


class PoolBackend:
    """The router's pool side, synchronous (the router runs it in threads): engine records, the
    conductor's Schedule and lifecycle reports, and the index's view of a prompt's blocks."""

    def __init__(self, client, namespace: str = "vllm"):
        from kvstore_client.vllm.engines import RECORDS

        self._client = client
        self._records_namespace = f"{namespace}/{RECORDS}"

    def engines(self) -> list[EngineRecord]:
        listing = self._client.list_keys(namespace=self._records_namespace, limit=10_000)
        keys = [(k.namespace, k.digest) for k in listing.keys if k.namespace == self._records_namespace]
        records = []
        for value in self._client.batch_get(keys) if keys else []:
            if value is not None:
                try:
                    records.append(EngineRecord.from_json(value))
                except (ValueError, TypeError) as exc:
                    log.warning("router: skipping an unreadable engine record: %s", exc)
        return records

    def schedule(self, keys, input_length: int, output_length: int, request_id: str, namespace: str):
        """The conductor's placement; the prefill goes out at once, so it counts as started."""
        return self._client.scheduling.schedule(
            keys, input_length, output_length, request_id=request_id, namespace=namespace, start_prefill=True
        )

    def report(self, namespace: str, request_id: str, stage: str):
        return self._client.scheduling.report_request(namespace, request_id, stage)

    def conductor_port(self):
        """(address, token, TLS context) of the master's conductor port, or None when it has none."""
        address = self._client.cluster_status().conductor_address
        if not address:
            return None
        credentials = self._client.credentials
        return address, credentials.token, credentials.client_tls()

    def indexed(self, keys) -> int:
        return self._client.match_prefix(keys).longest

    def deregister(self, namespace: str, conductor_id: str) -> bool:
        """Take an engine id out of the conductor; whether it was registered."""
        return self._client.scheduling.deregister_engine(namespace, conductor_id).known

    def close(self) -> None:
        self._client.close()


@dataclass
class Metrics:
    requests: dict = field(default_factory=dict)  # outcome -> count
    prefix_tokens: int = 0
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stages: dict = field(default_factory=dict)  # stage -> [seconds, times]: where a request's time goes

    def count(self, outcome: str) -> None:
        self.requests[outcome] = self.requests.get(outcome, 0) + 1

    def timed(self, stage: str, seconds: float) -> None:
        """One request spent ``seconds`` in ``stage`` (see ``STAGES``)."""
        total = self.stages.setdefault(stage, [0.0, 0])
        total[0] += seconds
        total[1] += 1

    def text(self, engines: int) -> str:
        lines = [
            "# HELP kvstore_router_requests_total Requests by outcome.",
            "# TYPE kvstore_router_requests_total counter",
        ]
        lines += [f'kvstore_router_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(self.requests.items())]
        for name, kind, text, column in (
            ("stage_seconds_total", "counter", "Seconds requests spent in each stage before decode.", 0),
            ("stage_total", "counter", "Requests timed in each stage.", 1),
        ):
            lines += [f"# HELP kvstore_router_{name} {text}", f"# TYPE kvstore_router_{name} {kind}"]
            lines += [f'kvstore_router_{name}{{stage="{k}"}} {v[column]}' for k, v in sorted(self.stages.items())]
        for name, value, kind, text in (
            ("prompt_tokens_total", self.prompt_tokens, "counter", "Prompt tokens of scheduled requests."),
            ("prefix_tokens_total", self.prefix_tokens, "counter", "Prompt tokens the pool held at schedule."),
            ("prefill_seconds_total", self.prefill_seconds, "counter", "Seconds spent in prefill calls."),
            ("decode_seconds_total", self.decode_seconds, "counter", "Seconds spent in decode calls."),
            ("engines", engines, "gauge", "Engines known from the pool's records."),
        ):
            lines += [
                f"# HELP kvstore_router_{name} {text}",
                f"# TYPE kvstore_router_{name} {kind}",
                f"kvstore_router_{name} {value}",
            ]
        return "\n".join(lines) + "\n"


class HTTPFailure(Exception):
    """A request ends with this HTTP status and OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        headers: dict | None = None,
        body: bytes | None = None,
        content_type: str = "application/json",
    ):
        super().__init__(message)
        self.status, self.kind, self.headers, self.body, self.content_type = (
            status,
            kind,
            headers or {},
            body,
            content_type,
        )

    def response(self) -> web.Response:
        body = self.body if self.body is not None else json.dumps(error_body(str(self), self.kind, self.status))
        return web.Response(status=self.status, body=body, content_type=self.content_type, headers=self.headers)


class EngineUnreachable(HTTPFailure):
    """An engine refused or reset the connection before any byte of its answer (a 502)."""

    def __init__(self, engine: "EngineRecord", message: str, headers: dict | None = None):
        super().__init__(502, message, "bad_gateway", headers)
        self.engine = engine


_LOST = {errno.ECONNREFUSED, errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED}


def connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (raised before a response arrived) means the engine's end is gone:
    the connection refused or reset, or closed before the response started."""
    if isinstance(exc, (ClientConnectorError, ServerDisconnectedError)):
        return True
    return isinstance(exc, ClientOSError) and exc.errno in _LOST


def tail_keys(engine: EngineRecord, namespace: str, tokens: list[int], hashes: list[bytes]) -> list:
    """[the key of the prompt's partial last block] when ``engine`` stores one for this prompt
    (``kvstore_client.vllm_hashing.prompt_tail``), else []: the connector's key, so the wait
    covers what the decode engine's lookup asks for."""
    from kvstore_client.vllm_hashing import prompt_tail, tail_hash

    tail = prompt_tail(tokens, engine.block_size) if engine.partial_blocks and hashes else None
    return [] if tail is None else [(namespace, tail_hash(hashes[-1], tail))]


def error_body(message: str, kind: str, code: int) -> dict:
    return {"error": {"message": message, "type": kind, "code": code}}


class Router:
    """The aiohttp handlers (see the module doc). ``backend``: a PoolBackend, or a stand-in in tests."""

    def __init__(
        self,
        backend,
        *,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        prefill_timeout: float = 300.0,
        index_wait_s: float = 1.0,
        records_ttl_s: float = 2.0,
        retry_after_s: int = 1,
    ):
        self.backend = backend
        self.connect_timeout, self.read_timeout, self.prefill_timeout = connect_timeout, read_timeout, prefill_timeout
        self.index_wait_s, self.records_ttl_s, self.retry_after_s = index_wait_s, records_ttl_s, retry_after_s
        self.metrics = Metrics()
        self.conductor = ConductorCalls(backend)
        self._records: list[EngineRecord] = []
        self._records_at = -1e9
        self._refreshing: asyncio.Future | None = None  # a background read of the records
        self._session: ClientSession | None = None

    # -- plumbing --------------------------------------------------------------------------------
    async def start(self, app=None) -> None:
        self._session = ClientSession(
            connector=TCPConnector(limit=0, keepalive_timeout=ENGINE_KEEPALIVE_S), auto_decompress=False
        )
        await self.conductor.prepare()

    async def stop(self, app=None) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
        if self._session is not None:
            await self._session.close()
        await self.conductor.close()
        await asyncio.to_thread(getattr(self.backend, "close", lambda: None))

    def timeout(self, total: float | None = None) -> ClientTimeout:
        return ClientTimeout(total=total, sock_connect=self.connect_timeout, sock_read=self.read_timeout)

    async def records(self, refresh: bool = False) -> list[EngineRecord]:
        """The engines' records, read from the pool when ``refresh`` or when none are held. Older
        than ``records_ttl_s``, the ones held serve while they are read again in the background:
        no request waits for the pool on that account."""
        if refresh or not self._records:
            await self._read_records()
        elif time.monotonic() - self._records_at > self.records_ttl_s and (
            self._refreshing is None or self._refreshing.done()
        ):
            self._refreshing = asyncio.ensure_future(self._read_records())
        return self._records

    async def _read_records(self) -> None:
        try:
            self._records = await asyncio.to_thread(self.backend.engines)
            self._records_at = time.monotonic()
        except (KVStoreError, OSError) as exc:
            if not self._records:
                raise HTTPFailure(
                    503, f"cannot read the engine records from the pool: {exc}", "service_unavailable"
                ) from None
            log.warning("router: engine records not refreshed (%s): using the last ones", exc)

    async def engines_for(self, model: Any) -> list[EngineRecord]:
        """The records of the model's engines (all of them when only one model is served)."""
        for refresh in (False, True):
            records = await self.records(refresh)
            matching = [r for r in records if r.model == model]
            if not matching and len({r.conductor_namespace for r in records}) == 1:
                matching = records
            if matching:
                return matching
        models = sorted({r.model for r in records})
        raise HTTPFailure(
            404 if records else 503,
            f"no engine serves model {model!r} (served: {', '.join(models) or 'none'})",
            "model_not_found" if records else "service_unavailable",
        )

    # -- endpoints -------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        try:
            records = await self.records()
        except HTTPFailure as failure:
            return failure.response()
        roles = {role for r in records for role in (r.ids or {})}
        ok = {"prefill", "decode"} <= roles
        return web.json_response(
            {"status": "ok" if ok else "no_engines", "engines": len(records)}, status=200 if ok else 503
        )

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.text(len(self._records)), content_type="text/plain")

    async def models(self, request: web.Request) -> web.Response:
        try:
            records = await self.records()
        except HTTPFailure as failure:
            return failure.response()
        seen, data = set(), []
        for r in records:
            if r.model not in seen:
                seen.add(r.model)
                data.append({"id": r.model, "object": "model", "owned_by": "kvstore", "root": r.model})
        return web.json_response({"object": "list", "data": data})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat/completions")

    # -- one request -----------------------------------------------------------------------------
    async def _generate(self, request: web.Request, path: str) -> web.StreamResponse:
        request[_ARRIVED] = time.perf_counter()
        try:
            body = await self._body(request, path)
            records = await self.engines_for(body.get("model"))
            tokens = await self._tokens(body, path, records)
            return await self._run_once_more(request, body, path, records, tokens)
        except HTTPFailure as failure:
            self.metrics.count(failure.kind)
            return failure.response()

    async def _body(self, request: web.Request, path: str) -> dict:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise HTTPFailure(400, "the request body must be JSON", "invalid_request_error") from None
        if not isinstance(body, dict):
            raise HTTPFailure(400, "the request body must be a JSON object", "invalid_request_error")
        if path == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch of one
            if isinstance(prompt, str):
                if not prompt:
                    raise HTTPFailure(400, "'prompt' is empty", "invalid_request_error")
            elif isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
                pass
            elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
                raise HTTPFailure(
                    400,
                    "the router takes one prompt per request (send a batch as separate requests)",
                    "invalid_request_error",
                )
            else:
                raise HTTPFailure(400, "'prompt' must be a string or a list of token ids", "invalid_request_error")
            body["prompt"] = prompt
        else:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise HTTPFailure(400, "'messages' must be a non-empty list of messages", "invalid_request_error")
        for name in ("max_tokens", "max_completion_tokens"):
            value = body.get(name)
            if value is not None and (type(value) is not int or value < 1):
                raise HTTPFailure(400, f"'{name}' must be a positive integer", "invalid_request_error")
        if not isinstance(body.get("stream", False), bool):
            raise HTTPFailure(400, "'stream' must be true or false", "invalid_request_error")
        return body

    async def _tokens(self, body: dict, path: str, records: list[EngineRecord]) -> list[int]:
        if path == "completions" and isinstance(body["prompt"], list):
            return body["prompt"]
        fields = COMPLETION_TOKENIZE_FIELDS if path == "completions" else CHAT_TOKENIZE_FIELDS
        query = {k: body[k] for k in fields if k in body}
        if "model" in body:
            query["model"] = body["model"]
        last = None
        for record in sorted(records, key=lambda r: "prefill" not in (r.ids or {})):
            try:
                async with self._session.post(
                    f"{record.url}/tokenize", json=query, timeout=self.timeout(self.read_timeout)
                ) as resp:
                    data = await resp.read()
                    if resp.status != 200:  # the engine refuses the prompt: its answer is the client's
                        raise HTTPFailure(
                            resp.status,
                            "tokenize refused",
                            "invalid_request_error",
                            body=data,
                            content_type=resp.content_type or "application/json",
                        )
                    return list(json.loads(data)["tokens"])
            except (ClientError, asyncio.TimeoutError, KeyError, ValueError) as exc:
                last = exc
        raise HTTPFailure(502, f"no engine could tokenize the prompt: {last!r}", "bad_gateway")

    async def _report(self, namespace: str, request_id: str, stage: str):
        try:
            return await self.conductor.report(namespace, request_id, stage)
        except (KVStoreError, OSError) as exc:
            log.warning("router: report %s of %s failed: %s", stage, request_id, exc)
            return None

    async def _run_once_more(
        self, request: web.Request, body: dict, path: str, records: list[EngineRecord], tokens: list[int]
    ) -> web.StreamResponse:
        """``_run``; when an engine turned out unreachable (nothing sent to the client yet), that
        engine is deregistered and the request runs once more, scheduled afresh."""
        for attempt in (1, 2):
            try:
                return await self._run(request, body, path, records, tokens)
            except EngineUnreachable as failure:
                await self._engine_down(failure.engine)
                if attempt == 2:
                    raise
                log.warning("router: %s; retrying the request on another engine", failure)
        raise AssertionError("unreachable")

    async def _engine_down(self, engine: EngineRecord) -> None:
        """Deregister every conductor id of an engine the router could not connect to.

        Why a router may deregister rather than only report: the conductor cannot check a
        router's word either way, and a deregistration is cheap to undo. A live engine's
        reporter registers again on its next load report, which the conductor answers
        "unknown engine" (kvstore_client.vllm.engines), so a router that misjudges (a
        partition between it and a live engine) costs that engine one report interval out
        of the schedule; a dead engine sends no report and stays out. The other way, an
        "unreachable" report the conductor would weigh, needs a new RPC and a policy for
        when to believe it, and still leaves a dead engine in the schedule until then.
        Deregistering ends the conductor's bookkeeping of the engine's requests in flight,
        which on a dead engine have failed anyway."""
        self.metrics.count("engine_unreachable")
        for conductor_id in (engine.ids or {}).values():
            try:
                await asyncio.to_thread(self.backend.deregister, engine.conductor_namespace, conductor_id)
                log.warning(
                    "router: engine %s (%s) is unreachable: deregistered %s from the conductor",
                    engine.engine_id,
                    engine.url,
                    conductor_id,
                )
            except (KVStoreError, OSError) as exc:
                log.warning("router: could not deregister unreachable engine %s: %s", conductor_id, exc)

    async def _run(
        self, request: web.Request, body: dict, path: str, records: list[EngineRecord], tokens: list[int]
    ) -> web.StreamResponse:
        from kvstore_client.vllm_hashing import VLLMBlockHasher

        first = records[0]
        namespace = first.conductor_namespace
        by_id = {cid: r for r in records for cid in (r.ids or {}).values()}
        salt = body.get("cache_salt")
        hasher = VLLMBlockHasher(
            first.block_size, first.hash_algo, seed=first.hash_seed, cache_salt=salt if isinstance(salt, str) else None
        )
        hashes = hasher.hashes(tokens)
        keys = [(namespace, h) for h in hashes]
        output_length = body.get("max_tokens") or body.get("max_completion_tokens") or 0
        request_id = uuid.uuid4().hex
        clock = time.perf_counter()
        arrived = request.pop(_ARRIVED, None)  # timed on the first attempt only
        if arrived is not None:
            self.metrics.timed("accept", clock - arrived)
        try:
            where = await self.conductor.schedule(keys, len(tokens), output_length, request_id, namespace)
        except Overloaded as exc:
            raise HTTPFailure(
                429,
                str(exc),
                "overloaded",
                {"Retry-After": str(self.retry_after_s), "x-kvstore-reject-reason": exc.reason or ""},
            ) from None
        except (KVStoreError, OSError) as exc:
            raise HTTPFailure(503, f"the conductor did not answer: {exc}", "service_unavailable") from None
        self.metrics.prompt_tokens += len(tokens)
        self.metrics.prefix_tokens += where.prefix_tokens
        headers = {
            "x-kvstore-request-id": request_id,
            "x-kvstore-prefill-engine": where.prefill_engine,
            "x-kvstore-decode-engine": where.decode_engine,
            "x-kvstore-prefix-blocks": str(where.prefix_blocks),
            "x-kvstore-prefix-tokens": str(where.prefix_tokens),
        }
        finished = False
        prefilled: asyncio.Task | None = None
        try:
            clock = self._lap("schedule", clock)
            prefill = by_id.get(where.prefill_engine) or await self._record(where.prefill_engine)
            clock = self._lap("to_prefill", clock)
            await self._prefill(prefill, body, path)  # started with Schedule: no prefill_started report
            clock = self._lap("prefill", clock)
            stored = keys + tail_keys(prefill, namespace, tokens, hashes)
            prefilled = asyncio.ensure_future(self._report(namespace, request_id, "prefill_finished"))
            if where.decode_final:  # the reply will name where.decode_engine: no need to wait for it
                await self._wait_indexed(stored)
                reply = None
            else:
                reply, _ = await asyncio.gather(prefilled, self._wait_indexed(stored))
            clock = self._lap("to_decode", clock)
            if reply is not None and reply.rejected:
                finished = True  # the conductor ended it
                raise HTTPFailure(
                    429,
                    f"{reply.reason}: {reply.detail}",
                    "overloaded",
                    {"Retry-After": str(self.retry_after_s), "x-kvstore-reject-reason": reply.reason},
                )
            decode_id = reply.decode_engine if reply is not None and reply.decode_engine else where.decode_engine
            headers["x-kvstore-decode-engine"] = decode_id
            decode = by_id.get(decode_id) or await self._record(decode_id)
            response = await self._decode(request, decode, body, path, headers, clock)
            await prefilled  # the conductor hears of the prefill's end before the decode's
            finished = await self._report(namespace, request_id, "decode_finished") is not None
            self.metrics.count("ok")
            return response
        finally:
            if prefilled is not None and not prefilled.done():
                await asyncio.wait([prefilled])
            if not finished:
                await self._report(namespace, request_id, "cancelled")

    async def _record(self, conductor_id: str) -> EngineRecord:
        for r in await self.records(refresh=True):
            if conductor_id in (r.ids or {}).values():
                return r
        raise HTTPFailure(
            502, f"the conductor chose engine {conductor_id!r}, which has no record in the pool", "bad_gateway"
        )

    async def _prefill(self, engine: EngineRecord, body: dict, path: str) -> None:
        job = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
        job.update(max_tokens=1, stream=False, n=1)
        if "max_completion_tokens" in job:
            job["max_completion_tokens"] = 1
        start = time.perf_counter()
        resp = None
        try:
            async with self._session.post(
                f"{engine.url}/v1/{path}", json=job, timeout=self.timeout(self.prefill_timeout)
            ) as resp:
                data = await resp.read()
                if resp.status != 200:
                    raise HTTPFailure(
                        resp.status,
                        "prefill refused",
                        "prefill_error",
                        body=data,
                        content_type=resp.content_type or "application/json",
                    )
        except asyncio.TimeoutError:
            raise HTTPFailure(
                504, f"prefill engine {engine.engine_id} did not answer in time", "gateway_timeout"
            ) from None
        except ClientError as exc:
            if resp is None and connection_lost(exc):
                raise EngineUnreachable(engine, f"prefill engine {engine.engine_id} is unreachable: {exc!r}") from None
            raise HTTPFailure(502, f"prefill engine {engine.engine_id} failed: {exc!r}", "bad_gateway") from None
        finally:
            self.metrics.prefill_seconds += time.perf_counter() - start

    async def _wait_indexed(self, keys) -> None:
        """Until the master's index holds the prompt's blocks the prefill stored (a node reports
        a burst of new blocks a few ms after its last one, a steady stream within 50 ms), at most
        index_wait_s: the decode engine's lookup must see them."""
        if not keys:
            return
        deadline = time.monotonic() + self.index_wait_s
        poll, slowest = INDEX_POLL_S
        while True:
            try:
                if await asyncio.to_thread(self.backend.indexed, keys) >= len(keys):
                    return
            except (KVStoreError, OSError):
                return
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(poll)
            poll = min(poll * 2, slowest)

    def _lap(self, stage: str, since: float) -> float:
        """Time ``stage`` as from ``since`` to now; now."""
        now = time.perf_counter()
        self.metrics.timed(stage, now - since)
        return now

    async def _decode(
        self, request: web.Request, engine: EngineRecord, body: dict, path: str, headers: dict, clock: float
    ) -> web.StreamResponse:
        start = time.perf_counter()
        try:
            return await self._relay(request, engine, body, path, headers, clock)
        finally:
            self.metrics.decode_seconds += time.perf_counter() - start

    async def _relay(
        self, request: web.Request, engine: EngineRecord, body: dict, path: str, headers: dict, clock: float
    ) -> web.StreamResponse:
        try:
            resp = await self._session.post(f"{engine.url}/v1/{path}", json=body, timeout=self.timeout())
        except asyncio.TimeoutError:
            raise HTTPFailure(
                504, f"decode engine {engine.engine_id} did not answer in time", "gateway_timeout", headers
            ) from None
        except ClientError as exc:
            if connection_lost(exc):
                raise EngineUnreachable(
                    engine, f"decode engine {engine.engine_id} is unreachable: {exc!r}", headers
                ) from None
            raise HTTPFailure(
                502, f"decode engine {engine.engine_id} failed: {exc!r}", "bad_gateway", headers
            ) from None
        async with resp:
            streaming = body.get("stream") and resp.status == 200 and resp.content_type == "text/event-stream"
            if not streaming:
                try:
                    data = await resp.read()
                except asyncio.TimeoutError:
                    raise HTTPFailure(
                        504, f"decode engine {engine.engine_id} stalled", "gateway_timeout", headers
                    ) from None
                except ClientError as exc:
                    raise HTTPFailure(
                        502, f"decode engine {engine.engine_id} failed mid-answer: {exc!r}", "bad_gateway", headers
                    ) from None
                if resp.status != 200:
                    raise HTTPFailure(
                        resp.status,
                        "decode refused",
                        "decode_error",
                        headers,
                        body=data,
                        content_type=resp.content_type or "application/json",
                    )
                return web.Response(status=200, body=data, content_type=resp.content_type, headers=headers)
            out = web.StreamResponse(status=200, headers={**headers, "Cache-Control": "no-cache"})
            out.content_type = "text/event-stream"
            await out.prepare(request)
            tail = b""
            failure = None
            first: float | None = clock
            try:
                async for chunk in resp.content.iter_any():
                    if first is not None:  # a streamed answer's first chunk: what TTFT waits for
                        self._lap("decode_first_byte", first)
                        first = None
                    await out.write(chunk)
                    tail = (tail + chunk)[-64:]
            except asyncio.TimeoutError:
                failure = f"decode engine {engine.engine_id} stalled for {self.read_timeout:.0f} s"
            except ClientError as exc:
                failure = f"decode engine {engine.engine_id} failed mid-stream: {exc!r}"
            if failure is None and b"data: [DONE]" not in tail:
                failure = f"decode engine {engine.engine_id} ended the stream early"
            if failure is not None:
                event = json.dumps(error_body(failure, "bad_gateway", 502))
                await out.write(f"event: error\ndata: {event}\n\ndata: [DONE]\n\n".encode())
                await out.write_eof()
                raise StreamFailed(out, failure)
            await out.write_eof()
            return out


class StreamFailed(HTTPFailure):
    """A stream already started ended with an error event: the response is sent, the request failed."""

    def __init__(self, response: web.StreamResponse, message: str):
        super().__init__(502, message, "stream_error")
        self._sent = response

    def response(self) -> web.StreamResponse:
        return self._sent


def build_app(router: Router) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_post("/v1/chat/completions", router.chat_completions)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.metrics_text)
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    return app


async def serve(router: Router, host: str, port: int, announce) -> None:
    """Serve until cancelled; ``announce(url)`` once listening (the port may have been 0)."""
    runner = web.AppRunner(build_app(router), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    announce(f"http://{host}:{bound}")
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
