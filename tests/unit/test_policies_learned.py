"""Learned token-level routers (CITER, Co-LLM, R2R) and R2R's training-free variants: routing
semantics, equivalence with the naive reference, defaults, head files (heads with random or
hand-set weights; thresholds set at score quantiles so that both models write tokens)."""

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from tokenrouter_sdk import Router, SamplingParams, StepBatch
from tokenrouter_sdk.policies import heads
from tokenrouter_sdk.policies.citer import CITER
from tokenrouter_sdk.policies.co_llm import CoLLM, DeferralHead, warmup_eta
from tokenrouter_sdk.policies.heads import HeadMissingError, load_head, save_head
from tokenrouter_sdk.policies.r2r import R2R, R2RAleatoric, R2REntropy, aleatoric_uncertainty
from tokenrouter_sdk.reference import reference_generate
from tokenrouter_sdk.request import RequestView

from ..helpers import mixed_prompts, pools_free

H, N_NEW, MODELS = 64, 24, ("small", "large")


# -- helpers -------------------------------------------------------------------------------------
def batch_of(model, hidden, logits, tokens=None, states=None):
    n = hidden.shape[0]
    views = [
        RequestView(
            rid=i,
            prompt_ids=[1],
            output_ids=[],
            owner=model,
            state={} if states is None else states[i],
            hops=0,
            models=MODELS,
        )
        for i in range(n)
    ]
    tokens = logits.argmax(-1) if tokens is None else torch.as_tensor(tokens)
    return StepBatch(model, MODELS, tokens, logits, hidden, views)


def published_checkpoint(threshold=0.5, dims=(32, 48), k=100, seed=0):
    """A router written key by key in the layout of thu-nics/R2R ``save_model`` (default_router.pt:
    HiddenStatesTokenLMHeadLogitsClassifier, token_embeddings.weight stripped), small sizes."""
    g, sd = torch.Generator().manual_seed(seed), {}

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    def lin(name, i, o):
        sd[name + ".weight"], sd[name + ".bias"] = rnd(o, i) / math.sqrt(i), 0.1 * rnd(o)

    def ln(name, d):
        sd[name + ".weight"], sd[name + ".bias"] = 1 + 0.1 * rnd(d), 0.1 * rnd(d)

    lin("logits_projection", k, H)
    lin("combined_projection", 3 * H, dims[0])
    lin("backbone.input_projection", dims[0], dims[0])
    bd = list(dims) + [dims[-1]]
    for i in range(len(dims)):
        p = f"backbone.blocks.{i}"
        ln(p + ".layer_norm", bd[i])
        lin(p + ".mlp.0", bd[i], 4 * bd[i])
        lin(p + ".mlp.3", 4 * bd[i], bd[i + 1])
        if bd[i] != bd[i + 1]:
            lin(p + ".dim_change", bd[i], bd[i + 1])
    ln("backbone.output_layer.0", dims[-1])
    lin("backbone.output_layer.1", dims[-1], 1)
    init = {
        "hidden_states_size": H,
        "logits_size": k,
        "hidden_dims": list(dims),
        "expansion_factor": 4,
        "dropout_rate": 0.1,
        "use_position_embedding": False,
        "freeze_lm_head": True,
        "normalize_input": False,
        "pretrained_model_name": "tiny",
    }
    return {
        "model_type": "HiddenStatesTokenLMHeadLogitsClassifier",
        "init_args": init,
        "model_specific_args": {},
        "common_args": {"threshold": threshold, "input_type": ["hidden_states", "token", "logits"]},
        "state_dict": sd,
    }


