"""Self-draft small models (tokenrouter_sdk.self_draft) and the distillation pipeline
(tokenrouter_sdk.train.self_draft) on tiny float64 models."""

from __future__ import annotations

import json

import pytest
import torch

from tokenrouter_sdk import Router
from tokenrouter_sdk.models import tiny_model, tiny_tokenizer
from tokenrouter_sdk.policies import RandomRouting
from tokenrouter_sdk.reference import reference_generate
from tokenrouter_sdk.request import SamplingParams
from tokenrouter_sdk.self_draft import (
    DraftMismatchError,
    attach_layers,
    init_trainable,
    load_self_draft,
    read_meta,
    save_self_draft,
)
from tokenrouter_sdk.train.self_draft import (
    DistillConfig,
    agreement,
    distill,
    draft_hidden,
    synthetic_prompts,
    system_prefix_len,
    teacher_continuations,
    teacher_targets,
)


@pytest.fixture(scope="module")
def large():
    return tiny_model(num_layers=4, seed=3)


def _ids(n=14, seed=0):
    return torch.randint(0, 250, (2, n), generator=torch.Generator().manual_seed(seed))


def test_draft_on_top_of_the_last_layers_is_the_large_model(large):
    extra, norm = init_trainable(large, 2)
    draft = attach_layers(large, 2, [e.double() for e in extra], norm.double())
    ids = _ids()
    assert torch.equal(draft(input_ids=ids).logits, large(input_ids=ids).logits)
    # zero-copy: the shared parts are the large model's own modules
    assert draft.model.embed_tokens is large.model.embed_tokens
    assert draft.model.layers[0] is large.model.layers[0] and draft.lm_head is large.lm_head
    assert draft.model.layers[2] is not large.model.layers[2]
    assert [lay.self_attn.layer_idx for lay in draft.model.layers] == [0, 1, 2, 3]


def test_draft_hidden_matches_the_assembled_model(large):
    extra, norm = init_trainable(large, 1)
    torch.nn.init.normal_(extra[0].mlp.up_proj.weight, std=0.3)
    extra, norm = [e.double() for e in extra], norm.double()
    draft = attach_layers(large, 1, extra, norm)
    ids = _ids(seed=1)
    h1 = large(input_ids=ids, output_hidden_states=True).hidden_states[1]
    got = large.lm_head(draft_hidden(extra, norm, large.model.rotary_emb, h1))
    torch.testing.assert_close(got, draft(input_ids=ids).logits)


def test_save_load_roundtrip_and_errors(large, tmp_path):
    extra, norm = init_trainable(large, 1)
    with torch.no_grad():
        extra[0].self_attn.o_proj.weight.mul_(-0.5)
        norm.weight.add_(0.25)
    path = save_self_draft(
        tmp_path / "d.safetensors", extra, norm, {"k": 2, "m": 1, "base": "tiny"}, dtype=torch.float64
    )
    assert read_meta(path)["k"] == 2
    loaded = load_self_draft(large, path)
    want = attach_layers(large, 2, [e.double() for e in extra], norm.double())
    ids = _ids(seed=2)
    torch.testing.assert_close(loaded(input_ids=ids).logits, want(input_ids=ids).logits)
    assert loaded.config.num_hidden_layers == 3 and loaded.dtype == torch.float64
    with pytest.raises(DraftMismatchError, match="another model"):
        load_self_draft(tiny_model(num_layers=4, hidden_size=32), path)
    with pytest.raises(FileNotFoundError, match="tokenrouter distill"):
        load_self_draft(large, tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="1 <= k < 4"):
        attach_layers(large, 4, extra, norm)


def test_draft_in_the_engine_matches_the_naive_reference(large):
    """The draft's extra layers index their own KV slots (layer_idx k+j) in the paged pool."""
    extra, norm = init_trainable(large, 2)
    draft = attach_layers(large, 1, [e.double() for e in extra], norm.double())
    tok = tiny_tokenizer()
    models = {"small": draft, "large": large}
    prompts = ["abc", "hello there", "x" * 30]
    policy = RandomRouting(p=0.4, seed=1)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    with Router(models, policy, tokenizer=tok, processes=False) as r:
        outs = r.generate(prompts, sampling=params, concurrency=3)
        ids = [r.encode(p) for p in prompts]
    hops = 0
    for o, p in zip(outs, ids):
        ref = reference_generate(models, p, policy, params, rid=o.rid)
        assert o.token_ids == ref["token_ids"] and o.token_models == ref["token_models"]
        hops += o.hops
    assert hops > 0


