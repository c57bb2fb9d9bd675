"""The decoder half of a CPU decode step, and prefill's packed encoder, with each layer in one
compiled call (``kernels.decoder_layer_step`` and ``kernels.encoder_layer_step``, ``csrc/decoder_step.cpp``).

At the row counts of serving (one to a few dozen rows per step) a decode step in eager PyTorch is
mostly fixed cost: each decoder layer is about twenty operators (projections, cache writes,
attention, residual adds, layer norms, the FFN), and each pays a Python call, a module call and a
dispatch of a few microseconds, more than its arithmetic at one row. The compiled layer runs the
same operators on the same values in the same order (the same int8 or oneDNN products, the same
attention kernel, ATen's layer norm), so it gives the same bits as the module path; it only drops
the Python between them. ``step.choose_variant`` picks it (``Variant.FUSED``) for a CPU cache whose
compiled kernels are on, with ``fused_step`` switched on (the ``EngineConfig`` fields in the service;
``MT_CPU_KERNELS`` / ``MT_FUSED_STEP`` for the tools) and no attention weights asked for but
cross-attention's (the service asks for those to place protected spans). ``decode_logits`` then
runs it where the model qualifies, and returns None (the eager step runs) otherwise:

- CPU inference (no gradient, eval mode) on a KV cache whose plan reads keys with the compiled
  attention kernel (``AttentionPlan.kernel``);
- every decoder linear layer prepacked int8 or float32 (``linear.pack_for_inference``) and still
  valid for its weight; bfloat16 and unpacked models take the module path;
- the compiled layer step built (``kernels.decoder_step_op``).

The T5 family's flags (``ModelConfig``: RMSNorm, d_kv, unscaled attention, relative position biases,
the gated-GELU FFN, no biases) run in the same calls: each step's decoder biases are one table per
step from the rows' positions (``attention_plan.relative_bias_rows``), the encoder's one per prefill.

``prefill.encode_packed`` (prefill's encoder, packed sentences) likewise runs each encoder layer in
one call (``encode_packed`` here) when ``fused_step`` is on, under the same conditions.

``tests/test_fused_step.py`` compares the two paths bit for bit (greedy and beam, contiguous and
paged caches, mixed lengths, few and many rows); ``python -m service.bench.fused_step`` times them.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from . import kernels
from .attention_plan import CacheAttention, relative_bias_rows
from .linear import PackedWeight, output_logits

__all__ = ["decode_logits", "encode_packed", "layer_params"]

_ACTIVATION = {"relu": 0, "gelu": 1, "swish": 2, "silu": 2, "gelu_new": 3}
_EMPTY = torch.empty(0)


def _linear_params(m) -> Optional[list[Tensor]]:
    """The six tensors of one linear layer for ``decoder_layer_step`` (see ``csrc/decoder_step.cpp``),
    or None when its prepacked copy is missing, stale or bfloat16."""
    p: Optional[PackedWeight] = getattr(m, "packed", None)   # None: a plain nn.Linear
    if p is None or not p.valid_for(m.weight) or p.dtype == torch.bfloat16:
        return None
    bias = _EMPTY if m.bias is None else m.bias.detach()
    if p.dtype == torch.int8:
        small = p.small if p.small is not None else (_EMPTY, _EMPTY)
        # without a row-major copy (a compiled int8 layer takes every row count) the C++ fallback
        # multiplies with the column-major view: the same exact products
        return [p.packed, p.packed if p.packed_rows is None else p.packed_rows, *small, p.scale, bias]
    return [p.packed, _EMPTY, _EMPTY, _EMPTY, _EMPTY, bias]


def _linears(layer) -> tuple:
    """A decoder or encoder layer's linear layers, in the order of ``csrc/decoder_step.cpp``: self W_Q,
    W_KV, W_O, (decoder only: cross W_Q, W_O), FFN W1, W2 (gated FFN: then W3)."""
    a = layer.self_attn
    cross = (layer.cross_attn.w_q, layer.cross_attn.w_o) if hasattr(layer, "cross_attn") else ()
    gate = () if layer.ffn.w3 is None else (layer.ffn.w3,)
    return (a.w_q, a.w_kv, a.w_o, *cross, layer.ffn.w1, layer.ffn.w2, *gate)


def layer_params(layer) -> Optional[list[Tensor]]:
    """The tensors of one ``DecoderLayer`` (48; gated 54) or ``EncoderLayer`` (34; gated 40) for
    ``decoder_layer_step`` / ``encoder_layer_step``: its linear layers (``_linears``), six tensors each,
    then its norms' weight and bias (empty for RMSNorm). None when a linear layer is not prepacked
    int8 or float32 (``_linear_params``)."""
    out: list[Tensor] = []
    for m in _linears(layer):
        p = _linear_params(m)
        if p is None:
            return None
        out += p
    for r in (layer.res if hasattr(layer, "res") else (layer.res1, layer.res2)):
        bias = getattr(r.norm, "bias", None)       # RMSNorm has none
        out += [r.norm.weight.detach(), _EMPTY if bias is None else bias.detach()]
    return out


@dataclass
class _StackParams:
    """The ``layer_params`` of one stack of layers, valid while ``key`` matches its linear layers."""
    linears: list                            # the stack's linear layers, listed once (the structure is fixed)
    key: Optional[list] = None               # per linear layer (its PackedWeight, its weight's version)
    params: Optional[list[list[Tensor]]] = None   # per layer its layer_params; None: a layer does not qualify


# Each model's stacks, kept beside the model (as ``linear.py`` keeps its output projection's copy), not on it.
_PARAMS: "weakref.WeakKeyDictionary[nn.Module, dict[str, _StackParams]]" = weakref.WeakKeyDictionary()


def _stack_params(model, stack: str) -> Optional[list[list[Tensor]]]:
    """Per layer of ``model.decoder`` or ``model.encoder`` (``stack``) its ``layer_params``, kept
    while every prepacked copy is the same object and valid for its weight (re-packing or changing a
    weight rebuilds or disables it; the key holds the prepacked objects, so none of them is freed
    and its identity reused)."""
    stacks = _PARAMS.setdefault(model, {})
    if stack not in stacks:
        stacks[stack] = _StackParams([m for layer in getattr(model, stack) for m in _linears(layer)])
    s = stacks[stack]
    now = [(getattr(m, "packed", None), m.weight._version) for m in s.linears]   # PackedWeight: compared by identity
    if now != s.key:
        params = [layer_params(layer) for layer in getattr(model, stack)]
        s.key, s.params = now, None if any(p is None for p in params) else params
    return s.params


def _int8_rows() -> int:
    """Up to how many rows a layer takes the compiled int8 kernel, as ``PackedWeight`` decides."""
    return 0 if kernels.int8_linear_kernel() is None else 1 << 62


def _kind(model) -> tuple:
    """The layer kind arguments of the compiled steps (``LayerKind`` in ``csrc/decoder_step.cpp``):
    (d_head, RMSNorm, gated FFN, the attention logits' scale), as the modules compute them."""
    cfg, attn = model.cfg, model.decoder[0].self_attn if len(model.decoder) else model.encoder[0].self_attn
    scale = attn.d_head ** -0.5 if attn.scale is None else attn.scale
    return cfg.d_head, cfg.norm == "rmsnorm", cfg.gated_ffn, scale


def encode_packed(model, x: Tensor, attend) -> Optional[Tensor]:
    """The encoder layers of ``prefill.encode_packed`` with each layer in one compiled call: x [NT,
    d_model] embedded tokens of a packed batch, ``attend`` its ``PackedSelfAttention`` -> [NT, d_model]
    before the final norm, the same bits as the module path; None where the compiled step does not
    apply (see the module docstring). The caller has checked that ``fused_step`` is on."""
    if (model.training or torch.is_grad_enabled() or model.cfg.activation not in _ACTIVATION
            or x.dtype != torch.float32):
        return None
    step = kernels.encoder_step_op()
    params = _stack_params(model, "encoder") if step is not None else None
    if params is None:
        return None
    cfg = model.cfg
    act, rows = _ACTIVATION[cfg.activation], _int8_rows()
    x = x.contiguous()
    kind = _kind(model)
    for p in params:
        x = step(x, p, attend.key_index, attend.starts, attend.max_len, cfg.n_heads, rows, cfg.norm_first, act,
                 cfg.layer_norm_eps, attend.bias_table, attend.bias_start, *kind)
    return x


def _eligible(model, hooks: Sequence[tuple]) -> bool:
    if model.training or torch.is_grad_enabled() or model.cfg.activation not in _ACTIVATION:
        return False
    for hs, hc in hooks:
        if not (isinstance(hs, CacheAttention) and isinstance(hc, CacheAttention) and hs.self_attention
                and not hc.self_attention and hs.plan.kernel and hs.plan.packed and hc.plan.kernel and hc.plan.packed
                and hs.share is None):
            return False
    return True


def decode_logits(model, hooks: Sequence[tuple], tokens: Tensor, positions: Tensor,
                  cross_weights: bool = False) -> Optional[tuple[Tensor, Optional[list[Tensor]]]]:
    """(logits [N, V], cross-attention weights or None) of one decode step with every decoder layer in
    one compiled call, or None where the compiled step does not apply (see the module docstring; the
    caller then runs ``Transformer.decode``). ``hooks``: per decoder layer the (self, cross)
    ``CacheAttention`` of ``KVCache.plan_step``; tokens, positions [N] (long). With ``cross_weights``
    also each layer's cross-attention weights [N, H, S] (S: the plan's longest source; zero past a
    row's own), what ``decode_step`` returns as ``StepOutput.cross``, the same bits. Writes this step's
    K/V into the cache as the module path does. Raises ValueError for a position beyond max_len."""
    if len(hooks) != len(model.decoder) or not _eligible(model, hooks):
        return None
    step = kernels.decoder_step_op()
    if step is None:
        return None
    params = _stack_params(model, "decoder")
    if params is None:
        return None
    cfg = model.cfg
    act = _ACTIVATION[cfg.activation]
    rows = _int8_rows()
    x = model.tgt_embed(tokens[:, None], positions[:, None])[:, 0]          # [N, d_model]
    kind = _kind(model)
    table = start = None
    if model.dec_rel is not None:      # T5: the step's relative biases, one table for every layer
        table, start = relative_bias_rows(model.dec_rel, positions, hooks[0][0].plan.max_len)
    cross: Optional[list[Tensor]] = [] if cross_weights else None
    for i, (hs, hc) in enumerate(hooks):
        c, layer = hs.cache, hs.layer
        ps, pc = hs.plan, hc.plan
        share = hc.share
        out = step(x, params[i], c.self_k[layer], c.self_v[layer], hs.write_at, ps.key_index, ps.starts, ps.max_len,
                   c.cross_k[layer], c.cross_v[layer], pc.key_index, pc.starts, pc.max_len,
                   None if share is None else share[2], 0 if share is None else share[0],
                   0 if share is None else share[1], cfg.n_heads, rows, cfg.norm_first, act, cfg.layer_norm_eps,
                   cross_weights, table, start, *kind)
        x = out[0]
        if cross is not None:
            cross.append(out[1])
    x = model.dec_norm(x)
    if cfg.scale_decoder_output:          # as Transformer.decode (T5 with a tied output layer)
        x = x * cfg.d_model ** -0.5
    return output_logits(model, x), cross
