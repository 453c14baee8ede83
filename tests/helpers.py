"""Shared test helpers: prompt sets, scripted runners and policies, the reference check and the
KV pools' free blocks.

Import them as ``from tests.helpers import ...`` (the fixtures live in conftest.py files)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import torch

from tokenrouter_sdk import Handoff, Policy, SamplingParams
from tokenrouter_sdk.engine.runner import ForwardOut, PoolShape
from tokenrouter_sdk.reference import reference_generate


def mixed_prompts(n, seed=0, vocab=259):
    """``n`` token-id prompts of mixed lengths (1 to 40 tokens), ids in [3, vocab)."""
    g = torch.Generator().manual_seed(seed)
    lens = [1, 2, 5, 9, 17, 33, 3, 12, 40, 7][:n] + [4] * max(0, n - 10)
    return [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lens]


def assert_matches_reference(models, outs, policy_factory, params: SamplingParams, eos_ids=(), tokenizer=None):
    """Each output's tokens, writers, hops and finish reason equal the naive reference's."""
    for o in outs:
        ref = reference_generate(models, list(o.prompt), policy_factory(), params, eos_ids=eos_ids, tokenizer=tokenizer)
        assert o.token_ids == ref["token_ids"], (o.index, o.token_ids, ref["token_ids"])
        assert o.token_models == ref["token_models"], o.index
        assert o.hops == ref["hops"] and o.discarded == ref["discarded"], o.index
        assert o.finish_reason == ref["finish_reason"], (o.index, o.finish_reason, ref["finish_reason"])


class ScriptedRunner:
    """A runner (the `tokenrouter_sdk.engine.Runner` protocol) whose next token is a function of
    the position: ``script(position)`` (or ``script[position - offset]`` for a list, then
    ``after``). Logits are one-hot at that token (``peak`` above the rest), so greedy decoding
    writes the script exactly; ``delay_s`` sleeps in every forward (to abort mid-run).

    Args:
        script: callable position -> token id, or a list of token ids written from position
            ``offset`` on.
        vocab_size: logits width (may exceed the tokenizer's: padding rows).
        after: token written past the end of a list script.
        pad_peak: if set, logits of ids >= ``pad_from`` get this value (padding rows that
            win every draw unless the engine masks them).
    """

    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(
        self,
        script,
        *,
        vocab_size=259,
        offset=0,
        after=257,
        max_kv_tokens=4096,
        block_size=16,
        max_context=512,
        delay_s=0.0,
        peak=30.0,
        pad_from=None,
        pad_peak=None,
    ):
        self.script, self.offset, self.after = script, offset, after
        self.vocab_size, self.max_context = vocab_size, max_context
        self.pool = PoolShape(-(-max_kv_tokens // block_size), block_size)
        self.delay_s, self.peak = delay_s, peak
        self.pad_from, self.pad_peak = pad_from, pad_peak
        self.last_forward_s = 0.0
        self.forwards = 0
        self.fed: list[list[int]] = []

    def token_at(self, pos: int) -> int:
        if callable(self.script):
            return int(self.script(pos))
        i = pos - self.offset
        return int(self.script[i]) if 0 <= i < len(self.script) else self.after

    def forward(self, seqs):
        t0 = time.perf_counter()
        if self.delay_s:
            time.sleep(self.delay_s)
        self.forwards += 1
        logits = torch.zeros(len(seqs), self.vocab_size)
        for i, s in enumerate(seqs):
            if any(t >= self.vocab_size or t < 0 for t in s.tokens):
                raise IndexError(f"index out of range in self (token ids {s.tokens})")
            self.fed.append(list(s.tokens))
            pos = s.start + len(s.tokens)
            logits[i, self.token_at(pos)] = self.peak
            if self.pad_peak is not None:
                logits[i, self.pad_from :] = self.pad_peak
        self.last_forward_s = time.perf_counter() - t0
        return ForwardOut(logits, torch.zeros(len(seqs), 4))

    def release(self):
        self.pool.release()


class Alternate(Policy):
    """Small writes even positions, large odd ones; the sampled token is kept on every hop."""

    def route(self, step):
        return step.models[step.position % 2]

    def send(self, req, target):
        return Handoff(keep_sampled=True)


class StayOn(Policy):
    """Every request enters and stays on ``model``."""

    def __init__(self, model):
        self.model = model

    def entry(self, req, models):
        return self.model

    def route(self, step):
        return self.model


class HandTo(Policy):
    """The entry model hands every request to ``target`` after ``after`` tokens, which keeps it."""

    def __init__(self, target, after=1):
        self.target, self.after = target, after

    def route(self, step):
        return self.target if step.position >= self.after else step.model

    def send(self, req, target):
        return Handoff(keep_sampled=True)


class KeepEveryThird(Policy):
    """Hands off on every third position, keeping the sampled token."""

    def route(self, step):
        return step.position % 3 == 2

    def send(self, req, target):
        return Handoff(keep_sampled=True)


class DiscardTwoBack(Policy):
    """small hands off (discarding) when the token id is even; large writes 2 tokens on its own
    route (no span), then hands back keeping its token."""

    def route(self, step):
        if step.model == "small":
            return "large" if step.token % 2 == 0 else "small"
        st = step.state
        st["large_run"] = st.get("large_run", 0) + 1
        if st["large_run"] >= 2:
            st["large_run"] = 0
            return "small"
        return "large"

    def send(self, req, target):
        return Handoff(keep_sampled=(req.owner == "large"))


class Cycle3(Policy):
    """Three models: next writer = models[(token + position) % 3], keeping the token; on
    every fifth position the first handoff discards instead (the next writer regenerates it)."""

    def route(self, step):
        return step.models[(step.token + step.position) % 3]

    def send(self, req, target):
        if req.n_generated % 5 == 4 and req.state.get("discarded_at") != req.n_generated:
            req.state["discarded_at"] = req.n_generated
            return Handoff(keep_sampled=False)
        return Handoff(keep_sampled=True)


def pools_free(router, timeout=10.0) -> dict:
    """Wait until the engine holds no request; return per model (free, usable) KV blocks."""
    assert router.engine.wait_idle(timeout), "the engine still holds requests"
    deadline = time.perf_counter() + timeout
    while True:
        st = router.kv_stats()
        out = {m: (s.free_blocks, s.num_blocks) for m, s in st.items()}
        if all(f == n for f, n in out.values()) or time.perf_counter() > deadline:
            return out
        time.sleep(0.02)


def run_script(tmp_path, source: str, name: str, timeout: float) -> subprocess.CompletedProcess:
    """Run ``source`` (dedented) as a fresh Python script ``tmp_path/name`` in ``tmp_path``, with
    this interpreter's import path and without $TOKENROUTER_PROCESSES; stdout/stderr captured."""
    script = tmp_path / name
    script.write_text(textwrap.dedent(source))
    env = {k: v for k, v in os.environ.items() if k != "TOKENROUTER_PROCESSES"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path
    )


def interrupt_main_after(seconds: float):
    """Start a timer that raises KeyboardInterrupt in the main thread after ``seconds``, as Ctrl-C
    does. A process started in the background inherits SIGINT ignored, and then
    `_thread.interrupt_main` does nothing; Python's default handler is installed for the test
    and the previous one restored when the timer's context ends. Use as a context manager."""
    import _thread
    import contextlib
    import signal
    import threading

    @contextlib.contextmanager
    def ctx():
        old = signal.signal(signal.SIGINT, signal.default_int_handler)
        timer = threading.Timer(seconds, _thread.interrupt_main)
        timer.start()
        try:
            yield timer
        finally:
            timer.cancel()
            signal.signal(signal.SIGINT, old)

    return ctx()


# the tiny template, plus an empty think block when thinking is switched off (as Qwen3's does)
THINKING_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def thinking_tokenizer():
    """The tiny tokenizer with a template that reads ``enable_thinking`` (``THINKING_TEMPLATE``)."""
    from tokenrouter_sdk.models import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.chat_template = THINKING_TEMPLATE
    return tok


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie its parent has not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def save_tiny_pair(root) -> list[str]:
    """A float32 tiny pair saved to folders (small: 1 layer, large: 2 layers, each with the tiny
    tokenizer), for commands that take ``--model NAME=FOLDER``; returns the two folders."""
    from tokenrouter_sdk.models import tiny_model, tiny_tokenizer

    out = []
    for name, layers, seed in (("small", 1, 3), ("large", 2, 4)):
        m = tiny_model(num_layers=layers, seed=seed, dtype=torch.float32, max_position_embeddings=2048)
        m.save_pretrained(root / name)
        tiny_tokenizer().save_pretrained(root / name)
        out.append(str(root / name))
    return out


# -- models that do not share a tokenizer: two toy tokenizers with merges ----------------------
TOY_LETTERS = "etaoinshrdlu"
TOY_TEMPLATE_A = (
    "{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|bot|>{% endif %}"
)
TOY_TEMPLATE_B = (
    "{% for m in messages %}<s>[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>[assistant] {% endif %}"
)
TOY_FAVOURED = [*" etaoinshrd", "é", "你好", "🙂"]  # text the toy models are biased to write


def byte_level_toy():
    """A byte-level BPE tokenizer built in code (GPT-2 byte alphabet, ids 0..255 = the bytes,
    merges of common letter pairs, ``Ġt``/``the``, ``é`` (2 bytes) and ``你`` (3 bytes)), three
    special tokens and its own chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tokenrouter_sdk.byte_vocab import byte_level_map

    cmap = {b: c for c, b in byte_level_map().items()}
    vocab, merges = {cmap[b]: b for b in range(256)}, []

    def merge(a, b):
        vocab.setdefault(a + b, len(vocab))
        merges.append((a, b))

    for a in "ethai":
        for b in "nrsto":
            merge(a, b)
    sp = cmap[32]
    for a, b in (
        (sp, "t"),
        (sp + "t", "h"),
        ("t", "h"),
        ("th", "e"),
        (sp, "a"),
        (cmap[0xC3], cmap[0xA9]),
        (cmap[0xE4], cmap[0xBD]),
        (cmap[0xE4] + cmap[0xBD], cmap[0xA0]),
    ):
        merge(a, b)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<|user|>", "<|bot|>", "<|end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|user|>", eos_token="<|end|>", pad_token="<|end|>")
    tok.chat_template = TOY_TEMPLATE_A
    return tok


def sentencepiece_toy(byte_fallback: bool = True, prepend: bool = False):
    """A SentencePiece-style BPE tokenizer built in code: ``▁`` for a space, ``<0xNN>`` byte
    tokens (with ``byte_fallback``), single characters (``é``, ``你``, ``好``, ``🙂`` among them) and
    merges that span words (``▁th``, ``the▁``, ``ere▁``, ``▁▁``, ``你好``), its own special tokens and
    chat template. ``prepend``: a Metaspace pre-tokenizer that adds ``▁`` in front of the text
    (a tokenizer that changes text, for the refusal test)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab, merges = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}, []
    if byte_fallback:
        for b in range(256):
            vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in "▁" + TOY_LETTERS + "bcfgkmpvwxyz.,!?" + "é你好🙂ß":
        vocab.setdefault(c, len(vocab))

    def merge(a, b):
        vocab.setdefault(a + b, len(vocab))
        merges.append((a, b))

    for a in "▁" + TOY_LETTERS[:8]:
        for b in TOY_LETTERS[:8]:
            merge(a, b)
    for a, b in (
        ("▁t", "h"),
        ("▁th", "e"),
        ("th", "e"),
        ("▁the", "▁"),
        ("你", "好"),
        ("▁", "▁"),
        ("e", "r"),
        ("er", "e"),
        ("ere", "▁"),
    ):
        merge(a, b)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=byte_fallback, unk_token="<unk>"))
    if prepend:
        tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=False)
        tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=False)
    else:
        tk.normalizer = normalizers.Replace(" ", "▁")
        tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tk.add_special_tokens(["<pad>", "<s>", "</s>", "<unk>"])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.chat_template = TOY_TEMPLATE_B
    return tok


def toy_lm(tok, seed: int, favour=TOY_FAVOURED, boost: float = 3.0, arch: str = "llama", **kw):
    """A tiny random float64 model over ``tok``'s vocabulary (its bos/eos/pad ids) whose LM-head
    rows of the tokens of ``favour`` are scaled by ``boost`` (so it writes letters, spaces and
    multi-byte characters often: merges and handoffs inside characters happen)."""
    from tokenrouter_sdk.models import tiny_model

    m = tiny_model(
        arch=arch,
        vocab_size=len(tok),
        seed=seed,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **kw,
    )
    ids = sorted({i for t in favour for i in tok.encode(t, add_special_tokens=False)})
    with torch.no_grad():
        m.get_output_embeddings().weight[ids] *= boost
    return m
