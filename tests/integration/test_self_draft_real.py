"""The packaged self-draft on the real SmolLM2: it loads, shares the large model's modules and agrees
with the large model far more often than the plain truncation. (Routing with it equals the naive
reference: tests/unit/test_self_draft.py on tiny models; the demo and tutorials run it.)"""

import pytest
import torch

from tokenrouter_sdk.models import default_pair, truncate
from tokenrouter_sdk.train.self_draft import agreement, synthetic_prompts

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pair():
    return default_pair()


def test_self_draft_agrees_with_the_large_model(pair):
    large, small, tok = pair
    assert small.config.num_hidden_layers == 14 and small.model.layers[11] is large.model.layers[11]
    assert small.lm_head is large.lm_head and small.model.layers[12] is not large.model.layers[12]
    prompts = synthetic_prompts(432, seed=0)[400:404]  # held out by `tokenrouter distill` (400 train)
    seqs, plens = [], []
    for p in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)[
            "input_ids"
        ]
        out = large.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
        seqs.append(out[0].tolist())
        plens.append(len(ids))
    draft = agreement(small, seqs, plens)["agreement"]
    plain = agreement(truncate(large, 12), seqs, plens)["agreement"]
    assert draft >= 0.35 and draft >= plain + 0.2, (draft, plain)