def r2r_forward(sd, h, e, z):
    """The R2R router's forward written out with torch.nn.functional (independent of policies/r2r.py)."""

    def lin(n, x):
        return F.linear(x, sd[n + ".weight"], sd[n + ".bias"])

    def ln(n, x):
        return F.layer_norm(x, x.shape[-1:], sd[n + ".weight"], sd[n + ".bias"])

    x = lin("backbone.input_projection", lin("combined_projection", torch.cat([h, e, lin("logits_projection", z)], -1)))
    i = 0
    while f"backbone.blocks.{i}.layer_norm.weight" in sd:
        p = f"backbone.blocks.{i}"
        res = lin(p + ".dim_change", x) if p + ".dim_change.weight" in sd else x
        x = res + lin(p + ".mlp.3", F.gelu(lin(p + ".mlp.0", ln(p + ".layer_norm", x))))
        i += 1
    return torch.sigmoid(lin("backbone.output_layer.1", ln("backbone.output_layer.0", x)))[:, 0]


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny float64 models run ~10x faster on one intra-op thread when the CPU is shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def signals(pair):
    """The small model's hidden states and logits over random text, a StepBatch of 160 rows, to set
    thresholds at score quantiles."""
    ids = torch.randint(3, 259, (4, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = pair["small"].model(input_ids=ids).last_hidden_state.reshape(-1, H)
        logits = pair["small"].lm_head(h)
    return batch_of("small", h, logits)


@pytest.fixture(scope="module")
def policies(pair, signals, tmp_path_factory):
    """Each policy with thresholds that route about 30% of the small model's steps."""

    def q(x, f):
        return float(torch.quantile(x.float(), f))

    citer_head, collm_head = CITER.random_head(H, seed=0), CoLLM.random_head(H, seed=0)
    ckpt = published_checkpoint()
    emb = pair["small"].get_input_embeddings().weight.float()
    p = r2r_forward(ckpt["state_dict"], signals.hidden.float(), emb[signals.tokens], signals.topk(100)[0].float())
    ckpt["common_args"]["threshold"] = q(p, 0.7)
    path = tmp_path_factory.mktemp("r2r") / "default_router.pt"
    torch.save(ckpt, path)
    eta = q(CoLLM(collm_head).deferral_prob(signals), 0.7)
    return {
        "citer": CITER(citer_head, tau=q(CITER(citer_head).confidence(signals), 0.3)),
        "co_llm": CoLLM(collm_head, eta=eta),
        "co_llm_compose": CoLLM(collm_head, eta=eta, compose=True),
        "r2r": R2R(str(path), embedding=pair["small"]),
        "r2r_entropy": R2REntropy(threshold=q(signals.entropy, 0.7)),
        "r2r_aleatoric": R2RAleatoric(threshold=q(aleatoric_uncertainty(signals.logits), 0.7)),
    }


# -- routing semantics and equivalence -----------------------------------------------------------
def run_recorded(pair, tok, pol, prompts, params, concurrency):
    """Engine outputs, and every (rid, model, position, sampled token, decision) route_batch saw."""
    log = []

    def recording(batch, _orig=type(pol).route_batch):  # noqa: B008 - the class method, bound once
        out = _orig(pol, batch)
        log.extend((r.rid, batch.model, r.n_generated, int(t), d) for r, t, d in zip(batch.requests, batch.tokens, out))
        return out

    pol.route_batch = recording
    try:
        with Router(pair, pol, tokenizer=tok, max_kv_tokens=8192) as r:
            outs = r.generate(prompts, sampling=params, concurrency=concurrency)
            assert all(free == usable for free, usable in pools_free(r).values())
    finally:
        del pol.route_batch
    return outs, log


@pytest.mark.parametrize("name", ["citer", "co_llm", "co_llm_compose", "r2r", "r2r_entropy", "r2r_aleatoric"])
def test_semantics_and_equivalence(pair, tok, policies, name):
    """At concurrency 1 and 8 the engine equals the naive reference (`tokenrouter_sdk.reference`); each
    small-model decision fixes who writes that position; the large model writes one token per visit."""
    pol, prompts = policies[name], mixed_prompts(8, seed=4)
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    refs = [reference_generate(pair, p, pol, params, rid=i) for i, p in enumerate(prompts)]
    for concurrency in (1, 8):
        outs, log = run_recorded(pair, tok, pol, prompts, params, concurrency)
        for o in outs:
            assert o.finish_reason == "length", o.error
            ref = refs[prompts.index(o.prompt)]
            assert (o.token_ids, o.token_models) == (ref["token_ids"], ref["token_models"]), f"rid {o.rid}"
            assert (o.hops, o.discarded) == (ref["hops"], ref["discarded"])
        writers = [m for o in outs for m in o.token_models]
        assert 0.05 < writers.count("large") / len(writers) < 0.7  # both models write
        if name == "co_llm_compose":  # the large model's route composes, then hands back
            assert {m for _, m, *_ in log} == {"small", "large"}
            continue
        assert {m for _, m, *_ in log} == {"small"}  # the router never runs on the large model's token
        for o in outs:
            mine = sorted((pos, tok_, d) for rid, _, pos, tok_, d in log if rid == o.rid)
            assert [pos for pos, *_ in mine] == list(range(N_NEW))  # one small decision per position
            for pos, small_tok, d in mine:
                assert o.token_models[pos] == d  # who writes which position
                if d == "small":
                    assert o.token_ids[pos] == small_tok  # kept; on "large" it was discarded
            # each visit to the large model writes exactly one token, then control returns
            assert o.discarded == o.token_models.count("large")
            assert o.hops == 2 * o.discarded - (o.token_models[-1] == "large")


def test_co_llm_compose_decisions():
    """argmax((1 - pi) p_base + pi p_asst) is written at a deferral position: the assistant's
    token, the base model's, or a third token; the assistant hands back keeping it."""
    pol = CoLLM({"g": torch.zeros(H), "b": torch.tensor(0.0)}, eta=0.4, compose=True)  # pi = 0.5
    h = torch.zeros(1, H)

    def view(owner, st):
        return RequestView(rid=0, prompt_ids=[1], output_ids=[], owner=owner, state=st, hops=0, models=MODELS)

    cases = {
        "assistant": ([0.6, 0.2, 0.1, 0.1], [0.5, 0.3, 0.1, 0.1], 0),
        "base": ([0.9, 0.05, 0.03, 0.02], [0.2, 0.4, 0.2, 0.2], 0),
        "third": ([0.45, 0, 0.4, 0.15], [0, 0.45, 0.4, 0.15], 2),
    }
    for case, (p_base, p_asst, want) in cases.items():
        st = {}
        assert pol.route_batch(batch_of("small", h, torch.tensor([p_base]).log(), states=[st])) == ["large"]
        sent = pol.send(view("small", st), "large")
        assert (sent.keep_sampled, sent.span, sent.greedy) == (False, None, True)  # the assistant's route composes
        b = batch_of("large", h, torch.tensor([p_asst]).log(), states=[st])
        b._peer = [torch.tensor(p_base).log()]  # the base logits the handoff carried
        assert pol.route_batch(b) == ["small"]
        assert int(b.tokens[0]) == want, case
        assert pol.send(view("large", st), "small").keep_sampled is True
        assert "co_llm_pi" not in st


def test_heads_are_vectorised_and_float32(signals):
    """One head forward per batch; model dtype (here bfloat16) does not matter."""
    b16 = batch_of("small", signals.hidden[:8].bfloat16(), signals.logits[:8].bfloat16())
    for pol in (
        CITER(CITER.random_head(H)),
        CoLLM(CoLLM.random_head(H)),
        R2R(published_checkpoint(), embedding=torch.randn(259, H)),
    ):
        calls = []
        pol._net.register_forward_hook(lambda m, i, o: calls.append(i[0].shape))
        assert len(pol.route_batch(b16)) == 8
        assert calls == [torch.Size([8, H])]
        assert all(p.dtype == torch.float32 for p in pol._net.parameters())
    assert pol.route_batch(batch_of("large", signals.hidden[:2], signals.logits[:2])) == ["large", "large"]


# -- the heads -----------------------------------------------------------------------------------
def test_r2r_loads_published_layout(signals, pair, tmp_path):
    ckpt = published_checkpoint(threshold=0.25)
    torch.save(ckpt, tmp_path / "default_router.pt")
    pol = R2R(tmp_path / "default_router.pt", embedding=pair["small"])
    assert (pol.tau, pol.hidden_size, pol.logits_size) == (0.25, H, 100)  # sizes from the state dict
    emb = pair["small"].get_input_embeddings().weight.float()
    want = r2r_forward(ckpt["state_dict"], signals.hidden.float(), emb[signals.tokens], signals.topk(100)[0].float())
    torch.testing.assert_close(pol.prob(signals), want, rtol=1e-5, atol=1e-5)
    assert R2R(ckpt, embedding=emb, tau=0.9).tau == 0.9  # override
    # random_head writes the same key layout as the published checkpoints
    assert set(R2R.random_head(H)["state_dict"]) == set(published_checkpoint(dims=(64, 64))["state_dict"])
    with pytest.raises(ValueError, match="embedding=small_model"):
        R2R(ckpt)
    with pytest.raises(ValueError, match="pass tau"):
        R2R(published_checkpoint(threshold=None), embedding=emb)
    with pytest.raises(ValueError, match="size 64 but the given table has size 32"):
        R2R(ckpt, embedding=torch.zeros(259, 32))
    with pytest.raises(ValueError, match="model_type"):
        R2R({**ckpt, "model_type": "LogitsClassifier"}, embedding=emb)


@pytest.mark.parametrize("cls,kind", [(CITER, "citer"), (CoLLM, "co_llm"), (R2R, "r2r")])
def test_refuses_to_run_without_a_head(cls, kind, tmp_path, monkeypatch):
    with pytest.raises(HeadMissingError) as e:
        cls(tmp_path / "nope.pt")
    msg = str(e.value)
    assert isinstance(e.value, FileNotFoundError) and "nope.pt' does not exist" in msg
    assert (
        f"tokenrouter train {kind}" in msg and f"train_{kind}(router)" in msg and f"{cls.__name__}.random_head(" in msg
    )
    if kind == "r2r":
        assert "nics-efc/R2R_router_collections" in msg
    # head=None loads the packaged head; where it is missing the error says how to rebuild it
    monkeypatch.setattr(heads, "packaged_head_path", lambda k, pair=None: tmp_path / f"smollm2_{k}_head.pt")
    with pytest.raises(HeadMissingError, match=f"head=None.*`tokenrouter train {kind} --pair smollm2 --package`"):
        cls()


def test_head_file_roundtrip_and_errors(signals, tmp_path):
    head = CITER.random_head(H, seed=3)
    save_head(tmp_path / "c.pt", "citer", head.state_dict(), {"hidden_size": H}, {"pair": "tiny"})
    sd, cfg, meta = load_head(tmp_path / "c.pt", "citer")
    assert (cfg, meta) == ({"hidden_size": H}, {"pair": "tiny"})
    assert all(torch.equal(sd[k], v) for k, v in head.state_dict().items())
    want = CITER(head).confidence(signals)
    torch.testing.assert_close(CITER(tmp_path / "c.pt").confidence(signals), want)
    torch.save(head.state_dict(), tmp_path / "mlp_iter_2876.pth")  # what CITER's own trainer saves
    torch.testing.assert_close(CITER(tmp_path / "mlp_iter_2876.pth").confidence(signals), want)
    g = CoLLM.random_head(H, seed=1, bias=-0.5)
    save_head(tmp_path / "g.pt", "co_llm", g.state_dict())
    torch.testing.assert_close(CoLLM(tmp_path / "g.pt").deferral_prob(signals), g(signals.hidden.float()))
    with pytest.raises(ValueError, match="holds a 'citer' head, but a 'co_llm' head"):
        CoLLM(tmp_path / "c.pt")
    with pytest.raises(ValueError, match="kind must be one of"):
        save_head(tmp_path / "x.pt", "nope", {})
    torch.save({"something": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a CITER head"):
        CITER(tmp_path / "other.pt")


def test_hidden_size_mismatch_is_a_clear_error(pair, tok, signals):
    for pol in (
        CITER(CITER.random_head(32)),
        CoLLM(CoLLM.random_head(32)),
        R2R(R2R.random_head(32, hidden_dims=(16,)), embedding=torch.zeros(259, 32)),
    ):
        with pytest.raises(ValueError, match="hidden size 32 .* have size 64"):
            pol.route_batch(signals)
    with Router(pair, CITER(CITER.random_head(32)), tokenizer=tok) as r:
        out = r.generate(mixed_prompts(1), max_new_tokens=4)[0]
    assert out.finish_reason == "failed" and "expects hidden size 32" in out.error


# -- defaults (policies.md summary table and the official code) ----------------------------------
def test_defaults_match_the_spec():
    def defaults(cls):
        return {k: p.default for k, p in inspect.signature(cls).parameters.items() if p.default is not p.empty}

    # thresholds: the one stored in the head file, else the paper's default
    assert defaults(CITER) == {"head": None, "tau": None, "small": None, "large": None, "pair": None}
    assert CITER(CITER.random_head(H)).tau == 0.95  # token_route.py --threshold (README: 0.9)
    assert defaults(CoLLM) == {
        "head": None,
        "eta": None,
        "compose": False,
        "warmup": "constant",
        "warmup_steps": 15,
        "small": None,
        "large": None,
        "pair": None,
    }
    assert CoLLM(CoLLM.random_head(H)).eta == 0.5
    assert defaults(R2R)["tau"] is None  # tau stored in the checkpoint
    assert defaults(R2REntropy)["threshold"] == 0.45
    assert (defaults(R2RAleatoric)["threshold"], defaults(R2RAleatoric)["k"]) == (2.275, 10)
    view = RequestView(rid=0, prompt_ids=[1], output_ids=[], owner="small", state={}, hops=0, models=MODELS)
    for pol in (
        CITER(CITER.random_head(H)),
        CoLLM(CoLLM.random_head(H)),
        R2REntropy(),
        R2RAleatoric(),
        R2R(published_checkpoint(), embedding=torch.zeros(259, H)),
    ):
        h = pol.send(view, "large")  # all discard the small token; the large model writes one token
        assert (h.keep_sampled, h.span) == (False, 1)


def test_training_free_signals():
    # entropy in nats: uniform over 4 tokens = ln 4 >= 0.45 routes; a peaked distribution stays
    p = torch.tensor([[0.25] * 4, [0.97, 0.01, 0.01, 0.01]])
    assert R2REntropy().route_batch(batch_of("small", torch.zeros(2, 4), p.log())) == ["large", "small"]
    # LogU with k equal logits c: AU = psi(kc + 1) - psi(c + 1) = H_kc - H_c (harmonic numbers)
    x = torch.full((1, 12), 1.0)
    harmonic = sum(1 / n for n in range(1, 11))
    assert float(aleatoric_uncertainty(x, k=10)) == pytest.approx(harmonic - 1, rel=1e-5)
    assert R2RAleatoric(threshold=1.9).route_batch(batch_of("small", torch.zeros(1, 4), x)) == ["large"]
    assert R2RAleatoric(threshold=2.0).route_batch(batch_of("small", torch.zeros(1, 4), x)) == ["small"]
    neg = torch.full((1, 12), -0.5)  # ill-defined (NaN): routes, as in R2R's code
    assert R2RAleatoric().route_batch(batch_of("small", torch.zeros(1, 4), neg)) == ["large"]


def test_co_llm_threshold_warmup():
    assert warmup_eta(0, 0.3, "linear", 15) == 1.0 and warmup_eta(15, 0.3, "linear", 15) == 0.3
    assert warmup_eta(5, 0.3, "constant", 15) == 0.3
    assert warmup_eta(0, 0.3, "cosine", 10) == pytest.approx(1.0)
    assert warmup_eta(5, 0.3, "cosine", 10) == pytest.approx(0.65)
    assert warmup_eta(5, 0.25, "exponential", 10) == pytest.approx(0.5)
    head = DeferralHead(H)
    with torch.no_grad():
        head.b.fill_(0.85)  # pi = 0.70
    pol = CoLLM(head, eta=0.5, warmup="linear", warmup_steps=10)
    views = [
        RequestView(rid=0, prompt_ids=[1], output_ids=[0] * n, owner="small", state={}, hops=0, models=MODELS)
        for n in (0, 1, 9, 10)
    ]
    b = StepBatch("small", MODELS, torch.zeros(4, dtype=torch.long), torch.zeros(4, 5), torch.zeros(4, H), views)
    assert pol.route_batch(b) == ["small", "small", "large", "large"]  # eta_t = 1.0, 0.95, 0.55, 0.5
    with pytest.raises(ValueError, match="warmup must be one of"):
        CoLLM(head, warmup="step")
