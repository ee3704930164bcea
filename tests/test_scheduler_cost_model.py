"""The conductor's cost model: FAST'25 FLOPs, transfer, decode step, and the polynomial fit."""

from __future__ import annotations

import random

import pytest

from kvstore.scheduler import CostModel, CostParams, PolynomialPrefill
from kvstore_client.errors import ConfigError


def test_flops_formula_matches_the_paper():
    cost = CostModel()
    n = 1000
    assert cost.flops(n) == 80 * (4 * n * n * 8192 + 22 * n * 8192 * 8192)


def test_prefill_time_is_flops_over_effective_peak():
    cost = CostModel(CostParams(mfu=0.5))
    assert cost.prefill_time(8192) == pytest.approx(cost.flops(8192) / (8 * 312e12 * 0.5))
    # a cached prefix saves exactly its FLOPs; at least one token is always computed
    assert cost.prefill_time(8192, 4096) == pytest.approx((cost.flops(8192) - cost.flops(4096)) / (8 * 312e12 * 0.5))
    assert 0 < cost.prefill_time(8192, 8192) == cost.prefill_time(8192, 8191)
    assert cost.prefill_time(8192, 99999) == cost.prefill_time(8192, 8191)


def test_every_parameter_is_configurable_and_checked():
    fast = CostModel(CostParams(mfu=1.0, peak_flops=1e18))
    assert fast.prefill_time(10_000) < CostModel().prefill_time(10_000) / 100
    with pytest.raises(ConfigError):
        CostParams(mfu=0)
    with pytest.raises(ConfigError):
        CostParams(mfu=1.5)
    with pytest.raises(ConfigError):
        CostParams(transfer_bandwidth=-1)
    assert CostParams().with_(block_tokens=256).block_tokens == 256


def test_block_and_transfer_sizes():
    cost = CostModel(CostParams(transfer_bandwidth=25e9, transfer_latency_s=0.001))
    assert cost.block_bytes == 160 * 2**20  # 512 tokens x 320 KiB
    assert cost.transfer_time(0) == 0
    assert cost.transfer_time(10) == pytest.approx(0.001 + 10 * 160 * 2**20 / 25e9)
    assert cost.cached_tokens(1000, 3) == 1000 and cost.cached_tokens(5000, 3) == 1536


def test_reuse_beats_recompute_threshold_is_a_few_gb_per_s():
    # B/G > 2ds / (gqa (a p d + b d^2)): at p = 0 and full MFU, B > ~6.9 GB/s
    g = 8 * 312e12
    threshold = g * 2 * 8192 * 2 / (8 * 22 * 8192 * 8192)
    assert CostModel(CostParams(mfu=1.0, transfer_bandwidth=threshold * 1.01)).reuse_beats_recompute(0)
    assert not CostModel(CostParams(mfu=1.0, transfer_bandwidth=threshold * 0.99)).reuse_beats_recompute(0)
    # a longer prefix makes reuse pay off at a lower bandwidth
    assert CostModel(CostParams(mfu=1.0, transfer_bandwidth=threshold * 0.99)).reuse_beats_recompute(100_000)


def test_decode_step_grows_with_context_and_caps_at_the_slo_and_hbm():
    cost = CostModel()
    assert cost.tbt(0) == pytest.approx(0.005 + 141e9 / (8 * 2.039e12 * 0.6))
    assert cost.tbt(200_000) > cost.tbt(100_000) > cost.tbt(0)
    limit = cost.decode_token_limit(0.03)
    assert cost.tbt(limit) <= 0.03 < cost.tbt(limit + 1000)
    assert cost.decode_token_limit(10.0) == cost.decode_token_limit(float("inf")) == CostParams().decode_kv_tokens
    assert cost.decode_token_limit(0.001) == 0


def test_fit_recovers_prefill_times_from_samples():
    truth = CostModel()
    rng = random.Random(1)
    samples = []
    for _ in range(200):
        n = rng.randint(100, 120_000)
        p = rng.randint(0, n - 1)
        samples.append((n, p, truth.prefill_time(n, p) * rng.uniform(0.98, 1.02)))
    fitted = CostModel(prefill=PolynomialPrefill.fit(samples))
    for n, p in [(2000, 0), (12_000, 4000), (60_000, 50_000), (100_000, 0)]:
        assert fitted.prefill_time(n, p) == pytest.approx(truth.prefill_time(n, p), rel=0.05, abs=0.02)


def test_fit_needs_enough_varied_samples():
    with pytest.raises(ConfigError):
        PolynomialPrefill.fit([(1000, 0, 1.0)] * 3)
    with pytest.raises(ConfigError):
        PolynomialPrefill.fit([(1000, 0, 1.0)] * 10)  # rank-deficient
