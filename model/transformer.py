"""The encoder-decoder Transformer (Vaswani et al., 2017, section 3, Figure 1).

The model returns logits; choosing tokens lives in ``model/decoding.py``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from . import fused_step
from .attention import CacheAttend, PackedSelfAttention, packed_positions
from .config import ModelConfig
from .layers import DecoderLayer, Embeddings, EncoderLayer
from .linear import PACKED_DTYPES, Linear, PackedWeight, default_dtype, packed_linear


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
        self.src_embed = Embeddings(*emb)
        self.tgt_embed = self.src_embed if cfg.share_embeddings else Embeddings(cfg.target_vocab_size, *emb[1:])
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers))
        # Pre-LN stacks end with a LayerNorm; post-LN layers already end normalised.
        self.enc_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if cfg.norm_first else nn.Identity()
        self.dec_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if cfg.norm_first else nn.Identity()
        tied = cfg.share_embeddings or cfg.tie_target_output
        self.out_proj = None if tied else Linear(cfg.d_model, cfg.target_vocab_size, bias=False)
        self._packed_out: Optional[PackedWeight] = None  # prepacked shared output projection (CPU inference)
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
        for layer in self.encoder:
            x, w = layer(x, src_mask, need_weights)
            if need_weights:
                weights.append(w)
        return self.enc_norm(x), weights

    def encode_packed(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        """The encoder on a packed batch: tokens [NT] are B sequences of ``lengths`` [B] one after
        another (no padding) -> memory [NT, d_model]. Same result as ``encode`` on the padded batch
        (up to float summation order), without computing pads; needs the compiled decode-attention
        kernel (``model.kernels``) and returns no attention weights."""
        _, positions = packed_positions(lengths)
        attend = PackedSelfAttention(lengths)
        x = self.src_embed(tokens[:, None], positions[:, None])      # [NT, 1, d_model]
        fused = fused_step.encode_packed(self, x[:, 0], attend)     # each layer one compiled call, where it applies
        if fused is not None:
            return self.enc_norm(fused)
        for layer in self.encoder:
            x, _ = layer(x, None, False, attend)
        return self.enc_norm(x)[:, 0]

    def cross_kv(self, memory: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Encoder-decoder attention keys/values for every decoder layer, each [B, H, S, Dh]."""
        return [layer.cross_attn.project_kv(memory) for layer in self.decoder]

    # ---- decoder -------------------------------------------------------------------------------
    def decode(
        self, tgt: Tensor, cross_kv: Optional[Sequence[tuple[Tensor, Tensor]]], src_mask: Optional[Tensor],
        tgt_mask: Optional[Tensor] = None, positions: Optional[Tensor] = None,
        cache_attend: Optional[Sequence[tuple[CacheAttend, CacheAttend]]] = None, need_weights: bool = False,
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
        Returns:
            (logits [B, T, vocab_size], weights or None)
        """
        if tgt_mask is None and cache_attend is None:
            tgt_mask = causal_mask(tgt.size(1), tgt.device)
        x = self.tgt_embed(tgt, positions)
        weights = {"self": [], "cross": []} if need_weights else None
        for i, layer in enumerate(self.decoder):
            if cache_attend is not None:
                x, w_self, w_cross = layer(x, None, None, None, cache_attend[i], need_weights)
            else:
                x, w_self, w_cross = layer(x, tgt_mask, cross_kv[i], src_mask, None, need_weights)
            if need_weights:
                weights["self"].append(w_self)
                weights["cross"].append(w_cross)
        return self.logits(self.dec_norm(x)), weights

    def logits(self, x: Tensor) -> Tensor:
        """Output projection [..., d_model] -> [..., vocab_size]; with shared embeddings the target
        embedding matrix is the projection (section 3.4)."""
        if self.out_proj is not None:
            x = self.out_proj(x)
            return x if self.logits_bias is None else x + self.logits_bias
        return packed_linear(x, self.tgt_embed.tok.weight, self.logits_bias, self._packed_out)

    @property
    def linear_dtype(self) -> str:
        """The arithmetic of the linear layers at inference: "int8", "bfloat16" or "float32" when
        prepacked (see ``pack_for_inference``), else the parameters' dtype (e.g. "float32" on CUDA)."""
        packed = next((m.packed for m in self.modules() if isinstance(m, Linear) and m.packed is not None), None)
        return str(packed.dtype if packed is not None else next(self.parameters()).dtype).removeprefix("torch.")

    def pack_for_inference(self, enabled: bool = True, dtype: Optional[torch.dtype] = None) -> bool:
        """Prepack every linear weight (and the shared output projection) for oneDNN CPU inference;
        see ``model/linear.py``. A no-op off CPU, off fp32 or without oneDNN. Returns whether packing
        is active. ``enabled=False`` drops the packed copies. ``dtype``: the packed copies' dtype,
        int8, float32 or bfloat16 (default: ``MT_LINEAR_DTYPE``, else int8).
        Raises ValueError for another dtype."""
        dtype = default_dtype() if dtype is None else dtype
        if dtype not in PACKED_DTYPES:
            raise ValueError(f"packed linear dtype must be float32, bfloat16 or int8, got {dtype}")
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        self._packed_out = None
        if not enabled:
            for m in linears:
                m.unpack()
            return False
        ok = all([m.pack(dtype) for m in linears])
        if ok and self.out_proj is None and PackedWeight.usable(self.tgt_embed.tok.weight):
            try:
                self._packed_out = PackedWeight(self.tgt_embed.tok.weight, dtype)
            except (RuntimeError, AttributeError):
                ok = False
        elif self.out_proj is None:
            ok = False
        if not ok:
            for m in linears:
                m.unpack()
            self._packed_out = None
            if dtype != torch.float32 and PackedWeight.usable(self.tgt_embed.tok.weight):
                # e.g. a torch build without the int8 or bf16 kernels: prepacked float32 instead
                return self.pack_for_inference(enabled, torch.float32)
        return ok

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        """Teacher-forced logits [B, T, V] for src [B, S] and shifted target input tgt [B, T]."""
        src_mask = padding_mask(src, self.cfg.pad_id)
        memory, _ = self.encode(src, src_mask)
        logits, _ = self.decode(tgt, self.cross_kv(memory), src_mask)
        return logits

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
