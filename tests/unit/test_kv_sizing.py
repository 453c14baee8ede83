"""KV pools sized by memory (`tokenrouter_sdk.kv_sizing`): the joint plan of the models sharing a
device, the CPU share and cap, ``max_kv_tokens`` when given, and what `Router.kv_stats` says."""

import pytest
import torch

from tokenrouter_sdk import Router
from tokenrouter_sdk import kv_sizing as K
from tokenrouter_sdk.models import tiny_model, truncate


def test_tokens_for_is_the_documented_formula():
    # 0.5 of 1,000,000 bytes over 100 + 300 bytes per token: 1250 tokens, down to whole blocks of 16
    assert K.tokens_for(1_000_000, 0.5, [100, 300], 16) == 1248
    assert K.tokens_for(1_000_000, 0.5, [100, 300], 16, cap=1000) == 992
    assert K.tokens_for(16 * 400, 1.0, [100, 300], 16) == 16
    with pytest.raises(ValueError, match="less than one block"):
        K.tokens_for(16 * 400 - 1, 1.0, [100, 300], 16)


def test_kv_bytes_and_shared_weights():
    large = tiny_model(num_layers=4, seed=1)  # 4 layers, 2 KV heads of 16, float64
    small = truncate(large, 2)
    assert K.kv_bytes_per_token(large) == 2 * 4 * 2 * 16 * 8 and K.kv_bytes_per_token(small) == 2 * 2 * 2 * 16 * 8
    own = sum(t.numel() * t.element_size() for t in large.parameters())
    assert K.weights_bytes([large, small]) == K.weights_bytes([large]) >= own  # shared layers counted once


def test_plan_shares_a_device_jointly_and_caps_the_cpu_default():
    large = tiny_model(num_layers=4, seed=1)
    models = {"small": truncate(large, 2), "large": large}
    per = [K.kv_bytes_per_token(m) for m in models.values()]
    left = 3 * 2**20
    plan = K.plan(models, block_size=16, probe=lambda dev: left)  # the CPU default: 0.25 of RAM, capped
    want = min(int(K.CPU_SHARE * left) // sum(per), K.CPU_CAP_TOKENS) // 16 * 16
    assert {z.tokens for z in plan.values()} == {want} and want == 256  # the same for both: reservations bound both
    z = plan["large"]
    assert (z.rule, z.fraction, z.memory_left_bytes, z.shared_with) == ("cpu_share", 0.25, left, ("small", "large"))
    assert "CPU share 0.25 of the available RAM" in z.describe() and "256 tokens" in z.describe()
    huge = K.plan(models, block_size=16, probe=lambda dev: 2**40)
    assert huge["small"].tokens == K.CPU_CAP_TOKENS and "capped at 65,536" in huge["small"].describe()
    frac = K.plan(models, block_size=16, fraction=0.5, probe=lambda dev: 2**30)  # given: no cap
    assert frac["large"].tokens == int(0.5 * 2**30) // sum(per) // 16 * 16 > K.CPU_CAP_TOKENS
    assert frac["large"].rule == "kv_memory_fraction"
    fixed = K.plan(models, block_size=16, max_kv_tokens=1000, probe=lambda dev: 1 / 0)
    assert {z.tokens for z in fixed.values()} == {1008} and fixed["small"].rule == "max_kv_tokens"
    unknown = K.plan(models, block_size=16, probe=lambda dev: None)
    assert unknown["small"].tokens == 8192 and unknown["small"].rule == "no_memory_info"
    with pytest.raises(ValueError, match="not both"):
        K.plan(models, block_size=16, max_kv_tokens=64, fraction=0.5)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        K.plan(models, block_size=16, fraction=1.5)


def test_router_pools_follow_the_plan_and_kv_stats_says_why(pair, tok, monkeypatch):
    monkeypatch.setattr(K, "memory_left", lambda dev: 8 * 2**20)
    per = sum(K.kv_bytes_per_token(m) for m in pair.values())
    with Router(pair, tokenizer=tok, kv_memory_fraction=0.5) as r:
        want = int(0.5 * 8 * 2**20) // per // 16 * 16
        assert {n: rr.pool.capacity_tokens for n, rr in r.engine.runners.items()} == {"small": want, "large": want}
        stats = r.kv_stats()
        assert stats.sizing["large"].rule == "kv_memory_fraction" and stats.sizing["large"].tokens == want
        assert f"large: {want:,} tokens (kv_memory_fraction 0.5" in repr(stats)
        assert "pool sizes" in stats._repr_html_()
    with Router(pair, tokenizer=tok) as r:  # the default on the CPU: its share of the RAM
        assert r.kv_sizing["small"].rule == "cpu_share"
        assert r.engine.runners["small"].pool.capacity_tokens == int(0.25 * 8 * 2**20) // per // 16 * 16
    with Router(pair, tokenizer=tok, max_kv_tokens=500) as r:
        assert r.engine.runners["large"].pool.capacity_tokens == 512 and r.kv_sizing["large"].rule == "max_kv_tokens"
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        Router(pair, tokenizer=tok, kv_memory_fraction=0.0)


def test_cuda_probe_reads_free_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (7 * 2**30, 80 * 2**30))
    assert K.memory_left(torch.device("cuda", 0)) == 7 * 2**30
    assert K.memory_left(torch.device("cpu")) > 0
