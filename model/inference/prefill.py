"""Prefill: the encoder pass of admitted sentences, their cross-attention keys/values written into the
KV cache once per sentence, and the first decoder step (BOS).

On CPU, where the cache's compiled kernels are on, the encoder runs on a packed batch
(``encode_packed``: only real tokens, one compiled attention call, each encoder layer in one compiled
call where ``fused_step`` is on and applies), so a sentence's memory does not depend on what it is
batched with.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from ..attention import RelativePositionBias
from ..transformer import Transformer, padding_mask
from . import kernels, settings
from .attention_plan import packed_positions, relative_bias_rows
from .fused_step import encode_packed as fused_encode_packed
from .kv_cache import KVCache
from .step import StepOutput, decode_step

__all__ = ["PackedSelfAttention", "encode_into_cache", "encode_packed", "prefill"]


class PackedSelfAttention:
    """Self-attention within each sequence of a packed batch (no padding), with the compiled kernel.

    The B sequences' NT = sum(lengths) tokens are rows of one [NT, 1, d_model] batch; token n of
    sequence b attends over the tokens of b only (unmasked, as in the encoder). Passed to
    ``MultiHeadAttention`` as its ``cache_attend`` hook: called with q, k_new, v_new [NT, H, 1, Dh],
    returns (out [NT, H, 1, Dh], None). Needs ``model.inference.kernels.decode_attention()``; inference only
    (no gradient); weights are not available (use the padded path for them). ``rel``: the encoder's
    relative position biases (T5), computed here once for every layer (``bias_table`` [2S - 1, H],
    ``bias_start`` [NT], ``attention_plan.relative_bias_rows``); None without.
    """

    self_attention = True   # MultiHeadAttention projects this batch's keys/values

    def __init__(self, lengths: Tensor, rel: Optional[RelativePositionBias] = None):
        seq, pos = packed_positions(lengths)                    # [NT] sequence of each token, position in it
        per_token = lengths.index_select(0, seq)                # [NT] keys of each token: its sequence's tokens
        query, within = packed_positions(per_token)             # [sum L^2] the query of each key, key position
        first = torch.arange(seq.numel(), device=seq.device) - pos  # [NT] row of each token's sequence start
        self.key_index = first.index_select(0, query) + within  # token rows, query after query
        self.starts = torch.zeros(seq.numel() + 1, dtype=torch.long, device=seq.device)
        torch.cumsum(per_token, 0, out=self.starts[1:])
        self.max_len = int(lengths.max())
        self.bias_table, self.bias_start = (None, None) if rel is None else relative_bias_rows(rel, pos, self.max_len)

    def __call__(self, q: Tensor, k_new: Optional[Tensor], v_new: Optional[Tensor],
                 need_weights: bool = False, bias: Optional[Tensor] = None,
                 scale: Optional[float] = None) -> tuple[Tensor, Optional[Tensor]]:
        """``scale``: the logits' factor (default 1/√Dh); ``bias`` must be None (the relative biases are
        the constructor's ``rel``). Raises ValueError for weights or a bias."""
        if need_weights:
            raise ValueError("PackedSelfAttention returns no weights; use the padded path for them")
        if bias is not None:
            raise ValueError("PackedSelfAttention takes its relative position biases from its constructor (rel)")
        if torch.is_grad_enabled() and q.requires_grad:
            raise RuntimeError("PackedSelfAttention is for inference: the compiled kernel has no gradient")
        out, _ = kernels.packed_decode_attention(q.transpose(1, 2), k_new[:, :, 0].contiguous(),
                                                 v_new[:, :, 0].contiguous(), self.key_index, self.starts,
                                                 self.max_len, scale=scale, bias=self.bias_table,
                                                 bias_start=self.bias_start)              # [NT, 1, H, Dh]
        return out.transpose(1, 2), None


def encode_packed(model: Transformer, tokens: Tensor, lengths: Tensor, *, fused: Optional[bool] = None) -> Tensor:
    """The encoder on a packed batch: tokens [NT] are B sequences of ``lengths`` [B] one after
    another (no padding) -> memory [NT, d_model]. Same result as ``model.encode`` on the padded batch
    (up to float summation order), without computing pads; needs the compiled decode-attention
    kernel (``kernels``) and returns no attention weights. ``fused``: each layer in one compiled call
    where that applies (``fused_step.py``; default: the process's ``fused_step``)."""
    _, positions = packed_positions(lengths)
    attend = PackedSelfAttention(lengths, model.enc_rel)
    x = model.src_embed(tokens[:, None], positions[:, None])     # [NT, 1, d_model]
    if settings.or_default("fused_step", fused):
        out = fused_encode_packed(model, x[:, 0], attend)        # None where the model does not qualify
        if out is not None:
            return model.enc_norm(out)
    for layer in model.encoder:
        x, _ = layer(x, src_mask=None, attend=attend)
    return model.enc_norm(x)[:, 0]


