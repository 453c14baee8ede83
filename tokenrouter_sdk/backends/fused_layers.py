"""Decoder layers in one or three calls (``csrc/decoder_layer.cpp``) for the native forward's
eager float32 steps on a CPU where every projection of the layer runs the few-row kernel at the
step's row count: one C++ call when the CPU paged kernel attends every request in place
(decodes and short extends); otherwise one call for the work before attention (norm, q/k/v,
rotary, the K/V store), `attend_tokens` as in the loop, and one call for the work after it.
When every layer of a step takes one call and nothing runs between two layers (core lending's
``between_layers``), the whole stack is one call (`LayerCalls.run_stack`, ``decoder_stack``).

The call runs the same kernels as the Python loop (`native_forward.decoder_step` with
`cpu_kernels.StepOps`), in the same order on the same tensors, so a layer's output is the same
bits either way; what it removes is the loop's Python and the dispatch of its ops (eleven a layer).
What that saves is measured in ``docs/benchmarks.md`` ("By CPU family").

``TOKENROUTER_FUSED_LAYERS=0`` turns it off (for A/B measurements); it is read when a
`LayerCalls` is made, once per native forward.
"""

from __future__ import annotations

import operator
import os

import torch

from .attention import cpu_kernel
from .attention.interface import attend_tokens
from .attention.metadata import ForwardBatch

_KERNEL_ATTEND, _KERNEL_STORE = cpu_kernel.CpuKernel.attend, cpu_kernel.CpuKernel.store


def enabled() -> bool:
    """Whether fused layers may run (``TOKENROUTER_FUSED_LAYERS`` is not ``0``)."""
    return os.environ.get("TOKENROUTER_FUSED_LAYERS", "1").strip() != "0"


