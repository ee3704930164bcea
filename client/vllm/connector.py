"""KVStoreConnector: vLLM's KV connector (v1 API) over a kvstore pool.

Enable it with::

    kv_transfer_config={"kv_connector": "KVStoreConnector",
                        "kv_connector_module_path": "kvstore_client.vllm",
                        "kv_role": "kv_both",
                        "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": {"master": "HOST:PORT"}}

(``kvstore_client.vllm.settings`` lists the extra keys.) vLLM runs one instance in its
scheduler and one in each worker:

- scheduler: for a new request, ``get_num_new_matched_tokens`` asks the master how many of
  the prompt's leading blocks the pool holds beyond vLLM's own hit (its full blocks, then its
  partial last block under a key of its own: ``partial_blocks``); ``RequestPlans`` turns
  that, the blocks vLLM allocates and the tokens each step schedules into a ``StepPlan``
  (blocks to load, newly computed blocks to save) that vLLM hands to the workers;
- worker: ``start_load_kv`` starts loading the step's blocks layer by layer and
  ``wait_for_layer_load`` waits for one layer, so loading overlaps the model;
  ``save_kv_layer`` queues a layer's new blocks as soon as its attention ends and
  ``wait_for_save`` collects the pool's answers before vLLM may free the blocks
  (``LayerwiseTransfers``). A block lost between lookup and load is reported by
  ``get_block_ids_with_load_errors`` and recomputed by vLLM, never read as wrong KV.

KV caches in host memory (vLLM's CPU backend) or in CUDA memory, in any layout
``kvstore_client.vllm.layouts`` knows; on a GPU the loads and saves run on CUDA streams of
their own (``kvstore_client.vllm.transfer``).

Keys and what one stored value is: ``kvstore_client.vllm.naming``.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from kvstore_client.errors import ConfigError
from kvstore_client.vllm.cpu_amx import permit_amx
from kvstore_client.vllm.layouts import describe, identify, layout_format, mla_format
from kvstore_client.vllm.lookup import PrefixLookup, warm_up
from kvstore_client.vllm.naming import KVLayout, PoolNaming
from kvstore_client.vllm.plans import RequestPlans, StepPlan
from kvstore_client.vllm.settings import read_settings
from kvstore_client.vllm.transfer import LayerwiseTransfers
from kvstore_client.vllm_hashing import VLLMBlockHasher, prompt_tail, tail_hash

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
# vLLM's non-cryptographic prefix hashes use a random per-process seed unless PYTHONHASHSEED is set.
UNSEEDED_HASHES = {"xxhash", "xxhash_cbor"}


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler's connector to the workers'."""

    plan: StepPlan = field(default_factory=StepPlan)


def layer_order(layer_names) -> list[str]:
    """Attention layers in model order ("model.layers.10.attn" after "model.layers.9.attn")."""
    return sorted(layer_names, key=lambda name: ([int(n) for n in re.findall(r"\d+", name)], name))


def check_supported(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> FullAttentionSpec:
    """The one full-attention KV spec the connector handles (MLA's included); ConfigError for
    anything else."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ConfigError("KVStoreConnector does not support pipeline parallelism")
    if getattr(parallel, "decode_context_parallel_size", 1) > 1:
        raise ConfigError("KVStoreConnector does not support decode context parallelism")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or type(groups[0].kv_cache_spec) not in (FullAttentionSpec, MLAAttentionSpec):
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        raise ConfigError(
            f"KVStoreConnector supports models whose layers are all full attention (MLA included), not {kinds} "
            "(hybrid, sliding-window and state-space models are not supported)"
        )
    spec = groups[0].kv_cache_spec
    if isinstance(spec, MLAAttentionSpec) and (spec.model_version or spec.alignment or spec.head_size_v):
        raise ConfigError(
            "KVStoreConnector supports MLA caches of one latent vector per token (DeepSeek-V2/V3, Kimi K2), "
            f"not model_version {spec.model_version!r} (DeepSeek-V4's sparse caches)"
        )
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    if algo in UNSEEDED_HASHES and os.environ.get("PYTHONHASHSEED") is None:
        raise ConfigError(
            f"prefix_caching_hash_algo {algo!r} hashes with a random per-process seed unless "
            "PYTHONHASHSEED is set, so no other engine could find this one's blocks: set "
            "PYTHONHASHSEED to the same value on every engine, or use sha256"
        )
    return groups[0].kv_cache_spec


def expected_format(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", spec: FullAttentionSpec):
    """The block format this engine's KV caches store, from its resolved KV cache layout (the
    CPU backend's, LBHNC, when none is recorded; the workers check their tensors against it)."""
    if isinstance(spec, MLAAttentionSpec):
        return mla_format(spec.block_size, spec.head_size, str(spec.dtype))
    name = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
        vllm_config.cache_config, "kv_cache_layout", None
    )
    return layout_format(name or "LBHNC", spec.num_kv_heads, spec.block_size, spec.head_size, str(spec.dtype))


