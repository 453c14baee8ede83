"""Random-weight models of real architectures, built from their configs in code (no download).

For speed and memory benchmarks on a GPU (e.g. Qwen3-0.6B and Qwen3-8B built from their
configs): step latency, KV size and batching behaviour depend on the architecture and
the shapes, not on the weights, so a random-weight model of the exact shape measures the same
thing as the released checkpoint without a model hub. Text out of such a model is noise; route
with a content-blind policy (`RandomRouting`) and feed token-id prompts (`random_prompts`).

The shapes are those of the released ``config.json`` files (Qwen3 technical report, arXiv
2505.09388, Table 1): vocabulary 151,936, head_dim 128, 8 KV heads, rope theta 1e6.
"""

from __future__ import annotations

import torch

QWEN3_COMMON = dict(
    vocab_size=151936,
    head_dim=128,
    num_key_value_heads=8,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    hidden_act="silu",
    bos_token_id=151643,
    eos_token_id=151645,
    attention_bias=False,
)

#: name -> the fields of its config that differ between sizes (parameter counts in the comments,
#: as `count_parameters` gives them on the meta device).
QWEN3_SHAPES: dict[str, dict] = {
    "qwen3-0.6b": dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, tie_word_embeddings=True
    ),  # 0.596 B
    "qwen3-1.7b": dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, tie_word_embeddings=True
    ),  # 1.72 B
    "qwen3-4b": dict(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, tie_word_embeddings=True
    ),  # 4.02 B
    "qwen3-8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        tie_word_embeddings=False,
    ),  # 8.19 B
    "qwen3-14b": dict(
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=40,
        num_attention_heads=40,
        tie_word_embeddings=False,
    ),  # 14.8 B
}


def random_config(name: str, **overrides):
    """The `transformers.Qwen3Config` of a released Qwen3 size.

    Args:
        name: one of `QWEN3_SHAPES` (``"qwen3-0.6b"``, ``"qwen3-1.7b"``, ``"qwen3-4b"``,
            ``"qwen3-8b"``, ``"qwen3-14b"``).
        overrides: config fields to change (e.g. ``num_hidden_layers=2`` for a fast test).

    Raises:
        ValueError: unknown name (lists the known ones).
    """
    from transformers import Qwen3Config

    key = name.lower()
    if key not in QWEN3_SHAPES:
        raise ValueError(f"unknown model shape {name!r}; choose one of {sorted(QWEN3_SHAPES)}")
    return Qwen3Config(**(QWEN3_COMMON | QWEN3_SHAPES[key] | overrides))


def count_parameters(name: str, **overrides) -> int:
    """Parameters of the model `random_model` builds (counted on the meta device: no memory)."""
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        model = Qwen3ForCausalLM._from_config(random_config(name, **overrides))
    return sum(p.numel() for p in model.parameters())


def random_model(name: str, *, dtype: torch.dtype = torch.bfloat16, device: str = "cuda", seed: int = 0, **overrides):
    """A random-weight ``Qwen3ForCausalLM`` of a released size, allocated and initialised directly
    on ``device`` (transformers' own init: normal(0, 0.02) weights).

    Memory: about 2 bytes per parameter in bf16 (Qwen3-8B: 16.4 GB). The global RNG state is left
    untouched; weights depend only on ``seed``, ``name`` and the overrides.

    Returns:
        the model in eval mode with ``requires_grad=False``.

    Raises:
        ValueError: unknown name.
    """
    from transformers import Qwen3ForCausalLM

    cfg = random_config(name, **overrides)
    dev = torch.device(device)
    devices = [dev.index or 0] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        with dev:
            model = Qwen3ForCausalLM._from_config(cfg, dtype=dtype)
    return model.eval().requires_grad_(False)


def id_tokenizer(vocab_size: int = QWEN3_COMMON["vocab_size"], eos_token_id: int = QWEN3_COMMON["eos_token_id"]):
    """A tokenizer whose token i is the word ``<i>`` (for random-weight models fed token ids).

    Decoding never fails for ids below ``vocab_size``; encoding text only knows ``<i>`` words.
    No chat template: string prompts are tokenized as they are.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if not 0 <= eos_token_id < vocab_size:
        raise ValueError(f"eos_token_id {eos_token_id} is outside the vocabulary [0, {vocab_size})")
    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=f"<{eos_token_id}>", unk_token="<0>")


def random_prompts(
    n: int,
    length: int,
    vocab_size: int = QWEN3_COMMON["vocab_size"],
    seed: int = 0,
    avoid: tuple[int, ...] = (QWEN3_COMMON["eos_token_id"],),
) -> list[list[int]]:
    """``n`` token-id prompts of ``length`` ids each, uniform over the vocabulary minus ``avoid``
    (seeded, independent of the global RNG)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab_size, (length,), generator=g).tolist()
        out.append([i if i not in avoid else (i + 1) % vocab_size for i in ids])
    return out