class LayerCalls:
    """The fused layer calls of one model's decoder (what does not change from step to step).

    Args:
        dec: the decoder (``layers``, each with ``self_attn``, ``mlp`` and two RMSNorms; Qwen3's
            attention also with ``q_norm``/``k_norm``).
        projections: `NativeForward.projections` (per layer q/k/v, o, gate/up, down).
    """

    def __init__(self, dec, projections: list):
        self.layers = []
        for i, ly in enumerate(dec.layers):
            a = ly.self_attn
            qkv, o, gate_up, down = projections[4 * i : 4 * i + 4]
            d = a.head_dim
            heads = [qkv.sizes[0] // d, qkv.sizes[1] // d, d, gate_up.sizes[0]]
            norms = [ly.input_layernorm, ly.post_attention_layernorm]
            if hasattr(a, "q_norm"):
                norms += [a.q_norm, a.k_norm]
            self.layers.append((a.layer_idx, (qkv, o, gate_up, down), norms, heads))
        self._projs = [p for ly in self.layers for p in ly[1]]
        self._norms = [n for ly in self.layers for n in ly[2]]
        # (what `_stack_parts` made its arguments from, the arguments): one attribute, so that
        # a reader never pairs one step's record with another step's arguments
        self._stack: tuple = ((), None)

    @staticmethod
    def mode(fb: ForwardBatch) -> str | None:
        """How the step's layers run: ``"whole"`` (one call: the CPU kernel attends every request,
        no gathered decode or segment), ``"split"`` (the calls before and after attention, which
        runs in Python), or None (the loop: a paged kernel other than the one shipped, whose
        ``store`` and ``attend`` must run as they are). The kernel as shipped: its class, its
        C++ op and its own methods (a subclass, another op or a wrapped method, as a test's spy,
        is another)."""
        if fb.kern is None:
            return "split"
        k = fb.kern.backend
        if not (
            type(k) is cpu_kernel.CpuKernel
            and k.op is torch.ops.tokenrouter_cpu.paged_attention
            and cpu_kernel.CpuKernel.store is _KERNEL_STORE
            and "store" not in vars(k)
        ):
            return None
        whole = (
            not fb.segs
            and fb.dec_q is None
            and cpu_kernel.CpuKernel.attend is _KERNEL_ATTEND
            and "attend" not in vars(k)
        )
        return "whole" if whole else "split"

    @staticmethod
    def _skinny(p, w, rows: int) -> bool:
        """Whether projection ``p`` runs the few-row kernel on ``w`` (its ``skinny`` as read once:
        another runner sharing the projection may drop it meanwhile) at ``rows`` rows."""
        return w is not None and p._path(rows, w) == "skinny"

    def _weights(self, i: int, rows: int) -> list | None:
        """Layer ``i``'s few-row weights (q/k/v, o, gate/up, down), or None when one of its
        projections does not run the few-row kernel at ``rows`` rows."""
        projs = self.layers[i][1]
        ws = [p.skinny for p in projs]
        return ws if all(self._skinny(p, w, rows) for p, w in zip(projs, ws)) else None

    def _stack_parts(self, rows: int, layer_params) -> tuple | None:
        """The step-invariant arguments of ``decoder_stack`` at ``rows`` rows: (per layer the
        few-row weights [q/k/v, o, gate/up, down], the biases, the heads, the layer indices,
        scale, window, softcap), or None when a projection does not run the few-row
        kernel at ``rows`` rows. Made again when the rows, a projection's rule or few-row weight,
        whether it has a packed weight, or the layers' parameters (``layer_params``:
        `ForwardBatch.layers`) are other than last time."""
        projs = self._projs
        sk = [p.skinny for p in projs]  # read once: another runner sharing a projection may drop it meanwhile
        rules = [p.rule for p in projs]
        unpacked = [p.packed is None for p in projs]
        held, kept = self._stack
        if (
            held
            and held[0] == rows
            and held[1] is layer_params
            and all(map(operator.is_, sk, held[2]))
            and all(map(operator.is_, rules, held[3]))
            and unpacked == held[4]
        ):
            return kept
        args = None
        if all(self._skinny(p, w, rows) for p, w in zip(projs, sk)):
            b, heads, layers, scale, window, softcap = [], [], [], [], [], []
            for layer, lp, _, hs in self.layers:
                b += [q.bias for q in lp]
                heads += hs
                layers.append(layer)
                p = layer_params[layer]
                scale.append(p.scale)
                window.append(p.window or 0)
                softcap.append(p.softcap or 0.0)
            args = (sk, b, heads, layers, scale, window, softcap)
        self._stack = ((rows, layer_params, sk, rules, unpacked), args)
        return args

    def run_stack(self, fb: ForwardBatch, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Every layer of a step in one C++ call (``decoder_stack``: each layer as `run`'s one
        call, in order): x [T, C] contiguous float32 -> the last layer's output [T, C]; cos, sin as
        `run`'s. For a step where `mode` said ``"whole"`` and nothing runs between two layers.
        The norms' weights and epsilons are read at every call, as the loop's norms read them.
        Returns None, having done nothing, when a projection of some layer does not run the
        few-row kernel at T rows or x is not contiguous (the caller runs the layers one by one)."""
        if not x.is_contiguous():
            return None
        parts = self._stack_parts(x.shape[0], fb.layers)
        if parts is None:
            return None
        ws, b, heads, layers, scale, window, softcap = parts
        pf = self._projs[0].prefetch.at(x.shape[0])  # one machine's measured choice: the same for every projection
        w = []
        for j, (_, _, norms, _) in enumerate(self.layers):
            nw = [n._parameters["weight"] for n in norms]  # what ``n.weight`` reads (a parameter is never elsewhere)
            q, o, gu, dn = ws[4 * j : 4 * j + 4]
            w += [nw[0], q, o, nw[1], gu, dn, *nw[2:]]
        eps = [float(n.variance_epsilon) for n in self._norms]  # read at every call, as the loop's norms do
        kern = fb.kern
        return torch.ops.tokenrouter_cpu.decoder_stack(
            x,
            w,
            b,
            eps,
            heads,
            cos,
            sin,
            fb.pool.k,
            fb.pool.v,
            layers,
            fb.slot_mapping,
            kern.table,
            kern.q_start,
            kern.q_len,
            kern.kv_len,
            scale,
            window,
            softcap,
            cpu_kernel.CHUNK,
            kern.backend.tile_from,
            pf,
        )

    def run(self, fb: ForwardBatch, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, whole: bool):
        """Layer ``i`` of a step: x [T, C] contiguous float32 -> the layer's output [T, C]; cos,
        sin [T, D] (sin with rotate_half's signs folded in). ``whole``: `mode` said ``"whole"``
        for ``fb``, and the layer is one call; otherwise (``"split"``) the work before attention
        is one call, the attention `attend_tokens` (on the K/V that call stored) and the work
        after it one more.
        Returns None, having done nothing, when one of the layer's projections does not run the
        few-row kernel at T rows, or x is not contiguous (the caller runs the layer in Python)."""
        layer, projs, norms, heads = self.layers[i]
        rows = x.shape[0]
        if not x.is_contiguous():
            return None
        ws = self._weights(i, rows)
        if ws is None:
            return None
        ops = torch.ops.tokenrouter_cpu
        pf = projs[0].prefetch.at(rows)  # one machine's measured choice: the same for every projection
        n0, n1 = norms[0].weight, norms[1].weight
        qk = [n.weight for n in norms[2:]]  # Qwen3's q/k norms, or none
        eps = [float(n.variance_epsilon) for n in norms]  # read at every call, as the loop's norms do
        kc, vc, p = fb.pool.k[layer], fb.pool.v[layer], fb.layers[layer]
        if whole:
            kern = fb.kern
            return ops.decoder_layer(
                x,
                [n0, ws[0], ws[1], n1, ws[2], ws[3], *qk],
                [q.bias for q in projs],
                eps,
                heads,
                cos,
                sin,
                kc,
                vc,
                fb.slot_mapping,
                kern.table,
                kern.q_start,
                kern.q_len,
                kern.kv_len,
                p.scale,
                cpu_kernel.CHUNK,
                p.window or 0,
                p.softcap or 0.0,
                kern.backend.tile_from,
                pf,
            )
        q, k, v = ops.layer_qkv(
            x, [n0, ws[0], *qk], projs[0].bias, [eps[0], *eps[2:]], heads, cos, sin, kc, vc, fb.slot_mapping, pf
        )
        y = attend_tokens(fb, layer, q, k, v, stored=True)
        return ops.layer_mlp(
            y.reshape(rows, -1),
            x,
            [ws[1], n1, ws[2], ws[3]],
            [projs[1].bias, projs[2].bias, projs[3].bias],
            eps[1],
            heads[3],
            pf,
        )
