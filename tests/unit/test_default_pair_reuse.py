"""`default_pair(reuse=True)` (what `Router.default` uses): the same objects while something
holds them and they are as loaded; a fresh load once they are gone, changed, or their files
changed. The loader is replaced by a counting one over a tiny model."""

import gc

import pytest
import torch

from tokenrouter_sdk import models
from tokenrouter_sdk.models import tiny_model, tiny_tokenizer


@pytest.fixture
def loads(tmp_path, monkeypatch):
    """Count of loads; `default_pair` reads a fake model folder and builds a tiny model."""
    folder = tmp_path / "smollm2-135m-instruct"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    count = {"n": 0, "folder": folder}

    def load(source, *, dtype=torch.float32, device="cpu", gguf_file=None):
        assert source == folder
        count["n"] += 1
        return tiny_model(num_layers=3, seed=count["n"], dtype=dtype), tiny_tokenizer()

    monkeypatch.setattr(models, "smollm2_folder", lambda cache=None: folder)
    monkeypatch.setattr(models, "load_model", load)
    monkeypatch.setattr(models, "_REUSABLE", {})
    return count


def _pair(**kw):
    return models.default_pair(small_layers=2, reuse=True, **kw)


def test_same_objects_while_held_and_unchanged(loads):
    first = _pair()
    assert loads["n"] == 1
    again = _pair()
    assert loads["n"] == 1 and all(a is b for a, b in zip(first, again))
    assert models.default_pair(small_layers=2)[0] is not first[0] and loads["n"] == 2  # reuse off: a load
    assert _pair()[0] is first[0] and loads["n"] == 2
    assert _pair(dtype=torch.float64)[0] is not first[0] and loads["n"] == 3  # another key
    other_depth = models.default_pair(small_layers=1, reuse=True)
    assert other_depth[0] is not first[0] and loads["n"] == 4


def test_nothing_is_kept_alive(loads):
    large, small, tok = _pair()
    del large, small, tok
    gc.collect()
    assert _pair() and loads["n"] == 2
    assert len(models._REUSABLE) == 1  # the dead entry was dropped


def _modify_in_place(large, small, tok):
    with torch.no_grad():
        next(large.parameters()).add_(1.0)


def _replace_data(large, small, tok):
    p = next(large.parameters())
    p.data = p.data.clone()


def _trainable(large, small, tok):
    next(small.parameters()).requires_grad_(True)


def _train_mode(large, small, tok):
    small.train()


def _hook(large, small, tok):
    large.model.layers[0].register_forward_hook(lambda *a: None)


def _patched_forward(large, small, tok):
    mlp = small.model.layers[0].mlp
    mlp.forward = lambda x, _f=mlp.forward: _f(x) * 0


def _swapped_class(large, small, tok):
    norm = large.model.norm
    norm.__class__ = type("Scaled", (type(norm),), {"forward": lambda self, x: 2 * super(type(self), self).forward(x)})


def _replace_module(large, small, tok):
    large.model.norm = type(large.model.norm)(large.config.hidden_size)


def _new_token(large, small, tok):
    tok.add_tokens(["<|new|>"])


@pytest.mark.parametrize(
    "change",
    [
        _modify_in_place,
        _replace_data,
        _trainable,
        _train_mode,
        _hook,
        _patched_forward,
        _swapped_class,
        _replace_module,
        _new_token,
    ],
)
def test_a_changed_pair_is_loaded_again(loads, change):
    first = _pair()
    change(*first)
    again = _pair()
    assert loads["n"] == 2 and again[0] is not first[0] and again[2] is not first[2]
    assert _pair()[0] is again[0] and loads["n"] == 2


def test_moving_weights_to_shared_memory_keeps_the_pair(loads):
    """What sub-server processes do to the weights (`Tensor.share_memory_`) is no change."""
    first = _pair()
    for p in first[0].parameters():
        p.share_memory_()
    assert _pair()[0] is first[0] and loads["n"] == 1


def test_changed_files_are_loaded_again(loads):
    first = _pair()
    (loads["folder"] / "model.safetensors").write_bytes(b"other weights")
    assert _pair()[0] is not first[0] and loads["n"] == 2
