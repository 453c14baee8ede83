"""Unit tests for tokenrouter_sdk.models: fast, tiny random models only, no downloads."""

import copy
from pathlib import Path

import pytest
import torch

from tokenrouter_sdk.models import (
    ModelLoadError,
    TokenizerMismatchError,
    cache_dir,
    check_same_tokenizer,
    load_model,
    tiny_model,
    tiny_tokenizer,
    truncate,
)


def _copy_truncated(full, k):
    """Reference 'first k layers' model built the slow way: new model + copied weights."""
    cfg = copy.deepcopy(full.config)
    cfg.num_hidden_layers = k
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = cfg.layer_types[:k]
    ref = type(full)(cfg).to(full.dtype).eval()
    missing, unexpected = ref.load_state_dict(full.state_dict(), strict=False)
    assert not missing and all(".layers." in u for u in unexpected)
    return ref


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_truncate_shares_memory_and_matches_first_k_layers(arch):
    full = tiny_model(arch=arch, num_layers=4)
    small = truncate(full, 2)
    assert small.config.num_hidden_layers == 2 and len(small.model.layers) == 2
    assert full.config.num_hidden_layers == 4 and len(full.model.layers) == 4
    full_ptrs = {p.data_ptr() for p in full.parameters()}
    for name, p in small.named_parameters():
        assert not p.is_meta and p.data_ptr() in full_ptrs, name
        assert p is full.get_parameter(name), name
    assert not any(b.is_meta for b in small.buffers())
    assert small.config._attn_implementation == full.config._attn_implementation
    assert small.dtype == full.dtype and not small.training
    assert small.generation_config.eos_token_id == full.generation_config.eos_token_id

    ids = torch.tensor([[256, 72, 101, 108, 108, 111, 33, 10]])
    with torch.no_grad():
        got = small(ids).logits
        want = _copy_truncated(full, 2)(ids).logits
        whole = full(ids).logits
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, whole)


def test_truncate_validates_num_layers():
    full = tiny_model(num_layers=3)
    for bad in (0, -1, 3, 4, 1.5):
        with pytest.raises(ValueError, match="num_layers"):
            truncate(full, bad)
    assert len(truncate(full, 1).model.layers) == 1


@pytest.mark.parametrize("text", ["hello world", "  leading spaces\n\ttabs", "héllo wörld — 日本語 🙂", ""])
def test_tiny_tokenizer_roundtrip(text):
    tok = tiny_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))  # one token per byte, id = byte value
    assert tok.decode(ids) == text


def test_tiny_tokenizer_specials_and_chat_template():
    tok = tiny_tokenizer()
    assert len(tok) == 259
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|bos|>user\nhi<|eos|>\n<|bos|>assistant\n"
    assert tok.encode(prompt)[0] == tok.bos_token_id and tok.decode(tok.encode(prompt)) == prompt


def test_tiny_model_deterministic_by_seed_and_leaves_global_rng():
    state = torch.random.get_rng_state()
    a, b, c = tiny_model(seed=0), tiny_model(seed=0), tiny_model(seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert a.dtype == torch.float64 and not a.training
    assert not any(p.requires_grad for p in a.parameters())
    assert a.config.vocab_size == len(tiny_tokenizer()) and a.config._attn_implementation == "sdpa"
    assert (a.config.bos_token_id, a.config.eos_token_id, a.config.pad_token_id) == (256, 257, 258)


def test_tiny_model_qwen3_builds_and_runs():
    m = tiny_model(arch="qwen3", num_layers=3, dtype=torch.float32)
    assert type(m).__name__ == "Qwen3ForCausalLM" and m.dtype == torch.float32
    with torch.no_grad():
        assert m(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 259)
    with pytest.raises(ValueError, match="arch"):
        tiny_model(arch="gpt2")


def test_check_same_tokenizer_accepts_same_and_equal():
    a = tiny_tokenizer()
    check_same_tokenizer(a, "small", a, "large")
    check_same_tokenizer(a, "small", tiny_tokenizer(), "large")


def test_check_same_tokenizer_rejects_different_vocab():
    a, b = tiny_tokenizer(), tiny_tokenizer()
    b.add_tokens(["<|extra|>"])
    with pytest.raises(TokenizerMismatchError, match="'small'.*'large'") as err:
        check_same_tokenizer(a, "small", b, "large")
    assert "<|extra|>" in str(err.value) and "259 vs 260" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_check_same_tokenizer_names_first_differing_token():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    a = tiny_tokenizer()
    vocab = {t: (i + 5) % 259 for t, i in a.get_vocab().items()}  # same tokens, shifted ids
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|pad|>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    b = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|eos|>")
    first = next(t for t, i in sorted(a.get_vocab().items(), key=lambda x: x[1]))
    with pytest.raises(TokenizerMismatchError) as err:
        check_same_tokenizer(a, "draft", b, "target")
    msg = str(err.value)
    assert f"token {first!r} has id 0 in 'draft' but 5 in 'target'" in msg
    assert "pick models from one family" in msg


def test_load_model_from_saved_folder(tmp_path):
    model, tok = tiny_model(dtype=torch.float32), tiny_tokenizer()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, tok2 = load_model(tmp_path)
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    assert loaded.dtype == torch.float32
    check_same_tokenizer(tok, "saved", tok2, "loaded")
    ids = torch.tensor([tok.encode("hello")])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    as64, _ = load_model(str(tmp_path), dtype=torch.float64)
    assert as64.dtype == torch.float64


def test_load_model_bad_local_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="neither config.json nor a .gguf"):
        load_model(tmp_path)
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(tmp_path / "missing.gguf")
    (tmp_path / "a.gguf").touch()
    (tmp_path / "b.gguf").touch()
    with pytest.raises(ModelLoadError, match="gguf_file"):
        load_model(tmp_path)


def test_load_model_unreachable_hub_id(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read once at import
    with pytest.raises(ModelLoadError, match="no-such-org/no-such-model") as err:
        load_model("no-such-org/no-such-model")
    assert "local folder" in str(err.value) and ".gguf" in str(err.value)
    assert isinstance(err.value, OSError)


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENROUTER_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c" and not (tmp_path / "c").exists()
    monkeypatch.delenv("TOKENROUTER_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "tokenrouter"
