"""Embeddings, positional encodings, the position-wise FFN and the encoder / decoder layers
(Vaswani et al., 2017, sections 3.1, 3.3-3.5)."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import CacheAttend, MultiHeadAttention


def sinusoidal_table(max_len: int, d_model: int, layout: str = "interleaved", pad_row: Optional[int] = None) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(...)  (section 3.5).

    ``layout="split"`` puts the same sines in the first ceil(d_model/2) dimensions and the cosines in
    the rest (Marian, and transformers' ``MarianSinusoidalPositionalEmbedding``). ``layout="fairseq"``
    is fairseq's table (M2M100, NLLB-200: transformers' ``M2M100SinusoidalPositionalEmbedding``,
    computed in float32 as it is, bit for bit): sin(pos · 10000^(-i/(h-1))) for i < h = d_model // 2,
    then the cosines, a zero column for an odd d_model, and row ``pad_row`` zero.
    Returns [max_len, d_model] float32.
    """
    if layout == "fairseq":
        half = d_model // 2
        freq = torch.exp(torch.arange(half, dtype=torch.int64).float() * -(math.log(10000) / (half - 1)))
        ang = torch.arange(max_len, dtype=torch.int64).float().unsqueeze(1) * freq.unsqueeze(0)   # [T, h]
        table = torch.cat([torch.sin(ang), torch.cos(ang)], dim=1)
        if d_model % 2:
            table = torch.cat([table, torch.zeros(max_len, 1)], dim=1)
        if pad_row is not None and pad_row < max_len:
            table[pad_row] = 0
        return table
    pos = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)               # [T, 1]
    inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    sin, cos = torch.sin(pos * inv_freq), torch.cos(pos * inv_freq[: d_model // 2])
    if layout == "split":
        return torch.cat([sin, cos], dim=1).float()
    table = torch.zeros(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = sin
    table[:, 1::2] = cos
    return table.float()


def _capturing(x: Tensor) -> bool:
    """Inside a CUDA-graph capture, where reading a value back to the host is not allowed (callers
    check positions before capturing: ``model/inference/dense_step.py``)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


class Embeddings(nn.Module):
    """Token embedding × √d_model (× 1 without ``scale_embedding``) plus positional encoding, then
    dropout (sections 3.4, 3.5); with ``layernorm`` a LayerNorm before the dropout (mBART's
    ``layernorm_embedding``). Position p reads row p + ``offset`` of the table (fairseq's padding
    offset, mBART's 2). ``tok`` may be another Embeddings' token embedding (shared tokens, own positions)."""

    def __init__(self, vocab_size: int, d_model: int, max_len: int, positional: str,
                 dropout: float, pad_id: int, layout: str = "interleaved", scale_embedding: bool = True,
                 offset: int = 0, layernorm: bool = False, eps: float = 1e-5, tok: Optional[nn.Embedding] = None):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model, padding_idx=pad_id) if tok is None else tok
        self.scale = math.sqrt(d_model) if scale_embedding else 1.0
        self.learned, self.none = positional == "learned", positional == "none"
        if self.learned:
            self.pos = nn.Embedding(max_len + offset, d_model)
        elif not self.none:
            self.register_buffer("pe", sinusoidal_table(max_len + offset, d_model, layout, pad_id), persistent=False)
        self.norm = nn.LayerNorm(d_model, eps=eps) if layernorm else None
        self.drop = nn.Dropout(dropout)
        self.max_len, self.offset = max_len, offset

    def forward(self, tokens: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        """tokens [B, T] -> [B, T, d_model]. positions [B, T] (default 0..T-1) index the encodings."""
        if positions is None:
            if tokens.size(1) > self.max_len:
                raise ValueError(f"sequence length {tokens.size(1)} exceeds max_len {self.max_len}")
            positions = torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0)
        elif positions.numel() and not _capturing(positions) and int(positions.max()) >= self.max_len:
            raise ValueError(f"position {int(positions.max())} exceeds max_len {self.max_len}")
        if self.none:   # no positional encoding (T5: relative position biases in attention)
            x = self.tok(tokens) * self.scale
            return self.drop(x if self.norm is None else self.norm(x))
        if self.offset:
            positions = positions + self.offset
        pos = self.pos(positions) if self.learned else self.pe[positions]
        x = self.tok(tokens) * self.scale + pos.to(self.tok.weight.dtype)
        return self.drop(x if self.norm is None else self.norm(x))


def gelu_new(x: Tensor) -> Tensor:
    """GELU's tanh approximation, written as transformers' ``NewGELUActivation`` (T5's gelu_new)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class FeedForward(nn.Module):
    """FFN(x) = act(x W1 + b1) W2 + b2, act = ReLU in the paper (section 3.3), or GELU, or swish
    (SiLU, x·sigmoid(x), in most OPUS-MT models). ``gated``: (act(x W1) ⊙ x W3) W2 (T5's gated-gelu);
    ``bias`` False: no biases (T5)."""

    ACT = {"relu": F.relu, "gelu": F.gelu, "swish": F.silu, "silu": F.silu, "gelu_new": gelu_new}

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu", dropout: float = 0.0,
                 gated: bool = False, bias: bool = True):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d_model, d_ff, bias=bias), nn.Linear(d_ff, d_model, bias=bias)
        self.w3 = nn.Linear(d_model, d_ff, bias=bias) if gated else None
        self.act = self.ACT[activation]
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.w1(x))
        if self.w3 is not None:
            h = h * self.w3(x)
        return self.w2(self.drop(h) if self.training else h)    # (eval: no dropout call per step)


def make_norm(cfg) -> nn.Module:
    """The configuration's normalisation over d_model: LayerNorm, or RMSNorm without bias (T5LayerNorm)."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.layer_norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)


def _attention(cfg) -> MultiHeadAttention:
    return MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, cfg.d_kv, cfg.linear_bias,
                              None if cfg.scale_attention else 1.0)


def _ffn(cfg) -> FeedForward:
    return FeedForward(cfg.d_model, cfg.d_ff, cfg.activation, gated=cfg.gated_ffn, bias=cfg.linear_bias)


class Residual(nn.Module):
    """A sub-layer connection: post-LN LayerNorm(x + Dropout(Sublayer(x))) as in the paper
    (section 5.4), or pre-LN x + Dropout(Sublayer(LayerNorm(x)))."""

    def __init__(self, d_model: int, dropout: float, norm_first: bool, eps: float, norm: Optional[nn.Module] = None):
        super().__init__()
        self.norm = nn.LayerNorm(d_model, eps=eps) if norm is None else norm
        self.drop = nn.Dropout(dropout)
        self.norm_first = norm_first

    def pre(self, x: Tensor) -> Tensor:
        return self.norm(x) if self.norm_first else x

    def post(self, x: Tensor, y: Tensor) -> Tensor:
        out = x + (self.drop(y) if self.training else y)
        return out if self.norm_first else self.norm(out)


class EncoderLayer(nn.Module):
    """Self-attention then FFN, each wrapped in a residual connection (section 3.1)."""

    def __init__(self, cfg):
        super().__init__()
        self.self_attn = _attention(cfg)
        self.ffn = _ffn(cfg)
        self.res1 = Residual(cfg.d_model, cfg.dropout, cfg.norm_first, cfg.layer_norm_eps, make_norm(cfg))
        self.res2 = Residual(cfg.d_model, cfg.dropout, cfg.norm_first, cfg.layer_norm_eps, make_norm(cfg))

    def forward(self, x: Tensor, src_mask: Optional[Tensor], need_weights: bool = False,
                attend: Optional[CacheAttend] = None, bias: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
        """x [B, S, d_model], src_mask [B, 1, 1, S] -> ([B, S, d_model], weights [B, H, S, S] or None).
        ``attend`` (e.g. a packed batch, ``model.inference.prefill.encode_packed``) replaces the padded attention;
        ``bias`` [1, H, S, S]: relative position biases added to the logits (T5)."""
        y, w = self.self_attn(self.res1.pre(x), mask=src_mask, cache_attend=attend, need_weights=need_weights,
                              bias=bias)
        x = self.res1.post(x, y)
        x = self.res2.post(x, self.ffn(self.res2.pre(x)))
        return x, w


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, FFN; each in a residual (section 3.1)."""

    def __init__(self, cfg):
        super().__init__()
        self.self_attn = _attention(cfg)
        self.cross_attn = _attention(cfg)
        self.ffn = _ffn(cfg)
        self.res = nn.ModuleList(Residual(cfg.d_model, cfg.dropout, cfg.norm_first, cfg.layer_norm_eps, make_norm(cfg))
                                 for _ in range(3))

    def forward(
        self, x: Tensor, tgt_mask: Optional[Tensor], cross_kv: Optional[tuple[Tensor, Tensor]],
        src_mask: Optional[Tensor], cache_attend: Optional[tuple[CacheAttend, CacheAttend]] = None,
        need_weights: bool = False, bias: Optional[Tensor] = None,
    ) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """x [B, T, d_model]; tgt_mask bool broadcastable to [B, 1, T, T_k] (causal); cross_kv:
        encoder-memory keys/values [B, H, S, Dh]; src_mask [B, 1, 1, S]. An incremental decoding step
        passes ``cache_attend`` (self, cross) instead, and the masks and cross_kv are unused. ``bias``
        [B or 1, H, T, T_k]: relative position biases added to the self-attention logits (T5).
        Returns (x [B, T, d_model], self weights [B, H, T, T_k] or None, cross weights [B, H, T, S] or None).
        """
        r1, r2, r3 = self.res
        attend_self, attend_cross = cache_attend if cache_attend is not None else (None, None)
        y, w_self = self.self_attn(r1.pre(x), mask=tgt_mask, cache_attend=attend_self, need_weights=need_weights,
                                   bias=bias)
        x = r1.post(x, y)
        y, w_cross = self.cross_attn(r2.pre(x), mask=src_mask, kv=cross_kv, cache_attend=attend_cross,
                                     need_weights=need_weights)
        x = r2.post(x, y)
        x = r3.post(x, self.ffn(r3.pre(x)))
        return x, w_self, w_cross
