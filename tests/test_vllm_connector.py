"""KVStoreConnector with real vLLM engines (CPU build), each in a process of its own, against a
real pool: a fresh engine loads what another stored and answers exactly as a plain engine."""

from __future__ import annotations

import os
import random
import threading

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from bench.vllm_engine import EngineProcess, make_deepseek, make_llama  # noqa: E402
from kvstore_client import Client  # noqa: E402
from kvstore_client.slices import encode, parse_header  # noqa: E402
from kvstore_client.vllm_hashing import prompt_tail  # noqa: E402
from tests.processes import start_master, start_node  # noqa: E402

_rng = random.Random(1)
PROMPTS = [[_rng.randrange(1, 1000) for _ in range(n)] for n in (450, 610, 512)]  # 512: full blocks only
JOB = {"prompts": PROMPTS, "max_tokens": 8, "logprobs": 3}
LOGPROB_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_llama(
        str(tmp_path_factory.mktemp("llama")), hidden=128, layers=2, heads=4, kv_heads=2, max_positions=4096
    )


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    master = start_master(ttl=60.0)
    node = start_node(master.record["master"], tmp_path_factory.mktemp("node"), dram="128MiB", ssd="0")
    yield {"master": master, "node": node, "address": master.record["master"]}
    node.close()
    master.close()


class Engines:
    """Starts engine processes for one test and ends every one of them after it."""

    def __init__(self, model: str, log_dir):
        self.model, self.log_dir, self.started = model, log_dir, []

    def start(
        self,
        *,
        dtype: str = "float32",
        block_size: int = 32,
        master: str | None = None,
        namespace: str | None = None,
        role: str = "kv_both",
        env: dict | None = None,
        extra_args: tuple = (),
        model: str | None = None,
    ) -> EngineProcess:
        args = ["--model", model or self.model, "--dtype", dtype, "--block-size", str(block_size), *extra_args]
        if master:
            args += ["--master", master, "--role", role]
            if namespace:
                args += ["--extra", f'{{"namespace": "{namespace}"}}']
        engine = EngineProcess(args, str(self.log_dir / f"engine{len(self.started)}.log"), env=env)
        self.started.append(engine)
        return engine

    def close(self) -> None:
        for engine in self.started:
            engine.close()


@pytest.fixture
def engines(model, tmp_path):
    started = Engines(model, tmp_path)
    yield started
    started.close()


_references: dict[str, dict] = {}


def reference(engines: Engines, dtype: str) -> dict:
    """What a plain engine (no connector) answers to JOB, once per dtype."""
    if dtype not in _references:
        with engines.start(dtype=dtype) as plain:
            _references[dtype] = plain.ask(JOB)
    return _references[dtype]


def assert_same_answers(got: dict, want: dict, dtype: str, tolerance: float | None = None) -> None:
    for g, w in zip(got["outputs"], want["outputs"], strict=True):
        assert g["tokens"] == w["tokens"]
        for g_step, w_step in zip(g["logprobs"], w["logprobs"], strict=True):
            assert g_step.keys() == w_step.keys()
            for token, logprob in w_step.items():
                assert g_step[token] == pytest.approx(logprob, abs=tolerance or LOGPROB_TOLERANCE[dtype])


