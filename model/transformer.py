"""The encoder-decoder Transformer (Vaswani et al., 2017, section 3, Figure 1).

The model returns logits; it knows nothing of int8, compiled kernels or paged caches. Choosing tokens,
caches and fast CPU paths live in ``model/inference/``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import CacheAttend, RelativePositionBias
from .config import ModelConfig
from .layers import DecoderLayer, Embeddings, EncoderLayer, make_norm


def padding_mask(tokens: Tensor, pad_id: int) -> Tensor:
    """tokens [B, S] -> bool [B, 1, 1, S], True for real (non-pad) tokens."""
    return (tokens != pad_id)[:, None, None, :]


def causal_mask(T: int, device=None) -> Tensor:
    """bool [1, 1, T, T], True on and below the diagonal: position i sees positions <= i."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]


class Transformer(nn.Module):
    """Encoder-decoder Transformer with shared source/target/output embeddings (section 3.4), or
    separate source and target embeddings (and vocabularies) with the output tied to the target's or not."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        emb = (cfg.vocab_size, cfg.d_model, cfg.max_len, cfg.positional, cfg.dropout, cfg.pad_id,
               cfg.sinusoid_layout, cfg.scale_embedding)
        extra = dict(offset=cfg.position_offset, layernorm=cfg.layernorm_embedding, eps=cfg.layer_norm_eps)
        self.src_embed = Embeddings(*emb, **extra)
        if not cfg.share_embeddings:
            self.tgt_embed = Embeddings(cfg.target_vocab_size, *emb[1:], **extra)
        elif cfg.share_positions:
            self.tgt_embed = self.src_embed
        else:   # shared token embedding, each stack its own positions and embedding LayerNorm (mBART)
            self.tgt_embed = Embeddings(*emb, **extra, tok=self.src_embed.tok)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers))
        # Pre-LN stacks end with a LayerNorm; post-LN layers already end normalised.
        self.enc_norm = make_norm(cfg) if cfg.norm_first else nn.Identity()
        self.dec_norm = make_norm(cfg) if cfg.norm_first else nn.Identity()
        # T5: relative position biases of each stack, computed once per forward and added in every layer
        rel = (cfg.relative_buckets, cfg.relative_max_distance, cfg.n_heads)
        self.enc_rel = RelativePositionBias(*rel, bidirectional=True) if cfg.relative_buckets else None
        self.dec_rel = RelativePositionBias(*rel, bidirectional=False) if cfg.relative_buckets else None
        tied = (cfg.share_embeddings or cfg.tie_target_output) and not cfg.separate_output
        self.out_proj = None if tied else nn.Linear(cfg.d_model, cfg.target_vocab_size, bias=False)
        # [vocab_size] added to the logits (Marian's final_logits_bias); None: no bias (the paper)
        self.logits_bias = nn.Parameter(torch.zeros(cfg.target_vocab_size)) if cfg.final_logits_bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform linear weights; embeddings ~ N(0, d_model^-0.5) so that × √d_model is unit scale."""
        for name, p in self.named_parameters():
            if p.dim() > 1 and "embed" not in name:
                nn.init.xavier_uniform_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        for emb in {id(self.src_embed): self.src_embed, id(self.tgt_embed): self.tgt_embed}.values():
            nn.init.normal_(emb.tok.weight, std=self.cfg.d_model ** -0.5)
            with torch.no_grad():
                emb.tok.weight[self.cfg.pad_id].zero_()

    # ---- encoder -------------------------------------------------------------------------------
    def encode(self, src: Tensor, src_mask: Tensor, need_weights: bool = False
               ) -> tuple[Tensor, Optional[list[Tensor]]]:
        """src [B, S] token ids, src_mask [B, 1, 1, S] -> memory [B, S, d_model].

        With need_weights, also returns per-layer self-attention weights, each [B, H, S, S].
        """
        x = self.src_embed(src)
        weights = [] if need_weights else None
        S = src.size(1)
        bias = None if self.enc_rel is None else self.enc_rel(torch.arange(S, device=src.device)[None], S)
        for layer in self.encoder:
            x, w = layer(x, src_mask, need_weights, bias=bias)
            if need_weights:
                weights.append(w)
        return self.enc_norm(x), weights

    def cross_kv(self, memory: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Encoder-decoder attention keys/values for every decoder layer, each [B, H, S, Dh]."""
        return [layer.cross_attn.project_kv(memory) for layer in self.decoder]

    # ---- decoder -------------------------------------------------------------------------------
    def decode(
        self, tgt: Tensor, cross_kv: Optional[Sequence[tuple[Tensor, Tensor]]], src_mask: Optional[Tensor],
        tgt_mask: Optional[Tensor] = None, positions: Optional[Tensor] = None,
        cache_attend: Optional[Sequence[tuple[CacheAttend, CacheAttend]]] = None, need_weights: bool = False,
        project: bool = True, rel_bias: Optional[Tensor] = None,
    ) -> tuple[Tensor, Optional[dict[str, list[Tensor]]]]:
        """Decoder stack and output projection.

        Args:
            tgt: [B, T] target-side input ids (shifted right: BOS first).
            cross_kv: per decoder layer, encoder-memory K/V [B, H, S, Dh] (see ``cross_kv``).
            src_mask: [B, 1, 1, S], True for real source tokens.
            tgt_mask: bool broadcastable to [B, 1, T, T_k]; default causal over T.
            positions: [B, T] absolute target positions (default 0..T-1); needed with a KV cache.
            cache_attend: an incremental step (T = 1) from a KV cache: per decoder layer the
                (self, cross) attention hooks of ``KVCache.attention``, which store this step's
                self-attention K/V and attend over each row's own keys; cross_kv and the masks are
                then unused (pass None).
            need_weights: also return {"self": [B, H, T, T_k] per layer, "cross": [B, H, T, S] per layer}.
            project: apply the output projection (``logits``); False returns the decoder's final
                states [B, T, d_model] instead, for callers that project them their own way.
            rel_bias: the self-attention's relative position biases (T5) where the caller has them
                (a CUDA graph's step, over its fixed key capacity); default ``self_bias``.
        Returns:
            (logits [B, T, vocab_size] or states [B, T, d_model], weights or None)
        """
        if tgt_mask is None and cache_attend is None:
            tgt_mask = causal_mask(tgt.size(1), tgt.device)
        x = self.tgt_embed(tgt, positions)
        weights = {"self": [], "cross": []} if need_weights else None
        bias = rel_bias if rel_bias is not None else self.self_bias(tgt, positions, cache_attend is not None)
        for i, layer in enumerate(self.decoder):
            if cache_attend is not None:
                x, w_self, w_cross = layer(x, tgt_mask=None, cross_kv=None, src_mask=None, cache_attend=cache_attend[i],
                                           need_weights=need_weights, bias=bias)
            else:
                x, w_self, w_cross = layer(x, tgt_mask=tgt_mask, cross_kv=cross_kv[i], src_mask=src_mask,
                                           need_weights=need_weights, bias=bias)
            if need_weights:
                weights["self"].append(w_self)
                weights["cross"].append(w_cross)
        x = self.dec_norm(x)
        if self.cfg.scale_decoder_output:    # T5 with a tied output layer
            x = x * self.cfg.d_model ** -0.5
        return (self.logits(x) if project else x), weights

    def self_bias(self, tgt: Tensor, positions: Optional[Tensor], cached: bool) -> Optional[Tensor]:
        """The decoder's relative position biases (T5; None otherwise): [1, H, T, T] over its own T
        inputs, or, for a cached step (``cached``), [B, H, T, P + 1] over each row's keys at positions
        0..P (P the largest of ``positions``; a row's keys past its own position are masked)."""
        if self.dec_rel is None:
            return None
        if positions is None:
            positions = torch.arange(tgt.size(1), device=tgt.device)[None]
        return self.dec_rel(positions, int(positions.max()) + 1 if cached else tgt.size(1))

    def logits(self, x: Tensor) -> Tensor:
        """Output projection [..., d_model] -> [..., vocab_size]; with shared embeddings the target
        embedding matrix is the projection (section 3.4)."""
        if self.out_proj is not None:
            x = self.out_proj(x)
            return x if self.logits_bias is None else x + self.logits_bias
        return F.linear(x, self.tgt_embed.tok.weight, self.logits_bias)

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        """Teacher-forced logits [B, T, V] for src [B, S] and shifted target input tgt [B, T]."""
        src_mask = padding_mask(src, self.cfg.pad_id)
        memory, _ = self.encode(src, src_mask)
        logits, _ = self.decode(tgt, self.cross_kv(memory), src_mask)
        return logits

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