def test_synthetic_prompts_are_deterministic_and_distinct():
    a, b = synthetic_prompts(40, seed=5), synthetic_prompts(40, seed=5)
    assert a == b and len(set(a)) == 40
    assert any(p.startswith("Solve the problem.") for p in a) and not all(p.startswith("Solve") for p in a)
    assert synthetic_prompts(40, seed=6) != a


def test_teacher_targets_and_agreement(large):
    tok = tiny_tokenizer()
    prompts = ["abc", "a longer prompt"]
    seqs = teacher_continuations(large, tok, prompts, max_new_tokens=6, greedy_fraction=1.0, progress=False)
    plens = [
        len(
            tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)[
                "input_ids"
            ]
        )
        for p in prompts
    ]
    assert [len(s) - p for s, p in zip(seqs, plens)] == [6, 6]
    # the large model agrees with its own greedy continuation everywhere
    assert agreement(large, seqs, plens) == {"agreement": 1.0, "first_token": 1.0, "positions": 12}
    data = teacher_targets(large, seqs, 2, topk=5, start=system_prefix_len(tok), progress=False)
    out = large(input_ids=torch.tensor([seqs[0]]), output_hidden_states=True)
    torch.testing.assert_close(data.hidden[0], out.hidden_states[2][0].float())
    assert torch.equal(data.top_ids[0][:, 0], out.logits[0].argmax(-1))
    assert data.tokens == sum(len(s) - 1 - system_prefix_len(tok) for s in seqs)


def test_distill_end_to_end_on_a_tiny_model(large, tmp_path):
    tok = tiny_tokenizer()
    cfg = DistillConfig(
        k=2,
        m=1,
        train_prompts=8,
        max_new_tokens=8,
        heldout_prompts=3,
        gsm8k_heldout=2,
        topk=8,
        seconds=20,
        max_epochs=6,
        lr=3e-3,
        batch_tokens=256,
    )
    out = tmp_path / "draft.safetensors"
    meta = distill(large, tok, out, cfg, gsm8k_questions=["1+1?", "2+3?"], progress=False, log=lambda *_: None)
    assert out.is_file() and json.loads(out.with_suffix(".json").read_text())["k"] == 2
    assert meta["train"]["steps"] >= 6 and meta["train"]["loss_last"] < meta["train"]["loss_first"]
    for name in ("synthetic_heldout", "gsm8k_heldout"):
        a = meta["agreement"][name]
        assert a["self_draft"]["positions"] > 0 and 0.0 <= a["self_draft"]["agreement"] <= 1.0
        assert a["truncation_k2"]["positions"] == a["self_draft"]["positions"]
    assert set(meta["step_time"]) == {"B=1", "B=8"}
    draft = load_self_draft(large, out)
    assert draft.config.num_hidden_layers == 3


def test_distill_cli_arguments():
    from tokenrouter_sdk.cli.distill import run
    from tokenrouter_sdk.cli.main import build_parser

    args = build_parser().parse_args(["distill", "--k", "8", "--m", "1", "--seconds", "60", "--out", "x.safetensors"])
    assert (args.k, args.m, args.seconds, args.out, args.fn) == (8, 1, 60.0, "x.safetensors", run)
    d = build_parser().parse_args(["distill"])
    assert (d.k, d.m, d.prompts, d.max_new_tokens) == (12, 2, 400, 128)


def test_packaged_draft_file_fits_smollm2():
    """The shipped draft's sidecar says what it is and what it measured (the numbers in docs)."""
    from tokenrouter_sdk.self_draft import DEFAULT_DRAFT

    meta = read_meta(DEFAULT_DRAFT)
    assert (meta["k"], meta["m"], meta["base"]) == (12, 2, "SmolLM2-135M-Instruct")
    assert DEFAULT_DRAFT.stat().st_size < 20 * 2**20
    assert meta["agreement"]["synthetic_heldout"]["self_draft"]["agreement"] >= 0.5
    assert meta["agreement"]["synthetic_heldout"]["truncation_k12"]["agreement"] < 0.2