def loadable(prompt: list[int], block_size: int) -> int:
    """Tokens of a prompt that may come from the pool: its full blocks and its partial last
    block, when it has one of two tokens or more (vLLM computes at least one token)."""
    if prompt_tail(prompt, block_size) is not None:
        return len(prompt) - 1
    return min(len(prompt) // block_size * block_size, len(prompt) - 1)


def pool_blocks(prompt: list[int], block_size: int) -> int:
    """Blocks of a prompt the pool keeps: the full ones, and the partial last one if it has a tail."""
    return len(prompt) // block_size + (prompt_tail(prompt, block_size) is not None)


def locally_cached(prompt: list[int], block_size: int) -> int:
    """What vLLM's own prefix cache serves of a prompt it has seen: whole blocks, one token short."""
    return (len(prompt) - 1) // block_size * block_size


# every block size in fp32, and bf16 once (each case starts two engines: CI time is the limit).
# bf16 (what GPU engines run) in the default suite; the fp32 cases with -m slow, to keep CI short
# (the other tests of this file run fp32 engines).
@pytest.mark.parametrize(
    "dtype,block_size",
    [
        pytest.param("float32", 32, marks=pytest.mark.slow),
        pytest.param("float32", 64, marks=pytest.mark.slow),
        pytest.param("float32", 128, marks=pytest.mark.slow),
        ("bfloat16", 64),
    ],
)
def test_a_fresh_engine_loads_the_prefix_another_engine_stored(engines, pool, dtype, block_size):
    want = reference(engines, dtype)
    namespace = f"fresh-{dtype}-{block_size}"
    with engines.start(dtype=dtype, block_size=block_size, master=pool["address"], namespace=namespace) as producer:
        stored = producer.ask(JOB)
    assert [o["cached"] for o in stored["outputs"]] == [0] * len(PROMPTS)
    assert_same_answers(stored, want, dtype)  # the connector on a miss changes nothing
    with engines.start(dtype=dtype, block_size=block_size, master=pool["address"], namespace=namespace) as consumer:
        loaded = consumer.ask(JOB)
    assert [o["cached"] for o in loaded["outputs"]] == [loadable(p, block_size) for p in PROMPTS]
    assert_same_answers(loaded, want, dtype)


def test_the_default_multiprocess_engine_loads_from_the_pool(engines, pool):
    want = reference(engines, "float32")
    with engines.start(master=pool["address"], namespace="multiprocess") as producer:
        producer.ask(JOB)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    with engines.start(master=pool["address"], namespace="multiprocess", env=env) as consumer:
        loaded = consumer.ask(JOB)
    assert [o["cached"] for o in loaded["outputs"]] == [loadable(p, 32) for p in PROMPTS]
    assert_same_answers(loaded, want, "float32")


@pytest.mark.slow  # two workers on two cores: two minutes here; run with -m slow
def test_tensor_parallel_ranks_store_and_load_their_own_heads(engines, pool):
    """Two ranks (worker processes, one core each): each keeps its KV heads under keys of its
    own, and a fresh engine of the same shape loads both ranks' halves."""
    want = reference(engines, "float32")
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1")
    tp2 = ("--tensor-parallel-size", "2")
    with engines.start(master=pool["address"], namespace="tp", env=env, extra_args=tp2) as producer:
        producer.ask(JOB)
    with Client(pool["address"]) as client:
        assert len([ns for ns in client.list_keys(limit=1).namespaces if ns.startswith("tp/")]) == 2  # a rank each
    with engines.start(master=pool["address"], namespace="tp", env=env, extra_args=tp2) as consumer:
        loaded = consumer.ask(JOB)
    assert [o["cached"] for o in loaded["outputs"]] == [loadable(p, 32) for p in PROMPTS]
    assert_same_answers(loaded, want, "float32")


def both_at_once(*calls) -> list:
    """Run ``calls`` in threads of their own at the same time; their results, in order."""
    results: list = [None] * len(calls)
    threads = [
        threading.Thread(target=lambda i=i, call=call: results.__setitem__(i, call())) for i, call in enumerate(calls)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None for r in results)
    return results


@pytest.mark.slow  # run with -m slow (CI keeps to twenty minutes on two cores)
def test_two_engines_share_one_pool_at_the_same_time(engines, pool):
    want = reference(engines, "float32")
    first, second = (engines.start(master=pool["address"], namespace="shared") for _ in range(2))
    one, other = ({"prompts": [p], "max_tokens": 8, "logprobs": 3} for p in PROMPTS[:2])
    answers = both_at_once(lambda: first.ask(one), lambda: second.ask(other))
    answers += both_at_once(lambda: first.ask(other), lambda: second.ask(one))  # what the other one stored
    answers = dict(zip("abcd", answers))
    assert answers["a"]["outputs"][0]["cached"] == answers["b"]["outputs"][0]["cached"] == 0
    assert answers["c"]["outputs"][0]["cached"] == loadable(PROMPTS[1], 32)
    assert answers["d"]["outputs"][0]["cached"] == loadable(PROMPTS[0], 32)
    for name, index in (("a", 0), ("b", 1), ("c", 1), ("d", 0)):
        assert_same_answers(answers[name], {"outputs": [want["outputs"][index]]}, "float32")


def test_blocks_the_lookup_finds_but_cannot_be_loaded_are_recomputed(engines, pool):
    """The lookup finds every block, but some hold what this engine cannot load (another
    writer's values, of another shape, under the same keys): the load fails for those, vLLM
    recomputes from the first, and the answer holds."""
    want = reference(engines, "float32")
    with engines.start(master=pool["address"], namespace="lost") as producer:
        producer.ask(JOB)
    with Client(pool["address"]) as client:
        namespaces = [ns for ns in client.list_keys(limit=1).namespaces if ns.startswith("lost/")]
        assert len(namespaces) == 1
        keys = [(k.namespace, k.digest) for k in client.list_keys(namespaces[0], limit=100000).keys]
        assert len(keys) == sum(pool_blocks(p, 32) for p in PROMPTS)
        lost = keys[::3]
        for key in lost:
            client.put(key, encode([b"\x00" * 64] * 2))
    with engines.start(master=pool["address"], namespace="lost") as consumer:
        loaded = consumer.ask(JOB)
        again = consumer.ask(JOB)  # the engine goes on serving, from its own cache now
    assert_same_answers(loaded, want, "float32")
    assert_same_answers(again, want, "float32")
    with open(consumer.log_path) as log:
        assert f"kvstore: {len(lost)} blocks could not be loaded from the pool: vLLM recomputes them" in log.read()


def test_a_node_killed_between_lookup_and_load_means_recompute_not_a_hang(engines, tmp_path):
    """The master still lists the dead node's blocks (its TTL has not run out): every load
    fails, vLLM recomputes, and saves to the dead node fail without failing requests."""
    want = reference(engines, "float32")
    master = start_master(ttl=120.0)
    node = start_node(master.record["master"], tmp_path / "node", dram="64MiB", ssd="0")
    try:
        with engines.start(master=master.record["master"], namespace="killed") as producer:
            producer.ask(JOB)
        consumer = engines.start(master=master.record["master"], namespace="killed")
        node.kill()
        loaded = consumer.ask(JOB, timeout=120)
        # vLLM counts the hit the lookup promised; every block of it failed and was recomputed
        assert [o["cached"] for o in loaded["outputs"]] == [loadable(p, 32) for p in PROMPTS]
        assert_same_answers(loaded, want, "float32")
        assert_same_answers(consumer.ask(JOB, timeout=120), want, "float32")
        consumer.close()
        blocks = sum(pool_blocks(p, 32) for p in PROMPTS)
        with open(consumer.log_path) as log:
            assert f"kvstore: {blocks} blocks could not be loaded from the pool: vLLM recomputes them" in log.read()
    finally:
        node.close()
        master.close()


def test_a_paused_master_costs_lookups_their_budget_not_requests_their_timeout(engines, tmp_path):
    """The master stopped (SIGSTOP) while an engine serves: each prefix lookup gives up after
    its budget (lookup_timeout, 10 ms by default), not after the connector's ``timeout`` (10 s,
    what a lookup waited before), so requests are served as a plain engine serves them, and
    the pool is used again once the master resumes."""
    import signal
    import time

    want = reference(engines, "float32")
    master = start_master(ttl=120.0)
    node = start_node(master.record["master"], tmp_path / "node", dram="64MiB", ssd="0")
    later = [[_rng.randrange(1, 1000) for _ in range(300)] for _ in range(6)]
    try:
        with engines.start(master=master.record["master"], namespace="paused") as producer:
            producer.ask(JOB)
            producer.ask({**JOB, "prompts": later})
        consumer = engines.start(master=master.record["master"], namespace="paused")
        master.proc.send_signal(signal.SIGSTOP)
        try:
            start = time.monotonic()
            paused = consumer.ask(JOB, timeout=60)
            took = time.monotonic() - start
        finally:
            master.proc.send_signal(signal.SIGCONT)
        assert [o["cached"] for o in paused["outputs"]] == [0] * len(PROMPTS)  # computed without the pool
        # Tokens exactly a plain engine's; logprobs within 1e-3: each lookup spends its budget in the
        # scheduler's step, so the prompts may be batched otherwise than the reference's (an fp32 sum
        # in another order), as here once in a full run (1.4e-4 apart).
        assert_same_answers(paused, want, "float32", tolerance=1e-3)
        assert took < 10, f"a request waited {took:.1f} s: as long as a lookup's timeout, not its budget"
        hits = []
        for prompt in later:  # after the pause the connector asks again, within seconds
            hits.append(consumer.ask({"prompts": [prompt], "max_tokens": 1})["outputs"][0]["cached"])
            if hits[-1]:
                break
            time.sleep(1)
        assert hits[-1] == loadable(later[len(hits) - 1], 32), hits
        consumer.close()
    finally:
        node.close()
        master.close()


def test_roles_a_consumer_only_loads_and_a_producer_only_saves(engines, pool):
    want = reference(engines, "float32")
    with engines.start(master=pool["address"], namespace="roles", role="kv_consumer") as consumer:
        assert [o["cached"] for o in consumer.ask(JOB)["outputs"]] == [0] * len(PROMPTS)
    with Client(pool["address"]) as client:
        assert not [ns for ns in client.list_keys(limit=1).namespaces if ns.startswith("roles/")]
    with engines.start(master=pool["address"], namespace="roles", role="kv_producer") as producer:
        assert [o["cached"] for o in producer.ask(JOB)["outputs"]] == [0] * len(PROMPTS)
        again = producer.ask(JOB)  # vLLM's own cache hits; the pool is never read
    assert [o["cached"] for o in again["outputs"]] == [locally_cached(p, 32) for p in PROMPTS]
    with engines.start(master=pool["address"], namespace="roles", role="kv_consumer") as consumer:
        loaded = consumer.ask(JOB)
    assert [o["cached"] for o in loaded["outputs"]] == [loadable(p, 32) for p in PROMPTS]
    assert_same_answers(loaded, want, "float32")


@pytest.mark.slow  # two fresh engines; in CI the router's tests see the tail loaded (199 of 200 tokens)
def test_a_consumer_computes_only_the_last_token_of_a_prompt_another_engine_stored(engines, pool):
    """Prefill and decode apart: the producer stores each prompt's full blocks and its partial
    last block; the consumer, which never saw the prompts, loads all of it and computes one
    prompt token each, and answers as a plain engine does."""
    want = reference(engines, "float32")
    assert all(prompt_tail(p, 32) is not None for p in PROMPTS[:2])  # 450 and 610 tokens: tails of 2
    with engines.start(master=pool["address"], namespace="tails", role="kv_producer") as producer:
        producer.ask(JOB)
    with engines.start(master=pool["address"], namespace="tails", role="kv_consumer") as consumer:
        loaded = consumer.ask(JOB)
    assert [len(p) - o["cached"] for p, o in zip(PROMPTS, loaded["outputs"])] == [1, 1, 1]
    layers = 2
    assert loaded["connector"]["loaded"] == layers * sum(pool_blocks(p, 32) for p in PROMPTS)
    assert loaded["connector"]["load_failures"] == 0
    assert_same_answers(loaded, want, "float32")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> str:
    return make_deepseek(str(tmp_path_factory.mktemp("deepseek")))


# vLLM's reference MLA backend, which every x86 CPU runs (AMX CPUs pick AMX_MLA otherwise): it
# forces blocks of 16 tokens and turns vLLM's own prefix caching off, so the pool is the only cache.
MLA_ARGS = ("--attention-backend", "CPU_MLA")


def ask_one_by_one(engine: EngineProcess) -> dict:
    """JOB's prompts one request at a time: vLLM's CPU MLA kernels give a request other logits
    in a batch than alone (an engine's own prefix cache, rerunning a batch, changes its tokens
    there too), so like is compared with like."""
    answers = [engine.ask({**JOB, "prompts": [p]}) for p in PROMPTS]
    return {"outputs": [a["outputs"][0] for a in answers], "connector": answers[-1]["connector"]}


MLA_MARGIN = {"float32": 0.0, "bfloat16": 0.1}  # logprobs: a tie within this may go either way
MLA_KERNELS = 0.3  # logprob: how far vLLM's one-token and prompt MLA kernels differ on this model


def assert_same_mla_answers(got: dict, want: dict, dtype: str) -> None:
    """The same tokens, and logprobs close after the first. A loaded prompt's last token is
    computed by vLLM's one-token MLA kernel (absorbed), a plain engine's by its prompt kernel
    (decompressed), which differ by up to ``MLA_KERNELS`` in logprob on this random model; what
    follows runs the same kernel over the same KV. So where the tokens part, the plain engine's
    two best must be closer than those differences (the first step) or than the dtype's
    rounding (``MLA_MARGIN``, later steps): there either may win, and the rest is not compared."""
    compared = 0
    for g, w in zip(got["outputs"], want["outputs"], strict=True):
        for step, (g_token, w_token, w_step) in enumerate(zip(g["tokens"], w["tokens"], w["logprobs"], strict=True)):
            best = sorted(w_step.values(), reverse=True)
            close = len(best) > 1 and best[0] - best[1] <= (MLA_KERNELS if step == 0 else MLA_MARGIN[dtype])
            if g_token != w_token and close:
                break  # a near tie went the other way: what follows is another text
            assert g_token == w_token, f"step {step}: {g['tokens']} != {w['tokens']}"
            compared += 1
            if step:  # the top tokens both list (the third may differ on a near tie)
                for token, logprob in w_step.items():
                    if token in g["logprobs"][step]:
                        tolerance = 5e-2 if MLA_MARGIN[dtype] else 2e-2
                        assert g["logprobs"][step][token] == pytest.approx(logprob, abs=tolerance)
    assert compared >= len(want["outputs"]) * 2, "too few clear-cut steps to compare"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_mla_model_is_stored_once_and_a_fresh_engine_loads_it(engines, pool, deepseek, dtype):
    """A tiny random DeepSeek-V2 (one latent vector of 576 a token): the producer stores one
    value per block, under a namespace of no tensor-parallel rank; a fresh engine loads every
    full block and the tail, and answers as a plain engine does; one that loads wrong KV of
    the right shape does not (the comparison can fail)."""
    namespace = f"mla-{dtype}"
    start = dict(dtype=dtype, block_size=16, model=deepseek, extra_args=MLA_ARGS)
    with engines.start(**start) as plain:
        want = ask_one_by_one(plain)
        assert plain.ready["block_size"] == 16 and not plain.ready["prefix_caching"]
    with engines.start(master=pool["address"], namespace=namespace, **start) as producer:
        assert_same_answers(ask_one_by_one(producer), want, dtype)  # on a miss the connector changes nothing
    with Client(pool["address"]) as client:
        [ns] = [ns for ns in client.list_keys(limit=1).namespaces if ns.startswith(f"{namespace}/")]
        keys = [(k.namespace, k.digest) for k in client.list_keys(ns, limit=100000).keys]
        assert len(keys) == sum(pool_blocks(p, 16) for p in PROMPTS)
        stored = [client.get(key) for key in keys]
    with engines.start(master=pool["address"], namespace=namespace, **start) as consumer:
        loaded = ask_one_by_one(consumer)
    assert [o["cached"] for o in loaded["outputs"]] == [loadable(p, 16) for p in PROMPTS]
    assert loaded["connector"]["load_failures"] == 0
    assert_same_mla_answers(loaded, want, dtype)
    with Client(pool["address"]) as client:  # the same keys, the right shape, the wrong KV
        for key, value in zip(keys, stored):
            table = parse_header(value)
            client.put(key, encode([bytes(n) for n in table.lengths]))
    with engines.start(master=pool["address"], namespace=namespace, **start) as fooled:
        wrong = ask_one_by_one(fooled)
    assert [o["cached"] for o in wrong["outputs"]] == [loadable(p, 16) for p in PROMPTS]
    assert all(w["tokens"] != g["tokens"] for w, g in zip(want["outputs"], wrong["outputs"]))


@pytest.mark.slow  # two workers on two cores; run with -m slow
def test_mla_ranks_load_what_one_rank_stored(engines, pool, deepseek):
    """Tensor parallelism 2 on an MLA model: rank 0 alone stores each block (the ranks hold the
    same latent KV), under one namespace, and both ranks of a fresh engine load it."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1")
    start = dict(block_size=16, model=deepseek, namespace="mla-tp", master=pool["address"])
    tp2 = (*MLA_ARGS, "--tensor-parallel-size", "2")
    with engines.start(model=deepseek, block_size=16, env=env, extra_args=tp2) as plain_engine:
        want = ask_one_by_one(plain_engine)
    with engines.start(**start, env=env, extra_args=tp2) as producer:
        ask_one_by_one(producer)
    with Client(pool["address"]) as client:
        assert len([ns for ns in client.list_keys(limit=1).namespaces if ns.startswith("mla-tp/")]) == 1
    with engines.start(**start, env=env, extra_args=tp2) as consumer:
        loaded = ask_one_by_one(consumer)
    assert [o["cached"] for o in loaded["outputs"]] == [loadable(p, 16) for p in PROMPTS]
    assert_same_mla_answers(loaded, want, "float32")


def test_an_unseeded_xxhash_engine_refuses_to_start_with_a_clear_message(engines, pool):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    with pytest.raises(RuntimeError, match="PYTHONHASHSEED"):
        engines.start(master=pool["address"], env=env, extra_args=("--hash-algo", "xxhash"))


# -- what the connector refuses at start ----------------------------------------------------------
def configs(*, mla=False, pp=1, dcp=1, algo="sha256", specs=None):
    """The parts of vLLM's configs that ``check_supported`` reads, with real KV cache specs."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(use_mla=mla),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp, decode_context_parallel_size=dcp),
        cache_config=SimpleNamespace(prefix_caching_hash_algo=algo),
    )
    groups = [SimpleNamespace(kv_cache_spec=s, layer_names=["a"]) for s in (specs or [full])]
    return vllm_config, SimpleNamespace(kv_cache_groups=groups)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"specs": "sparse MLA"}, "model_version"),
        ({"pp": 2}, "pipeline parallelism"),
        ({"dcp": 2}, "decode context parallelism"),
        ({"algo": "xxhash_cbor"}, "PYTHONHASHSEED"),
        ({"specs": "two groups"}, "all full attention"),
        ({"specs": "sliding window"}, "all full attention"),
    ],
)
def test_what_the_connector_does_not_support_fails_at_start(monkeypatch, change, message):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kvstore_client.errors import ConfigError
    from kvstore_client.vllm.connector import check_supported

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    if change.get("specs") == "two groups":
        change = {"specs": [full, full]}
    elif change.get("specs") == "sparse MLA":
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        sparse = MLAAttentionSpec(
            block_size=256, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, model_version="deepseek_v4"
        )
        change = {"specs": [sparse]}
    elif change.get("specs") == "sliding window":
        change = {
            "specs": [
                SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=128)
            ]
        }
    vllm_config, kv_cache_config = configs(**change)
    with pytest.raises(ConfigError, match=message):
        check_supported(vllm_config, kv_cache_config)
    vllm_config, kv_cache_config = configs()
    assert check_supported(vllm_config, kv_cache_config) is kv_cache_config.kv_cache_groups[0].kv_cache_spec


