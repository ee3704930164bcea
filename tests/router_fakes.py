"""Stand-ins for the router's tests without engines: an aiohttp app served from a thread, a fake
OpenAI server that records what it is sent, and a fake pool backend."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from aiohttp import web

from kvstore.router.server import EngineRecord
from kvstore_client.errors import Overloaded
from kvstore_client.proto import kvstore_pb2 as pb
from kvstore_client.scheduling import EngineAssignment


class Served:
    """An aiohttp Application on 127.0.0.1 (any port), in an event loop of its own thread."""

    def __init__(self, app: web.Application):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.runner = web.AppRunner(app, access_log=None)
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def fake_engine(arrivals: list | None = None) -> tuple[web.Application, list]:
    """An OpenAI server: ``/tokenize`` maps words ``w<N>`` to N; completions answer ``w1 w2 ...``
    (streamed as SSE when asked). A prompt ``[666, ...]`` streams one chunk and drops the connection;
    ``[777, ...]`` answers nothing for 4 s. Every body it is sent lands in the list (and in
    ``arrivals``, when given: (path, stream, monotonic time))."""
    seen: list = []
    arrivals = [] if arrivals is None else arrivals

    async def tokenize(request):
        body = await request.json()
        seen.append(("tokenize", body))
        text = body.get("prompt") or " ".join(m["content"] for m in body["messages"])
        return web.json_response({"tokens": [int(w[1:]) for w in text.split()], "count": 0})

    async def generate(request):
        body = await request.json()
        seen.append((request.path, body))
        arrivals.append((request.path, body.get("stream", False), time.monotonic()))
        prompt = body.get("prompt") or [0]
        if body.get("max_tokens", 16) > 100:
            return web.json_response({"error": {"message": "too many", "code": 400}}, status=400)
        if prompt[:1] == [777]:
            await asyncio.sleep(4)
        n = body.get("max_tokens", 16)
        if not body.get("stream"):
            return web.json_response(
                {
                    "object": "text_completion",
                    "choices": [{"index": 0, "text": " ".join(f"w{i}" for i in range(n))}],
                    "echo": body,
                }
            )
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(n):
            await out.write(f"data: {json.dumps({'choices': [{'text': f' w{i}'}]})}\n\n".encode())
            if prompt[:1] == [666]:
                request.transport.close()
                return out
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    return app, seen


class FakeBackend:
    """Two engines (``P`` prefill, ``D`` decode) at ``url``; ``overloaded`` set: Schedule rejects.
    ``indexed`` records the keys it is asked about and, while ``index_lag`` > 0, counts one
    call down and answers that the last key is not indexed yet."""

    def __init__(self, url: str, block_size: int = 4):
        self.records = [
            EngineRecord("P", url, "prefill", {"prefill": "P"}, "ns/layer1", block_size, "sha256", None, "tiny", True),
            EngineRecord("D", url, "decode", {"decode": "D"}, "ns/layer1", block_size, "sha256", None, "tiny", True),
        ]
        self.overloaded: str | None = None
        self.scheduled: list = []
        self.reports: list = []
        self.deregistered: list = []
        self.index_queries: list = []
        self.index_lag = 0
        self.decode_final = False  # what Schedule says of its decode engine
        self.report_delay = 0.0  # seconds a prefill_finished report takes
        self.report_times: list = []  # (stage, monotonic time its report returned)
        self.engine_reads = 0
        self.engines_gate = threading.Event()
        self.engines_gate.set()

    def engines(self):
        self.engine_reads += 1
        self.engines_gate.wait(30)  # a test may hold the pool's answer back
        return self.records

    def schedule(self, keys, input_length, output_length, request_id, namespace):
        if self.overloaded:
            raise Overloaded("ttft_slo: estimated TTFT 9s > SLO 1s", self.overloaded)
        self.scheduled.append((keys, input_length, output_length, namespace))
        return EngineAssignment(
            request_id, "P", "node-1", "D", len(keys), len(keys) * 4, "", 0, 0.1, 0.01, self.decode_final
        )

    def report(self, namespace, request_id, stage):
        if stage == "prefill_finished":
            time.sleep(self.report_delay)
        self.reports.append(stage)
        self.report_times.append((stage, time.monotonic()))
        return pb.RequestEventReply(decode_engine="D" if stage == "prefill_finished" else "")

    def indexed(self, keys):
        self.index_queries.append(list(keys))
        if self.index_lag > 0:
            self.index_lag -= 1
            return len(keys) - 1
        return len(keys)

    def deregister(self, namespace, conductor_id):
        self.deregistered.append((namespace, conductor_id))
        return True
