"""Cost model of the conductor: prefill time, KV transfer time, decode step time.

Every number is a field of :class:`CostParams`; the defaults describe
LLaMA3-70B served on 8xA800 nodes as in FAST'25 §3-4 (docs/scheduling.md, "The cost model"):

- prefill FLOPs of ``n`` tokens: ``flops(n) = l*(a*n^2*d + b*n*d^2)`` with
  l=80, d=8192, a=4, b=22; a prefill instance is one node, peak
  G = 8 x 312 TFLOP/s; prefill of ``n`` tokens with ``p`` cached takes
  ``(flops(n) - flops(p)) / (G * mfu) + prefill_overhead_s``.
  ``mfu`` = 0.35 by default: TP8 prefill of long contexts on A800 loses time to
  all-reduces and attention kernels; 0.3-0.5 is the usual measured range.
- KV bytes per token: 2 (K,V) x 80 layers x 8 KV heads x 128 x 2 bytes =
  320 KiB, so one 512-token block is 160 MiB.
- transfer of fetched prefix blocks between nodes: ``bytes / bandwidth +
  latency``; 25 GB/s by default (one 200 Gbps RDMA NIC's worth; a Mooncake
  node has 4-8 such NICs, so this is conservative). Reuse beats recompute
  when ``B/G > 2ds / (gqa*(a*p*d + b*d^2))`` (gqa=8, s=2): about 7 GB/s at
  full MFU, far below any RDMA fabric.
- decode (memory-bound): one step of a batch holding ``c`` context tokens
  reads the weights once and every KV byte once:
  ``tbt(c) = decode_overhead_s + (weight_bytes + c * kv_bytes) / (hbm_bw * hbm_eff)``
  with weights 141 GB (70.6B params, fp16), HBM 8 x 2.039 TB/s at 60%
  efficiency; 19 ms at an empty batch, +34 ns per context token. A decode
  instance holds at most ``decode_kv_tokens`` context tokens (HBM left for KV:
  8 x 80 GB x 0.9 - 141 GB = 435 GB = 1.33M tokens).

:class:`PolynomialPrefill` replaces the FLOPs formula with a least-squares fit
(numpy) of measured ``(input_len, cached_len, seconds)`` samples on the
features ``1, n, p, n^2, n*p, p^2``: what the paper does with offline
profiling. Pure functions of immutable data: thread-safe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterable, Sequence

from kvstore_client.errors import ConfigError

if TYPE_CHECKING:  # numpy is imported where it is used: a master that never schedules never loads it
    import numpy as np


@dataclass(frozen=True)
class CostParams:
    """Every parameter of the cost model (SI units: tokens, bytes, seconds, FLOP/s)."""

    layers: int = 80  # l
    hidden: int = 8192  # d
    attn_coeff: float = 4.0  # a: attention FLOPs ~ a*n^2*d per layer
    linear_coeff: float = 22.0  # b: linear-layer FLOPs ~ b*n*d^2 per layer
    gqa: int = 8  # query heads per KV head
    dtype_bytes: int = 2  # s
    kv_bytes_per_token: int = 327_680  # 320 KiB
    block_tokens: int = 512
    peak_flops: float = 8 * 312e12  # G: one prefill instance = 8 x A800
    mfu: float = 0.35
    prefill_overhead_s: float = 0.0
    transfer_bandwidth: float = 25e9  # bytes/s for fetched prefix blocks
    transfer_latency_s: float = 0.001
    weight_bytes: float = 141e9
    hbm_bandwidth: float = 8 * 2.039e12
    hbm_efficiency: float = 0.6
    decode_overhead_s: float = 0.005
    decode_kv_tokens: int = 1_330_000

    def __post_init__(self) -> None:
        positive = (
            "layers",
            "hidden",
            "block_tokens",
            "peak_flops",
            "mfu",
            "transfer_bandwidth",
            "kv_bytes_per_token",
            "hbm_bandwidth",
            "hbm_efficiency",
            "decode_kv_tokens",
            "gqa",
            "dtype_bytes",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(f"cost model: {name} must be positive, got {getattr(self, name)}")
        if self.mfu > 1 or self.hbm_efficiency > 1:
            raise ConfigError("cost model: mfu and hbm_efficiency are fractions in (0, 1]")
        for name in ("prefill_overhead_s", "transfer_latency_s", "decode_overhead_s", "weight_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"cost model: {name} cannot be negative")

    def with_(self, **changes) -> "CostParams":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


class PolynomialPrefill:
    """Prefill seconds as a degree-2 polynomial in (input_len n, cached_len p).

    ``t = c0 + c1*n + c2*p + c3*n^2 + c4*n*p + c5*p^2``, coefficients from
    :meth:`fit`. Immutable.
    """

    FEATURES = ("1", "n", "p", "n^2", "n*p", "p^2")

    def __init__(self, coefficients: Sequence[float]) -> None:
        if len(coefficients) != len(self.FEATURES):
            raise ConfigError(f"a prefill polynomial has {len(self.FEATURES)} coefficients")
        self.coefficients = tuple(float(c) for c in coefficients)

    @staticmethod
    def _features(n: np.ndarray, p: np.ndarray) -> np.ndarray:
        import numpy as np

        return np.stack([np.ones_like(n), n, p, n * n, n * p, p * p], axis=1)

    @classmethod
    def fit(cls, samples: Iterable[tuple[float, float, float]]) -> "PolynomialPrefill":
        """Least-squares fit of ``(input_len, cached_len, seconds)`` samples.

        Lengths are scaled to thousands of tokens before solving so the
        normal equations are well conditioned. Needs at least 6 samples with
        distinct (n, p) spread; raises ConfigError otherwise.
        """
        import numpy as np

        data = np.asarray(list(samples), dtype=float)
        if data.ndim != 2 or data.shape[1] != 3 or len(data) < len(cls.FEATURES):
            raise ConfigError("fit needs at least 6 (input_len, cached_len, seconds) samples")
        k = 1e-3
        x = cls._features(data[:, 0] * k, data[:, 1] * k)
        coef, _res, rank, _sv = np.linalg.lstsq(x, data[:, 2], rcond=None)
        if rank < len(cls.FEATURES):
            raise ConfigError("fit: samples do not determine every coefficient (vary n and p more)")
        scale = np.array([1, k, k, k * k, k * k, k * k])
        return cls(coef * scale)

    def __call__(self, n: float, p: float) -> float:
        c0, c1, c2, c3, c4, c5 = self.coefficients
        return max(0.0, c0 + c1 * n + c2 * p + c3 * n * n + c4 * n * p + c5 * p * p)


class CostModel:
    """Times the conductor estimates with: prefill, prefix transfer, decode step.

    Uses the FLOPs formula unless built with a fitted ``prefill`` polynomial.
    Immutable after construction; thread-safe.
    """

    def __init__(self, params: CostParams | None = None, prefill: PolynomialPrefill | None = None) -> None:
        self.params = p = params or CostParams()
        self.fitted_prefill = prefill
        self.block_bytes = p.block_tokens * p.kv_bytes_per_token
        self._effective_flops = p.peak_flops * p.mfu
        self._hbm = p.hbm_bandwidth * p.hbm_efficiency
        self._step_base = p.decode_overhead_s + p.weight_bytes / self._hbm
        self._step_per_token = p.kv_bytes_per_token / self._hbm

    # -- prefill ---------------------------------------------------------------------------
    def flops(self, n: float) -> float:
        """Prefill FLOPs of ``n`` tokens: l*(a*n^2*d + b*n*d^2)."""
        p = self.params
        return p.layers * (p.attn_coeff * n * n * p.hidden + p.linear_coeff * n * p.hidden * p.hidden)

    def prefill_time(self, input_len: int, cached_len: int = 0) -> float:
        """Seconds to prefill ``input_len`` tokens when the first ``cached_len`` are reused.

        At least one token is always computed (the one that yields the first
        output token), so ``cached_len`` is capped at ``input_len - 1``.
        """
        n = max(int(input_len), 1)
        p = min(max(int(cached_len), 0), n - 1)
        if self.fitted_prefill is not None:
            return self.fitted_prefill(n, p)
        return (self.flops(n) - self.flops(p)) / self._effective_flops + self.params.prefill_overhead_s

    def cached_tokens(self, input_len: int, prefix_blocks: int) -> int:
        """Tokens of a ``prefix_blocks``-block prefix, within the input."""
        return min(prefix_blocks * self.params.block_tokens, max(int(input_len), 0))

    # -- transfer ---------------------------------------------------------------------------
    def transfer_time(self, blocks: int) -> float:
        """Seconds to fetch ``blocks`` prefix blocks from another node (0 for none)."""
        if blocks <= 0:
            return 0.0
        return self.params.transfer_latency_s + blocks * self.block_bytes / self.params.transfer_bandwidth

    def reuse_beats_recompute(self, prefix_tokens: int) -> bool:
        """FAST'25's condition B/G > 2ds / (gqa*(a*p*d + b*d^2)), with G at the configured MFU."""
        p = self.params
        rhs = (
            2
            * p.hidden
            * p.dtype_bytes
            / (p.gqa * (p.attn_coeff * prefix_tokens * p.hidden + p.linear_coeff * p.hidden * p.hidden))
        )
        return p.transfer_bandwidth / self._effective_flops > rhs

    # -- decode -----------------------------------------------------------------------------
    def tbt(self, context_tokens: float) -> float:
        """Seconds per decode step for a batch holding ``context_tokens`` in total."""
        return self._step_base + max(context_tokens, 0) * self._step_per_token

    def decode_token_limit(self, tbt_slo: float) -> int:
        """Most context tokens one decode instance holds within ``tbt_slo`` and its HBM."""
        cap = self.params.decode_kv_tokens
        if math.isinf(tbt_slo):
            return cap
        by_slo = (tbt_slo - self._step_base) / self._step_per_token
        return int(max(0, min(cap, by_slo)))