def test_an_mla_cache_of_one_latent_vector_per_token_is_accepted():
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from kvstore_client.vllm.connector import check_supported

    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)
    vllm_config, kv_cache_config = configs(specs=[mla])
    assert check_supported(vllm_config, kv_cache_config) is mla


def test_xxhash_with_a_shared_seed_is_accepted(monkeypatch):
    from kvstore_client.vllm.connector import check_supported

    monkeypatch.setenv("PYTHONHASHSEED", "7")
    vllm_config, kv_cache_config = configs(algo="xxhash")
    check_supported(vllm_config, kv_cache_config)


def test_layers_are_ordered_as_the_model_runs_them():
    from kvstore_client.vllm.connector import layer_order

    names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 0, 1)]
    assert layer_order(names) == [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2, 10)]


def scheduler_side(partial_blocks: bool = True, held: int = 0):
    """A scheduler-side connector without an engine: a pool that holds the first ``held`` keys
    of any chain it is asked about, and records the chains."""
    from types import SimpleNamespace

    from kvstore_client.vllm.connector import KVStoreConnector
    from kvstore_client.vllm.lookup import PrefixLookup
    from kvstore_client.vllm.naming import KVLayout, PoolNaming
    from kvstore_client.vllm.plans import RequestPlans
    from kvstore_client.vllm.settings import read_settings

    asked: list = []

    def match_prefix(keys, timeout=None):
        asked.append([digest for _, digest in keys])
        return SimpleNamespace(longest=min(held, len(keys)))

    connector = object.__new__(KVStoreConnector)
    connector._settings = read_settings({"master": "h:1", "partial_blocks": partial_blocks}, "kv_both")
    connector._spec = SimpleNamespace(block_size=4)
    connector._plans = RequestPlans(4, load=True, save=True, save_decode=False)
    connector._naming = PoolNaming("vllm", KVLayout("m", "", "torch.float32/auto", 4, 2, 64, 2, 1, "cpu", "sha256"))
    connector._client = SimpleNamespace(match_prefix=match_prefix)
    connector._announcement = None
    connector._hash_algo = "sha256"
    connector._lookup = PrefixLookup(lambda keys, budget: match_prefix(keys).longest, 1.0)
    return connector, asked


