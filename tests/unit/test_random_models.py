"""Random-weight models built from the released Qwen3 configs (the GPU benchmark's pair), the
id tokenizer and token-id prompts; a shrunk Qwen3 pair routes exactly like the naive reference."""

import pytest
import torch

from tokenrouter_sdk import Router, SamplingParams
from tokenrouter_sdk.bench import run_bench
from tokenrouter_sdk.cli.main import main
from tokenrouter_sdk.policies import RandomRouting
from tokenrouter_sdk.random_models import (
    QWEN3_SHAPES,
    count_parameters,
    id_tokenizer,
    random_config,
    random_model,
    random_prompts,
)
from tokenrouter_sdk.reference import reference_generate

SHRINK = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=1024,
    eos_token_id=1000,
    bos_token_id=None,
)


def test_parameter_counts_match_the_released_models():
    # published totals: Qwen3-0.6B 0.6B (0.44B without embeddings), Qwen3-8B 8.2B (6.95B without)
    n06, n8 = count_parameters("qwen3-0.6b"), count_parameters("qwen3-8b")
    assert n06 == 596_049_920
    assert n8 == 8_190_735_360
    emb = 151936 * 1024
    assert round((n06 - emb) / 1e9, 2) == 0.44
    assert round((n8 - 2 * 151936 * 4096) / 1e9, 2) == 6.95
    cfg = random_config("Qwen3-8B")
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.tie_word_embeddings) == (
        36,
        8,
        128,
        False,
    )
    assert set(QWEN3_SHAPES) >= {"qwen3-0.6b", "qwen3-8b"}


def test_unknown_shape_names_the_known_ones():
    with pytest.raises(ValueError, match="qwen3-0.6b"):
        random_config("qwen3-9b")


def test_weights_depend_on_the_seed_only_and_leave_the_global_rng_alone():
    before = torch.random.get_rng_state()
    a = random_model("qwen3-0.6b", device="cpu", dtype=torch.float32, seed=3, **SHRINK)
    b = random_model("qwen3-0.6b", device="cpu", dtype=torch.float32, seed=3, **SHRINK)
    c = random_model("qwen3-0.6b", device="cpu", dtype=torch.float32, seed=4, **SHRINK)
    assert torch.equal(torch.random.get_rng_state(), before)
    wa, wb, wc = (m.model.layers[0].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert wa.dtype == torch.float32 and not wa.requires_grad and not a.training
    assert 0.015 < wa.std().item() < 0.025  # transformers' init, normal(0, 0.02)


def test_id_tokenizer_and_prompts():
    tok = id_tokenizer()
    assert len(tok) == 151936 and tok.eos_token_id == 151645
    assert tok.decode([7, 151935]) == "<7> <151935>"
    assert tok.encode("<3> <42>", add_special_tokens=False) == [3, 42]
    ps = random_prompts(4, 50, vocab_size=100, seed=1, avoid=(7,))
    assert [len(p) for p in ps] == [50] * 4 and all(0 <= i < 100 and i != 7 for p in ps for i in p)
    assert (
        ps == random_prompts(4, 50, vocab_size=100, seed=1, avoid=(7,)) != random_prompts(4, 50, vocab_size=100, seed=2)
    )
    with pytest.raises(ValueError, match="outside the vocabulary"):
        id_tokenizer(10, eos_token_id=10)


def test_shrunk_qwen3_pair_routes_like_the_reference():
    pair = {
        "small": random_model("qwen3-0.6b", device="cpu", dtype=torch.float64, seed=0, **SHRINK),
        "large": random_model(
            "qwen3-8b", device="cpu", dtype=torch.float64, seed=1, **(SHRINK | {"num_hidden_layers": 3})
        ),
    }
    tok = id_tokenizer(1024, eos_token_id=1000)
    prompts = random_prompts(4, 12, vocab_size=1024, seed=5, avoid=(1000,))
    policy = RandomRouting(p=0.3, seed=2)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    with Router(pair, tokenizer=tok, processes=False) as r:
        outs = r.generate(prompts, sampling=params, policy=policy, concurrency=4)
    for o in outs:
        ref = reference_generate(pair, o.prompt, policy, params, rid=o.rid)
        assert (o.token_ids, o.token_models) == (ref["token_ids"], ref["token_models"])
    assert {m for o in outs for m in o.token_models} == {"small", "large"}
    assert outs[0].text == tok.decode(outs[0].token_ids)
    # the benchmark on this pair: explicit cell order, warm-up, per-cell callback
    seen = []
    cells = run_bench(
        pair,
        tok,
        prompts,
        cells=[("random30", "delayed", True, 2, 8), ("random30", "sync", True, 2, 8)],
        thresholds="small=2,large=1",
        progress=False,
        on_cell=seen.append,
        warmup_tokens=4,
        processes=False,
    )
    assert [c.mode for c in seen] == ["delayed", "sync"] and seen == cells
    assert all(c.committed_tokens == 2 * 2 * 8 for c in cells)
    assert cells[0].vs_sync == pytest.approx(cells[0].throughput_tok_s / cells[1].throughput_tok_s)


def test_bench_deadline_stops_before_the_next_cell():
    from tokenrouter_sdk.backends.sim_runner import LatencyModel
    from tokenrouter_sdk.models import tiny_tokenizer

    lat = {"small": LatencyModel({1: 0.02}), "large": LatencyModel({1: 0.06})}
    cells = run_bench(
        lat,
        tiny_tokenizer(),
        [[5] * 8],
        cells=[("random10", "async", True, 1, 4)] * 3,
        deadline=0.0,
        backend="sim",
        progress=False,
    )
    assert cells == []


def test_random_pair_flag_needs_two_names():
    with pytest.raises(SystemExit, match="SMALL,LARGE"):
        main(["bench", "--random-pair", "qwen3-0.6b", "--device", "cpu"])