class KVStoreConnector(KVConnectorBase_V1):
    """Loads prefix KV from, and stores new KV into, a kvstore pool, layer by layer."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer_config = vllm_config.kv_transfer_config
        self._settings = read_settings(transfer_config.kv_connector_extra_config, transfer_config.kv_role)
        spec = check_supported(vllm_config, kv_cache_config)
        if self._settings.load and transfer_config.kv_load_failure_policy != "recompute":
            log.warning(
                "kvstore: kv_load_failure_policy is %r: a block evicted between lookup and load fails "
                "its request; set it to 'recompute' to recompute such blocks instead",
                transfer_config.kv_load_failure_policy,
            )
        from vllm.platforms import current_platform

        self._spec = spec
        self._mla = isinstance(spec, MLAAttentionSpec)
        self._layer_names = layer_order(kv_cache_config.kv_cache_groups[0].layer_names)
        self._format = expected_format(vllm_config, kv_cache_config, spec)
        layout = KVLayout(
            model=vllm_config.model_config.model,
            revision=vllm_config.model_config.revision or "",
            kv_dtype=f"{spec.dtype}/{vllm_config.cache_config.cache_dtype}",
            block_size=spec.block_size,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            num_layers=len(self._layer_names),
            tp_size=vllm_config.parallel_config.tensor_parallel_size,
            device=current_platform.device_type,
            hash_algo=vllm_config.cache_config.prefix_caching_hash_algo,
            block_format="" if self._format.is_canonical() and not self._mla else self._format.name(),
            mla=self._mla,
        )
        from kvstore_client.client import Client

        self._client = Client(self._settings.master, timeout=self._settings.timeout)
        self._num_blocks = kv_cache_config.num_blocks
        self._transfers: LayerwiseTransfers | None = None  # worker side, once the KV caches exist
        if role == KVConnectorRole.SCHEDULER:
            self._naming = PoolNaming(self._settings.namespace, layout, tp_rank=0)
            self._plans = RequestPlans(
                spec.block_size,
                load=self._settings.load,
                save=self._settings.save,
                save_decode=self._settings.save_decode,
            )
            self._announcement = None
            if self._settings.role is not None:  # join the conductor (kvstore_client.vllm.engines)
                from kvstore_client.vllm.engines import EngineAnnouncement

                self._announcement = EngineAnnouncement(
                    self._client,
                    self._settings,
                    self._naming.namespace,
                    block_size=spec.block_size,
                    hash_algo=layout.hash_algo,
                    hash_seed=os.environ.get("PYTHONHASHSEED"),
                    model=vllm_config.model_config.served_model_name
                    if isinstance(vllm_config.model_config.served_model_name, str)
                    else vllm_config.model_config.model,
                )
                self._announcement.start()
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._naming = PoolNaming(self._settings.namespace, layout, tp_rank=get_tensor_model_parallel_rank())
            self._layer_index = {name: i for i, name in enumerate(self._layer_names)}
        self._hash_algo = layout.hash_algo
        self._lookup = PrefixLookup(
            lambda keys, budget: self._client.match_prefix(keys, timeout=budget).longest,
            self._settings.lookup_timeout,
        )
        if role == KVConnectorRole.SCHEDULER:
            warm_up(self._client)

    # ==== worker side ========================================================================
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        """Take the KV caches (host or CUDA memory, any layout ``layouts.py`` knows whose block
        format is the one the keys are named by); ConfigError (LayoutMismatch) otherwise."""
        layers, layouts = [], []
        spec = self._spec
        for name in self._layer_names:
            tensor = kv_caches[name]
            if tensor.device.type not in ("cpu", "cuda"):
                raise ConfigError(
                    f"KVStoreConnector moves KV caches in host or CUDA memory; layer {name} is on {tensor.device}"
                )
            family = identify(tensor.shape, self._num_blocks, spec.num_kv_heads, spec.block_size, spec.head_size)
            layouts.append(
                describe(family, tensor.shape, tensor.stride(), tensor.element_size(), str(spec.dtype), spec.head_size)
            )
            layers.append(tensor)
        if any(tensor.device.type == "cpu" for tensor in layers):
            permit_amx()  # before the first step, which may be a loaded prompt's last token (see cpu_amx)
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        save = not self._mla or get_tensor_model_parallel_rank() == 0  # MLA: every rank holds the same KV
        self._transfers = LayerwiseTransfers(
            self._client, self._naming, layers, layouts, block_format=self._format, save=save
        )

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise loads and saves run Python between layers, which a full CUDA graph skips."""
        return True

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        plan = self._plan()
        if plan is not None and self._transfers is not None:
            self._transfers.start_loads(plan.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._transfers is not None:
            self._transfers.wait_layer(self._layer_index[layer_name])

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any, **kwargs: Any) -> None:
        plan = self._plan()
        if plan is not None and plan.saves and self._transfers is not None:
            self._transfers.save_layer(self._layer_index[layer_name], plan.saves)

    def wait_for_save(self) -> None:
        if self._transfers is not None:
            self._transfers.finish_loads()
            self._transfers.finish_saves()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._transfers.take_load_failures() if self._transfers is not None else set()

    def _plan(self) -> StepPlan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, KVStoreConnectorMetadata) else None

    def transfer_stats(self):
        """Block layers loaded, saved and failed so far on this worker (None on the scheduler)."""
        return self._transfers.stats if self._transfers is not None else None

    # ==== scheduler side =====================================================================
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        full = self._plans.full_blocks(request.num_prompt_tokens)
        hashes = self._prompt_hashes(request)[:full]
        tail = self._tail(request, hashes) if len(hashes) == full else None
        chain = hashes + [tail] if tail is not None else hashes  # the pool holds the tail iff all of it hits
        # the lookup serves loading, and saving too: blocks the pool has are not sent again
        wanted = chain and (self._settings.load or self._settings.save)
        found = self._lookup(self._naming.keys(chain)) if wanted else 0
        pool_blocks = found or 0  # None: the pool could not be asked in time, so neither load nor save
        self._plans.remember_hit(request.request_id, pool_blocks, num_computed_tokens, tail, found is not None)
        if self._announcement is not None:
            self._announcement.tracker.seen(request)
        return self._plans.external_tokens(pool_blocks, num_computed_tokens, request.num_prompt_tokens), False

    def _tail(self, request: "Request", hashes: list[bytes]) -> bytes | None:
        """The key of the prompt's partial last block, or None where the pool keeps none: the
        setting is off, or the prompt has multimodal inputs or embeddings (its KV is then not
        a function of the token ids and the chain's hashes alone)."""
        if not self._settings.partial_blocks or request.mm_features or request.prompt_embeds is not None:
            return None
        if request.prompt_token_ids is None or not hashes:
            return None
        tokens = prompt_tail(request.prompt_token_ids, self._spec.block_size)
        return None if tokens is None else tail_hash(bytes(hashes[-1]), tokens)

    def _prompt_hashes(self, request: "Request") -> list:
        """vLLM's block hashes of the request (a live list that grows with its tokens); where vLLM
        computed fewer than the prompt's full blocks (an engine with prefix caching off, on some
        versions), the prompt's computed here the same way (``VLLMBlockHasher``: not for LoRA
        or multimodal requests, whose hashes fold in more than the tokens)."""
        hashes = request.block_hashes
        full = self._plans.full_blocks(request.num_prompt_tokens)
        if len(hashes) >= full or request.prompt_token_ids is None or request.mm_features or request.lora_request:
            return hashes
        hasher = VLLMBlockHasher(
            self._spec.block_size,
            algo=self._hash_algo,
            seed=os.environ.get("PYTHONHASHSEED"),
            cache_salt=request.cache_salt,
        )
        return hasher.hashes(request.prompt_token_ids)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self._plans.allocated(
            request.request_id, self._prompt_hashes(request), request.num_prompt_tokens, num_external_tokens
        )
        if self._announcement is not None:
            self._announcement.tracker.allocated(request)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        cached = scheduler_output.scheduled_cached_reqs
        new = [(r.req_id, r.block_ids[0], r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        resumed = cached.resumed_req_ids
        changed = [
            (req_id, None if ids is None else ids[0], req_id in resumed, computed)
            for req_id, ids, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens)
        ]
        speculative = {r: len(t) for r, t in scheduler_output.scheduled_spec_decode_tokens.items()}
        plan = self._plans.step(new, changed, scheduler_output.num_scheduled_tokens, speculative)
        return KVStoreConnectorMetadata(plan)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves are collected at the end of every step, so the blocks may be freed now.
        self._plans.finished(request.request_id)
        if self._announcement is not None:
            self._announcement.tracker.finished(request.request_id)
        return False, None

    def shutdown(self) -> None:
        try:
            announcement = getattr(self, "_announcement", None)  # unset when __init__ failed early
            if announcement is not None:
                announcement.close()
            if self._transfers is not None:
                self._transfers.close()
        finally:
            self._client.close()
