"""Public accessors that other classes read instead of private members."""

import torch

from tokenrouter_sdk.policy import StepBatch


def test_step_batch_says_when_set_token_wrote():
    tokens = torch.tensor([1, 2, 3])
    sb = StepBatch("small", ["small", "large"], tokens, torch.zeros(3, 5), None, [object()] * 3)
    assert sb.tokens_changed is False
    view = sb.select([2])
    view.set_token(0, 4)  # a selected view writes through to its batch
    assert view.tokens_changed and sb.tokens_changed
    assert sb.tokens.tolist() == [1, 2, 4] and tokens.tolist() == [1, 2, 3]
