"""A real vLLM engine in a process of its own, driven over stdin/stdout, for tests and benchmarks.

``python -m bench.vllm_engine --model DIR [--master HOST:PORT] ...`` starts one engine
(``LLM``, tokenizer skipped, eager mode), prints ``{"ready": true, ...}``, then answers each
JSON line it reads::

    {"prompts": [[1, 2, ...], ...], "max_tokens": 8, "logprobs": 2}

with one JSON line: per prompt the output token ids, the top logprobs of each output token,
``num_cached_tokens`` (vLLM's count of prompt tokens it did not compute: its own prefix
cache plus what the connector loaded) and the seconds ``generate`` took for the batch. It
exits at end of input. ``make_llama`` writes a small random Llama for it to load (no hub),
``make_deepseek`` a small random DeepSeek-V2 (MLA attention).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def make_llama(
    path: str,
    *,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab: int = 1000,
    max_positions: int = 8192,
    seed: int = 0,
    init_scale: float = 0.1,
) -> str:
    """Save a randomly initialised Llama of this shape at ``path`` (safetensors, fp32).

    ``init_scale`` (the weights' standard deviation) is well above a trained model's 0.02 so
    that attention is peaked and the next token depends on the context: wrong KV shows."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        initializer_range=init_scale,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def make_deepseek(
    path: str,
    *,
    hidden: int = 256,
    layers: int = 3,
    heads: int = 4,
    vocab: int = 1000,
    seed: int = 0,
    init_scale: float = 0.05,
) -> str:
    """Save a randomly initialised DeepSeek-V2 at ``path`` (safetensors, fp32): MLA attention
    with DeepSeek's shapes (KV LoRA rank 512 and rope dimensions 64: 576 values a token; heads
    of 128 + 64 for q and k, 128 for v), dense MLPs. ``init_scale``: at ``make_llama``'s 0.1,
    vLLM's CPU MLA kernels for one token (absorbed) and for a prompt (decompressed) disagree
    on the next token of such a model; at 0.02 it repeats one token whatever the context."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=layers,  # every layer dense: no expert routing to run
        max_position_embeddings=4096,
        initializer_range=init_scale,
        rope_scaling=None,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    DeepseekV2ForCausalLM(config).save_pretrained(path)
    return path


def make_tokenizer(path: str, vocab: int = 1000) -> str:
    """Save a word-level tokenizer for ``make_llama``'s model at ``path``, so that an OpenAI server
    (``vllm serve``) can take text and chat prompts: token ``i`` is the word ``w<i>`` (ids 0-2:
    ``<unk>``, ``<s>``, ``</s>``), words split on white space, unknown words are ``<unk>``;
    the chat template writes ``role: content`` lines and ``assistant:``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(path)
    return path


def connector_config(master: str, *, role: str = "kv_both", **extra) -> dict:
    """The ``kv_transfer_config`` that attaches kvstore's connector to a pool at ``master``."""
    return {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore_client.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"master": master, **extra},
    }


def build_engine(args: argparse.Namespace):
    from vllm import LLM

    kv_transfer_config = json.loads(args.kv_transfer_config) if args.kv_transfer_config else None
    if args.master:
        kv_transfer_config = connector_config(args.master, role=args.role, **json.loads(args.extra or "{}"))
    return LLM(
        model=args.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        gpu_memory_utilization=0.1,
        kv_cache_memory_bytes=args.kv_cache_bytes,
        block_size=args.block_size,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        prefix_caching_hash_algo=args.hash_algo,
        kv_transfer_config=kv_transfer_config,
        tensor_parallel_size=args.tensor_parallel_size,
        seed=0,
        **({"attention_config": {"backend": args.attention_backend}} if args.attention_backend else {}),
    )


def answer(llm, job: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        max_tokens=job.get("max_tokens", 8), temperature=0, logprobs=job.get("logprobs", 1), ignore_eos=True
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "connector": connector_stats(),
        "outputs": [
            {
                "tokens": list(o.outputs[0].token_ids),
                "cached": o.num_cached_tokens,
                "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in (o.outputs[0].logprobs or [])],
            }
            for o in outputs
        ],
    }


def connector_stats() -> dict | None:
    """What kvstore's connector in this process moved so far (the engine runs in-process), or None."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    stats = getattr(get_kv_transfer_group(), "transfer_stats", lambda: None)()
    return None if stats is None else dict(vars(stats))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    parser.add_argument("--master", help="attach kvstore's connector to the pool at this master")
    parser.add_argument("--role", default="kv_both")
    parser.add_argument("--extra", help="more kv_connector_extra_config keys, as JSON")
    parser.add_argument("--kv-transfer-config", help="a whole kv_transfer_config as JSON (another connector)")
    parser.add_argument("--kv-cache-bytes", type=int, default=None, help="KV cache size (default: vLLM's choice)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--hash-algo", default="sha256", help="vLLM's --prefix-caching-hash-algo")
    parser.add_argument("--no-prefix-caching", action="store_true", help="turn vLLM's own prefix cache off")
    parser.add_argument("--attention-backend", help="vLLM's attention backend (e.g. CPU_MLA); default: its choice")
    args = parser.parse_args(argv)
    out = os.fdopen(os.dup(1), "w")  # answers only: vLLM's own output goes to stderr
    os.dup2(2, 1)
    start = time.perf_counter()
    llm = build_engine(args)
    cache = llm.llm_engine.vllm_config.cache_config  # what vLLM settled on (a backend may override)
    ready = {"ready": True, "pid": os.getpid(), "start_seconds": time.perf_counter() - start}
    ready.update(block_size=cache.block_size, prefix_caching=bool(cache.enable_prefix_caching))
    out.write(json.dumps(ready) + "\n")
    out.flush()
    for line in sys.stdin:
        if line.strip():
            out.write(json.dumps(answer(llm, json.loads(line))) + "\n")
            out.flush()


class EngineProcess:
    """The parent's handle on one engine process: ``ask(job)`` sends a job and returns the answer.

    The engine's own output goes to ``log_path``; ``close`` ends it (stdin closed, then killed
    if it lingers). ``python`` runs it under another environment's interpreter (another
    connector's, e.g. ``bench.peers``): this module needs only vLLM there, not kvstore."""

    def __init__(
        self,
        args: list[str],
        log_path: str,
        *,
        env: dict | None = None,
        start_timeout: float = 300,
        python: str | None = None,
    ):
        import subprocess

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ if env is None else env)
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [python or sys.executable, "-m", "bench.vllm_engine", *args],
            cwd=root,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self.ready = self._read(start_timeout)

    def _read(self, timeout: float) -> dict:
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            with open(self.log_path) as f:
                tail = f.read()[-4000:]
            code = self.proc.poll()
            said = f"exited with {code}" if code is not None else f"gave no answer within {timeout:.0f} s"
            raise RuntimeError(f"engine {said}:\n{tail}")
        return json.loads(line)

    def ask(self, job: dict, timeout: float = 300) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def close(self) -> None:
        import subprocess

        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self._log.close()

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    main()
