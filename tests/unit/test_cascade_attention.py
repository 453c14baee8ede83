"""The cascade decode attention over the KV blocks every decode request of a step shares: equal
to attention over whole rows (soft-capped layers too), used only past its threshold, and routed
output equal to the naive reference with it (a windowed, soft-capped Gemma 2 pair too)."""

import pytest
import torch

from tokenrouter_sdk.backends import attention as A
from tokenrouter_sdk.backends.attention import DecodeView, ForwardBatch, LayerParams


class _Pool:
    def __init__(self, k, v, block_size):
        self.k, self.v, self.block_size = [k], [v], block_size


def _decode_batch(pool, tables, lens, shared, softcap=None):
    """A decode-only `ForwardBatch` of requests with block ``tables`` and key counts ``lens``
    (the new token's slot is each request's last)."""
    bs, lmax = pool.block_size, max(lens)
    dkv = torch.zeros(len(tables), lmax, dtype=torch.long)
    for i, (tb, n) in enumerate(zip(tables, lens)):
        pos = torch.arange(n)
        dkv[i, :n] = torch.tensor(tb)[pos // bs] * bs + pos % bs
    mask = (torch.arange(lmax)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
    slots = torch.stack([dkv[i, n - 1] for i, n in enumerate(lens)])
    view = DecodeView(dkv, mask if min(lens) != lmax else None, shared * bs)
    return ForwardBatch(pool, slots, (LayerParams(None, softcap, 0.3),), (0,), torch.arange(len(tables)), (view,))


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("lens", [(23, 17, 30), (20, 20, 20), (17, 18, 19)])
def test_cascade_decode_attention_equals_attention_over_whole_rows(lens, softcap, monkeypatch):
    """Three requests share blocks 5, 9, 2, 7 (16 keys, block size 4) and then own blocks of
    their own; the decode step's cascade attention (shared keys once, then each request's own,
    merged by log-sum-exp) equals plain attention over each whole row, grouped-query heads,
    padding and a soft-cap included."""
    from tokenrouter_sdk.backends.attention import cascade

    g = torch.Generator().manual_seed(1)
    bs, hkv, h, d = 4, 2, 6, 8
    k, v = (torch.randn(40 * bs, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    pool = _Pool(k, v, bs)
    own = [[11, 12, 13, 14], [20, 21], [30, 31, 32, 33]]
    tables = [[5, 9, 2, 7] + o for o in own]
    q = torch.randn(1, h, len(lens), d, generator=g, dtype=torch.float64) * 3
    key = torch.randn(1, hkv, len(lens), d, generator=g, dtype=torch.float64)
    val = torch.randn(1, hkv, len(lens), d, generator=g, dtype=torch.float64)
    calls = []
    inner = cascade.attend
    monkeypatch.setattr(cascade, "attend", lambda *a: calls.append(1) or inner(*a))
    monkeypatch.setattr(cascade, "MIN_SAVED", 32)
    plain = A.attend_paged(_decode_batch(pool, tables, lens, 0, softcap), 0, q, key, val)
    assert not calls
    casc = A.attend_paged(_decode_batch(pool, tables, lens, 4, softcap), 0, q, key, val)
    assert calls
    assert torch.allclose(casc, plain, rtol=0, atol=1e-12)
    if softcap:  # the cap bites: without it the result differs
        assert not torch.allclose(
            A.attend_paged(_decode_batch(pool, tables, lens, 4), 0, q, key, val), plain, rtol=0, atol=1e-6
        )
    monkeypatch.setattr(cascade, "MIN_SAVED", 10**9)  # below the threshold: the plain path
    assert torch.equal(A.attend_paged(_decode_batch(pool, tables, lens, 4, softcap), 0, q, key, val), plain)


def test_a_step_counts_the_blocks_every_decode_request_shares():
    """`TorchRunner._batch` sets the full-attention view's ``shared`` to the leading blocks all
    decode tables share, never a request's last block; a windowed view shares none."""
    from tokenrouter_sdk.backends.torch_runner import TorchRunner
    from tokenrouter_sdk.engine.runner import SeqInput
    from tokenrouter_sdk.models import tiny_model

    r = TorchRunner(tiny_model(num_layers=1, seed=3), max_kv_tokens=64 * 4, block_size=4, kernels="off")
    a = SeqInput([7], 13, [3, 4, 5, 6])
    b = SeqInput([8], 11, [3, 4, 9])
    c = SeqInput([9], 8, [3, 4, 5])  # position 8 is in its block 5: its own last block
    assert r._batch([a, b])[0].dec[0].shared == 8
    assert r._batch([a, c])[0].dec[0].shared == 8
    assert r._batch([a, SeqInput([1], 3, [3])])[0].dec[0].shared == 0
    assert r._batch([a, SeqInput([1, 2], 3, [3, 4])])[0].dec[0].shared == 0  # one decode request only
    g2 = TorchRunner(
        tiny_model(arch="gemma2", num_layers=2, seed=3, sliding_window=4),
        max_kv_tokens=64 * 4,
        block_size=4,
        kernels="off",
    )
    views = g2._batch([a, b])[0].dec
    assert g2.spec.windows == (None, 4) and [v.shared for v in views] == [8, 0]
    assert views[1].kv.tolist() == [
        [r._batch([a])[0].dec[0].kv[0, i].item() for i in range(10, 14)],
        [r._batch([b])[0].dec[0].kv[0, i].item() for i in range(8, 12)],
    ]


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_routed_output_with_cascade_decode_equals_the_reference(pair, tok, monkeypatch, arch):
    """Routed greedy output over prompts behind one shared prefix (prefix cache on, so their
    tables share blocks) with the cascade decode attention equals the naive reference (on an
    untouched copy of the models), and the cascade did run; Gemma 2's full-attention layers
    (soft-capped) take the cascade, its windowed ones the gather."""
    import copy

    from tests.unit.test_prefix_cache import check_reference, shared_prompts
    from tokenrouter_sdk import Router, SamplingParams
    from tokenrouter_sdk.backends.attention import cascade
    from tokenrouter_sdk.models import tiny_model, truncate
    from tokenrouter_sdk.policies import RandomRouting

    models = pair
    if arch == "gemma2":
        large = tiny_model(
            arch="gemma2", num_layers=4, seed=2, sliding_window=8, attn_logit_softcapping=2.0, initializer_range=0.5
        )
        models = {"small": truncate(large, 2), "large": large}
    ref = copy.deepcopy(models)
    calls = []
    inner = cascade.attend
    monkeypatch.setattr(cascade, "MIN_SAVED", 8)
    monkeypatch.setattr(cascade, "attend", lambda *a: calls.append(1) or inner(*a))
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    with Router(
        models, RandomRouting(p=0.4, seed=3), tokenizer=tok, block_size=4, processes=False, kernels="off"
    ) as r:  # the cascade is part of the gather path
        outs = r.generate(shared_prompts(), sampling=params)
    assert calls
    check_reference(ref, outs, RandomRouting(p=0.4, seed=3), params)
