"""`kvstore router` with real vLLM OpenAI servers (CPU build): one pool, one prefill and one decode
engine, both with the connector and a role, and the router, shared by every test of the module
(two engine starts in all, in parallel). The engine-free HTTP layer: tests/test_router_http.py.

The reference for "the same answer" is the prefill engine itself, asked directly with a prompt
nobody has seen (a miss everywhere: computed from scratch, the connector only stores); the
router's answer to that prompt then comes from the decode engine, which has never seen it
and loads its KV from the pool. No third engine is started: the connector on a miss changes
nothing (tests/test_vllm_connector.py shows it against a plain engine)."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from bench.serve_client import prompt_counters  # noqa: E402
from bench.vllm_engine import make_llama, make_tokenizer  # noqa: E402
from tests.processes import ROOT, Service, start_master, start_node, wait_for  # noqa: E402

BLOCK = 32
TTFT_SLO = 0.25  # the conductor's estimate for a 3,000-token prompt is ~0.43 s, for 300 tokens ~0.04 s
_rng = random.Random(7)


def prompt(n: int) -> list[int]:
    return [_rng.randrange(3, 1000) for _ in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`vllm serve` (vLLM's OpenAI server) in a process group of its own."""

    def __init__(self, model: str, master: str, role: str, log_path, **extra):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore_client.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "master": master,
                "role": role,
                "engine_url": self.url,
                "load_report_interval": 0.2,
                **extra,
            },
        }
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self._log = open(log_path, "w")
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                model,
                "--served-model-name",
                "tiny",
                "--dtype",
                "float32",
                "--block-size",
                str(BLOCK),
                "--enforce-eager",
                "--port",
                str(self.port),
                "--host",
                "127.0.0.1",
                "--max-model-len",
                "4096",
                "--kv-cache-memory-bytes",
                str(64 << 20),
                "--enable-prompt-tokens-details",
                "--kv-transfer-config",
                json.dumps(config),
            ],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        self.kill()
        raise RuntimeError(f"engine at {self.url} did not start:\n{open(self.log_path).read()[-4000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    model = make_tokenizer(make_llama(str(tmp_path_factory.mktemp("llama")), max_positions=4096))
    config = logs / "master.toml"
    config.write_text(f"[master]\nttft-slo = {TTFT_SLO}\n\n[cost_model]\nblock_tokens = {BLOCK}\n")
    master = start_master(ttl=60.0, extra=("--config", str(config)))
    address = master.record["master"]
    node = start_node(address, tmp_path_factory.mktemp("node"), dram="256MiB", ssd="0")
    engines = {
        "prefill": Server(model, address, "prefill", logs / "prefill.log"),
        "decode": Server(model, address, "decode", logs / "decode.log"),
    }
    router = None
    try:
        for engine in engines.values():
            engine.wait_ready()
        router = Service(["router", "--master", address, "--port", "0", "--read-timeout", "20"])
        url = router.record["router"]
        deadline = time.monotonic() + 30
        while get(f"{url}/health")[0] != 200:  # the engines' records reach the router
            assert time.monotonic() < deadline, "the router never saw both engines"
            time.sleep(0.2)
        yield {"router": url, "master": address, **engines}
    finally:
        if router is not None:
            router.close()
        for engine in engines.values():
            engine.stop()
        node.close()
        master.close()


def get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError as exc:
        return 0, str(exc).encode()


def post(url: str, body: dict, timeout: float = 120):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def completion(url: str, body: dict) -> tuple[dict, dict]:
    status, headers, data = post(f"{url}/v1/completions", body)
    assert status == 200, data
    return json.loads(data), headers


def streamed_text(data: bytes) -> str:
    events = [e for e in data.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]", events[-3:]
    return "".join(json.loads(e[len("data: ") :])["choices"][0]["text"] for e in events[:-1])


def test_completions_through_the_router_equal_the_engines_own(cluster):
    tokens = prompt(200)
    body = {"model": "tiny", "prompt": tokens, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    want, _ = completion(cluster["prefill"].url, body)  # from scratch: nobody has seen it
    got, headers = completion(cluster["router"], body)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert headers["x-kvstore-decode-engine"] == cluster["decode"].url
    assert headers["x-kvstore-prefill-engine"] == cluster["prefill"].url
    # the decode engine never saw the prompt: its 6 full blocks and its partial last block came
    # from the pool, and it computed the last token only
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 199


def test_a_stream_through_the_router_equals_the_engines_answer(cluster):
    body = {"model": "tiny", "prompt": prompt(150), "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    want, _ = completion(cluster["prefill"].url, body)
    status, headers, data = post(f"{cluster['router']}/v1/completions", {**body, "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert streamed_text(data) == want["choices"][0]["text"]


def test_chat_through_the_router_equals_the_engines_own(cluster):
    words = " ".join(f"w{t}" for t in prompt(120))
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": words}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    status, _, data = post(f"{cluster['prefill'].url}/v1/chat/completions", body)
    assert status == 200, data
    want = json.loads(data)["choices"][0]["message"]["content"]
    status, _, data = post(f"{cluster['router']}/v1/chat/completions", body)
    assert status == 200, data
    reply = json.loads(data)
    assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"] == want
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_shared_prefix_is_found_by_the_conductor(cluster):
    shared = prompt(256)
    first, headers = completion(cluster["router"], {"model": "tiny", "prompt": shared + prompt(40), "max_tokens": 2})
    assert headers["x-kvstore-prefix-tokens"] == "0"
    second, headers = completion(cluster["router"], {"model": "tiny", "prompt": shared + prompt(70), "max_tokens": 2})
    assert int(headers["x-kvstore-prefix-tokens"]) == 256 and int(headers["x-kvstore-prefix-blocks"]) == 8
    with urllib.request.urlopen(f"{cluster['router']}/metrics") as resp:
        assert "kvstore_router_prefix_tokens_total" in resp.read().decode()


def test_overload_is_429_with_retry_after_and_no_engine_computes_the_rejected_prompt(cluster):
    engines = {name: cluster[name].url for name in ("prefill", "decode")}
    before = {name: prompt_counters(url)["prompt"] for name, url in engines.items()}
    status, headers, data = post(
        f"{cluster['router']}/v1/completions", {"model": "tiny", "prompt": prompt(3000), "max_tokens": 4}
    )
    assert status == 429, data
    assert headers["Retry-After"] == "1" and headers["x-kvstore-reject-reason"] == "ttft_slo"
    assert json.loads(data)["error"]["type"] == "overloaded"
    # Early rejection wastes no prefill: each engine is sent a 40-token request after the 429;
    # a prefill of the rejected prompt would have been counted before it (the router waits for
    # the prefill's answer), so once those 40 are counted each counter grew by them alone.
    for name, url in engines.items():
        completion(url, {"model": "tiny", "prompt": prompt(40), "max_tokens": 1})
        wait_for(lambda: prompt_counters(url)["prompt"] - before[name] >= 40)
        assert prompt_counters(url)["prompt"] - before[name] == 40, name


def test_a_decode_engine_killed_mid_stream_ends_the_stream_with_an_error(cluster):
    """Last in the module: the decode engine does not come back. A stream whose first chunk
    already ends it (a loaded machine: the engine ran ahead of its HTTP server, which then sent
    every token at once) has no middle to kill it in: the request is sent again, once or twice."""
    for _ in range(3):
        body = {
            "model": "tiny",
            "prompt": prompt(64),
            "max_tokens": 3500,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        req = urllib.request.Request(
            f"{cluster['router']}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        start = time.monotonic()
        resp = urllib.request.urlopen(req, timeout=60)
        assert resp.status == 200
        first = resp.readline()
        assert first.startswith(b"data: ")
        if b'"finish_reason":null' in first:
            break
        resp.read()
        resp.close()
    with resp:
        cluster["decode"].kill()
        rest = resp.read()
    events = [e for e in (first + rest).decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert events[-2].startswith("event: error\ndata: "), events[-3:]
    assert time.monotonic() - start < 60