def request(tokens: list[int], **fields):
    from types import SimpleNamespace

    from kvstore_client.vllm_hashing import VLLMBlockHasher

    values = {"mm_features": [], "prompt_embeds": None, "prompt_token_ids": tokens, **fields}
    return SimpleNamespace(
        request_id="r", num_prompt_tokens=len(tokens), block_hashes=VLLMBlockHasher(4).hashes(tokens), **values
    )


def test_the_lookup_asks_for_the_full_blocks_then_the_tail():
    from kvstore_client.vllm_hashing import tail_hash

    tokens = list(range(1, 12))  # two full blocks of 4, then a tail of 3
    req = request(tokens)
    for held, external in ((3, 10), (2, 8), (0, 0)):  # the tail too: all but the last token
        connector, asked = scheduler_side(held=held)
        assert connector.get_num_new_matched_tokens(req, 0) == (external, False)
        assert asked == [req.block_hashes + [tail_hash(req.block_hashes[-1], tokens[8:])]]


@pytest.mark.parametrize(
    "partial_blocks,tokens,fields",
    [
        (False, list(range(1, 12)), {}),  # the setting off
        (True, list(range(1, 10)), {}),  # a tail of one token
        (True, list(range(1, 4)), {}),  # no full block
        (True, list(range(1, 12)), {"mm_features": ["an image"]}),
        (True, list(range(1, 12)), {"prompt_embeds": "a tensor"}),
    ],
)
def test_prompts_without_a_tail_key_look_up_their_full_blocks_only(partial_blocks, tokens, fields):
    connector, asked = scheduler_side(partial_blocks, held=3)
    req = request(tokens, **fields)
    external, _ = connector.get_num_new_matched_tokens(req, 0)
    assert asked == ([req.block_hashes] if req.block_hashes else [])
    assert external == min(len(req.block_hashes) * 4, len(tokens) - 1)
