"""Decode and short-extend steps replayed from captured CUDA graphs, one graph per bucket.

Why: on a GPU a decode step of a small model is host-bound: most of the step is Python and
kernel launches, not GPU work (measured in ``docs/benchmarks.md``, "Recorded results", GPU).
vLLM and SGLang capture decode steps as CUDA graphs for this reason (nano-vllm's
``capture_cudagraph`` is the smallest example); this module does the same for `TorchRunner`.
Routing adds short extends: a model that takes a request back feeds the tokens its peer wrote
meanwhile (about 1/p of them under `RandomRouting` with probability p). So a bucket also fixes
the tokens fed per request, and a large model's hop-back steps replay a graph too.

How: a graph needs fixed shapes and fixed tensor addresses. A step of b requests, each feeding at
most q tokens, whose longest context is n tokens, runs in the bucket (B, Q, L): B = the next
power of two >= b (up to ``max_batch``), Q = the next power of two >= q (up to ``max_query``),
L = the next power of two >= n (at least ``min_context``). Each bucket owns static input
buffers; a step copies its token ids, positions, KV slots and last-token indices into them (one
host-to-device copy) and replays the graph, which builds the key masks from the positions (one
per window of the model: a windowed layer's mask also hides the keys its window has left), runs
the whole decoder, the paged attention (every request's Q queries against its L keys, with each
layer's window, soft-cap and scale) and the LM head on the last token of each request (the
runner applies the final-logit soft-cap to the graph's logits).

Padding: tokens a request does not feed, and whole padding requests (b..B-1), feed token 0 and
write their K/V to the first slot of the pool's scratch block (`KVPool` ``scratch_blocks``: never
handed to a request). Masked-out keys and a padding request's keys read the block's second slot,
which nothing writes (zeros), so no NaN or infinity can reach a real query through a masked key.
A padding token repeats its request's last position. Real requests' KV is never touched, and a
request's logits are the eager path's up to floating-point reassociation.

Steps with a longer feed (prefills), more than ``max_batch`` requests, more than
``max_tokens`` padded tokens (B x Q) or more than ``max_kv_tokens`` padded keys (B x L) run
eagerly. Graphs are captured lazily, the first time a bucket is used, on the runner's own stream,
and share one CUDA memory pool per runner (outputs are copied out before the next replay, as
vLLM does).

On a device other than CUDA the same fixed-shape path runs eagerly (``capture=False``): that is
how the tests check the padding and masking on the CPU, against the eager forward and the naive
reference.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
import weakref
from dataclasses import dataclass

import torch

from .attention import DecodeView, ForwardBatch, paged_mask

# CUDA allows one stream capture at a time per process, and the capture state of the CUDA runtime
# is process-wide; sub-servers in threads of one process (processes=False) take turns here.
_CAPTURE_LOCK = threading.Lock()


@dataclass
class _Bucket:
    """Static buffers of one (B, Q, L) bucket. The int64 inputs are views of one device buffer
    ``buf`` filled from ``host`` (pinned on CUDA) by one copy per step: ids, pos [1, B*Q];
    slots [B*Q]; kv [B, L]; last [B] (packed index of each request's last fed token). ``masks``
    [B, 1, Q, L] (bool, True = attend), one per window of the model (``windows``), are computed
    from ``pos`` inside the graph; logits [B, V] and hidden [B, H] are the graph's outputs."""

    buf: torch.Tensor
    host: torch.Tensor
    ids: torch.Tensor
    pos: torch.Tensor
    slots: torch.Tensor
    kv: torch.Tensor
    last: torch.Tensor
    keys: torch.Tensor  # arange(L) on the device
    masks: tuple
    windows: tuple
    batch: object  # the ForwardBatch the graph reads
    attn_mask: torch.Tensor  # the prepared (empty) 4D mask handed to the decoder
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    graph: object = None


class DecodeGraphs:
    """Fixed-shape decode and short-extend steps for one `TorchRunner`, replayed from CUDA graphs.

    Args:
        runner: the `TorchRunner`; its pool must have a scratch block of at least 2 slots
            (``TorchRunner(cuda_graphs=True)`` allocates it): padding writes go to the first,
            masked-out and padding keys read the second, which is never written (zeros), so a
            padding row that produced NaN could not reach a real request through a masked key.
        capture: capture CUDA graphs (CUDA devices only); False runs the fixed-shape path eagerly.
        max_batch: largest batch bucket B, requests.
        max_query: largest tokens-fed-per-request bucket Q, tokens (longer feeds run eagerly).
        min_context: smallest context bucket L, tokens.
        max_tokens: largest B x Q a bucket may pad to, tokens.
        max_kv_tokens: largest B x L a bucket may pad to, tokens (bounds the graph's gather
            buffers: B x L x kv_heads x head_dim per layer for K and for V).

    Attributes:
        captured: graphs captured so far; replays: steps served from a bucket.
        error: why graphs were switched off (the first capture that raised), else None.
        disabled: True after a capture raised: every step runs the runner's eager path.

    Raises:
        ValueError: the pool has no scratch block of 2 slots, ``capture`` on a non-CUDA device, or
            a limit < 1.
    """

    def __init__(
        self,
        runner,
        *,
        capture: bool,
        max_batch: int = 64,
        max_query: int = 32,
        min_context: int = 128,
        max_tokens: int = 1024,
        max_kv_tokens: int = 1 << 16,
    ):
        pool = runner.pool
        if pool.scratch_slot is None or pool.scratch_blocks * pool.block_size < 2:
            raise ValueError(
                "DecodeGraphs needs a KV pool with a scratch block of at least 2 slots: build the "
                "runner with TorchRunner(model, cuda_graphs=True)"
            )
        if capture and runner.device.type != "cuda":
            raise ValueError(f"CUDA graph capture needs a CUDA model, this one is on {runner.device}")
        if min(max_batch, max_query, min_context, max_tokens, max_kv_tokens) < 1:
            raise ValueError(
                f"DecodeGraphs limits must be >= 1, got max_batch={max_batch}, max_query={max_query}, "
                f"min_context={min_context}, max_tokens={max_tokens}, max_kv_tokens={max_kv_tokens}"
            )
        self._runner = weakref.ref(runner)  # the runner owns this object: no reference cycle
        self.capture = capture
        self.write_slot, self.read_slot = pool.scratch_slot, pool.scratch_slot + 1
        self.max_batch, self.max_query, self.min_context = max_batch, max_query, min_context
        self.max_tokens, self.max_kv_tokens = max_tokens, max_kv_tokens
        self.captured = self.replays = 0
        self.error: str | None = None
        self.disabled = False
        self._buckets: dict[tuple[int, int, int], _Bucket] = {}
        self._mempool = None
        self._stream = None  # the capture stream, on the runner's device

    @property
    def runner(self):
        return self._runner()

    # -- bucketing --------------------------------------------------------------------------
    @staticmethod
    def pow2(n: int) -> int:
        """The next power of two >= n (n >= 1)."""
        return 1 << max(0, n - 1).bit_length()

    def bucket(self, seqs) -> tuple[int, int, int] | None:
        """(B, Q, L) for a batch of `SeqInput`, or None when it must run eagerly."""
        if not seqs or len(seqs) > self.max_batch:
            return None
        q = max(len(s.tokens) for s in seqs)
        if q > self.max_query or min(len(s.tokens) for s in seqs) < 1:
            return None
        B, Q = self.pow2(len(seqs)), self.pow2(q)
        L = max(self.min_context, self.pow2(max(s.start + len(s.tokens) for s in seqs)))
        if B > self.max_batch or B * Q > self.max_tokens or B * L > self.max_kv_tokens:
            return None
        return B, Q, L

    # -- buffers, capture, replay --------------------------------------------------------------
    def _new_bucket(self, B: int, Q: int, L: int) -> _Bucket:
        r = self.runner
        dev, long, T = r.device, torch.long, B * Q
        buf = torch.zeros(3 * T + B * L + B, dtype=long, device=dev)
        host = torch.zeros(buf.numel(), dtype=long, pin_memory=dev.type == "cuda")
        ids, pos = buf[:T].view(1, T), buf[T : 2 * T].view(1, T)
        slots, kv = buf[2 * T : 3 * T], buf[3 * T : 3 * T + B * L].view(B, L)
        last = buf[3 * T + B * L :]
        slots.fill_(self.write_slot)
        kv.fill_(self.read_slot)
        last.copy_(torch.arange(B, device=dev) * Q)
        host.copy_(buf)
        spec = r.spec
        masks = tuple(torch.zeros(B, 1, Q, L, dtype=torch.bool, device=dev) for _ in spec.windows)
        fb = ForwardBatch(
            r.pool,
            slots,
            spec.layers,
            spec.view,
            dec_q=torch.arange(T, device=dev),
            dec=tuple(DecodeView(kv, m) for m in masks),
            dec_qlen=Q,
        )
        return _Bucket(
            buf, host, ids, pos, slots, kv, last, torch.arange(L, device=dev), masks, spec.windows, fb, paged_mask(dev)
        )

    def _forward(self, bk: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.runner
        B, _, Q, L = bk.masks[0].shape
        keys, qpos = bk.keys.view(1, 1, 1, L), bk.pos.view(B, 1, Q, 1)
        for w, mask in zip(bk.windows, bk.masks):
            torch.le(keys, qpos, out=mask)  # query at p sees keys <= p
            if w is not None:  # ... and > p - window
                mask.logical_and_(keys > qpos - w)
        out = r.decoder(
            input_ids=bk.ids, position_ids=bk.pos, attention_mask=bk.attn_mask, use_cache=False, tr_batch=bk.batch
        )
        hidden = out.last_hidden_state[0, bk.last]
        return r.lm_head(hidden), hidden

    def _capture(self, bk: _Bucket) -> None:
        """Warm up, then capture ``bk``'s forward on this object's own stream, on the runner's device
        (``capture_begin``/``capture_end`` directly: no device-wide synchronize, and the current
        stream is restored even when the capture fails)."""
        dev = self.runner.device
        with torch.cuda.device(dev):
            if self._stream is None:
                self._stream = torch.cuda.Stream(dev)
                self._mempool = torch.cuda.graph_pool_handle()
            self._stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(self._stream):
                # warm-up (as nano-vllm does per batch size): lazy library initialisation must not
                # happen during capture; the runner's first capture warms up twice
                for _ in range(1 if self.captured else 2):
                    self._forward(bk)
            self._stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: a peer sub-server in a thread of this process may run CUDA work meanwhile
            # (it synchronises its own stream only: a device-wide synchronize would break the capture)
            with _CAPTURE_LOCK, torch.cuda.stream(self._stream):
                graph.capture_begin(pool=self._mempool, capture_error_mode="thread_local")
                try:
                    bk.logits, bk.hidden = self._forward(bk)
                except BaseException:
                    with contextlib.suppress(Exception):  # end the capture; report the first error
                        graph.capture_end()
                    raise
                graph.capture_end()
        bk.graph = graph
        self.captured += 1

    def _get(self, key: tuple[int, int, int]) -> _Bucket | None:
        bk = self._buckets.get(key)
        if bk is not None:
            return bk
        bk = self._new_bucket(*key)
        if self.capture:
            try:
                self._capture(bk)
            except Exception as e:  # noqa: BLE001 - fall back to eager steps, say why once
                self.disabled, self.error = True, f"{type(e).__name__}: {e}"
                self._buckets.clear()
                warnings.warn(
                    f"CUDA graph capture failed, steps run eagerly from now on: {self.error}",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return None
        self._buckets[key] = bk
        return bk

    def _fill(self, bk: _Bucket, seqs) -> None:
        """Write a step's inputs into the bucket's host buffer (vectorised over requests) and copy
        it to the device in one transfer."""
        bsz = self.runner.pool.block_size
        B, L = bk.kv.shape
        Q, b = bk.masks[0].shape[2], len(seqs)
        T, nb, pad = B * Q, -(-L // bsz), B - b
        n = torch.tensor([len(s.tokens) for s in seqs] + [1] * pad)  # [B] tokens fed
        start = torch.tensor([s.start for s in seqs] + [0] * pad)  # [B]
        end = start + n
        tables = torch.tensor([(s.table[:nb] + [0] * nb)[:nb] for s in seqs] + [[0] * nb] * pad)  # [B, nb]
        ar, j = torch.arange(L), torch.arange(Q)
        row = (torch.arange(B) < b)[:, None]  # real requests
        kv = torch.where(row & (ar[None] < end[:, None]), tables[:, ar // bsz] * bsz + ar % bsz, self.read_slot)
        real = row & (j[None] < n[:, None])  # [B, Q] real tokens
        pos = torch.minimum(start[:, None] + j[None], end[:, None] - 1)  # padding repeats the last
        h = bk.host
        h[:T] = torch.tensor([(s.tokens + [0] * Q)[:Q] for s in seqs] + [[0] * Q] * pad).view(-1)
        h[T : 2 * T] = pos.view(-1)
        h[2 * T : 3 * T] = torch.where(real, kv.gather(1, pos), self.write_slot).view(-1)
        h[3 * T : 3 * T + B * L] = kv.view(-1)
        h[3 * T + B * L :] = torch.arange(B) * Q + n - 1
        bk.buf.copy_(h, non_blocking=True)  # the step synchronises its stream before the next fill

    def run(self, seqs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One step through a bucket: (logits [b, V], hidden [b, H]) at the last fed token of each
        of the b requests of ``seqs``, or None when the batch must run eagerly (see `bucket`, or
        after a failed capture)."""
        key = None if self.disabled else self.bucket(seqs)
        if key is None:
            return None
        bk = self._get(key)
        if bk is None:
            return None
        self._fill(bk, seqs)
        t0 = time.perf_counter()
        if bk.graph is not None:
            bk.graph.replay()
        else:
            bk.logits, bk.hidden = self._forward(bk)
        b = len(seqs)
        logits, hidden = bk.logits[:b].clone(), bk.hidden[:b].clone()
        if self.runner.device.type == "cuda":
            torch.cuda.current_stream(self.runner.device).synchronize()
        self.runner.last_forward_s = time.perf_counter() - t0
        self.replays += 1
        return logits, hidden