@torch.no_grad()
def encode_into_cache(model: Transformer, cache: KVCache, slots: Sequence[Sequence[int]] | Tensor, src: Tensor,
                      src_lengths: Optional[Tensor] = None, need_weights: bool = False, *,
                      fused_step: Optional[bool] = None) -> Optional[list[Tensor]]:
    """The encoder half of prefill: encoder pass and cross-attention K/V of every decoder layer,
    stored once per sentence (in its first slot) and shared by all of its slots (all hypotheses of a
    beam attend to one source).

    Args:
        slots: per sentence, its slots (a [B, k] tensor, or B lists of any lengths >= 1).
        src: [B, S] source ids (EOS-terminated, right-padded with pad_id).
        src_lengths: [B] real lengths (default: counted from padding).
        fused_step: on a packed batch, each encoder layer in one compiled call (``encode_packed``).
    Returns encoder self-attention weights [B, H, S, S] per layer with need_weights, else None.
    Raises ValueError when S exceeds the cache's max_src_len.
    """
    rows = [list(map(int, r)) for r in (slots.tolist() if isinstance(slots, Tensor) else slots)]
    if len(rows) != src.size(0) or any(not r for r in rows):
        raise ValueError(f"need a non-empty slot list for each of the {src.size(0)} sentences")
    src_mask = padding_mask(src, model.cfg.pad_id)
    if src_lengths is None:
        src_lengths = src_mask[:, 0, 0].sum(-1)
    first = torch.tensor([r[0] for r in rows], dtype=torch.long, device=src.device)
    enc_w = None
    if not need_weights and cache.kernel_ok():
        # packed: only the real tokens go through the encoder (no padding, one call for any mix of lengths;
        # the same computation for a sentence whatever it is batched with)
        keep = torch.arange(src.size(1), device=src.device)[None, :] < src_lengths[:, None]
        memory = encode_packed(model, src[keep], src_lengths, fused=fused_step)  # [NT, d_model]
        cache.write_cross_packed(first, model.cross_kv(memory[:, None]), src_lengths)
    else:
        memory, enc_w = model.encode(src, src_mask, need_weights)
        cache.write_cross(first, model.cross_kv(memory), src_lengths)
    others = [(s, r[0]) for r in rows for s in r[1:]]
    if others:  # the other hypotheses of a beam read the first slot's cross K/V
        cache.share_cross(torch.tensor([s for s, _ in others], device=src.device),
                          torch.tensor([o for _, o in others], device=src.device))
    return enc_w


@torch.no_grad()
def prefill(model: Transformer, cache: KVCache, slots: Tensor, src: Tensor,
            need_weights: bool = False, src_lengths: Optional[Tensor] = None, *,
            fused_step: Optional[bool] = None) -> StepOutput:
    """Encoder pass, cross-attention K/V for every decoder layer, and the first decoder step (BOS).

    Args:
        slots: [B] or [B, k] cache slots per sentence; cross K/V are written to all k slots of a
            sentence (its beam), the first step runs on ``slots[:, 0]`` only.
        src: [B, S] source ids (EOS-terminated, right-padded with pad_id).
        src_lengths: [B] real lengths (default: counted from padding).
        fused_step: each layer in one compiled call where that applies (default: the process's).
    Returns StepOutput with log_probs [B, V] for the first target token; with need_weights also
    encoder self-attention [B, H, S, S] per layer and first-step rows.
    The serving engine calls ``encode_into_cache`` and runs the first step inside its shared decode
    step instead (one decoder forward per engine step).
    """
    if slots.dim() == 1:
        slots = slots[:, None]
    enc_w = encode_into_cache(model, cache, slots, src, src_lengths, need_weights, fused_step=fused_step)
    first = slots[:, 0]
    bos = torch.full((slots.size(0),), model.cfg.bos_id, dtype=torch.long, device=src.device)
    out = decode_step(model, cache, first, bos, torch.zeros_like(bos), need_weights, fused_step=fused_step)
    out.encoder = enc_w
    return out
