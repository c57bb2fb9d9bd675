"""The parameter layout MarianMT import and export share: transformers' Marian parameter names for
ours (``layer_map``, ``attention_blocks``) and the permutation of the residual stream between our
interleaved sinusoid layout and Marian's split one (``split_order``, ``permute_residual``).
"""
from __future__ import annotations

import torch

__all__ = ["attention_blocks", "layer_map", "permute_residual", "split_order"]


def split_order(d_model: int) -> torch.Tensor:
    """[d_model] index from the interleaved sinusoid layout to the split one: dimension k of the split
    layout is dimension ``order[k]`` of ours (the even dimensions, sines, then the odd, cosines)."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


_READS_STREAM = (".tok.weight", "out_proj.weight", ".w_q.weight", ".w_kv.weight", ".w1.weight", "pos.weight")
_WRITES_STREAM = (".w_o.weight", ".w2.weight")
_STREAM_VECTORS = (".w_o.bias", ".w2.bias", "norm.weight", "norm.bias")
_OTHER = (".w_q.bias", ".w_kv.bias", ".w1.bias", "logits_bias")


def permute_residual(state: dict[str, torch.Tensor], order: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our state dict with the residual stream's dimensions reordered (new dimension k = old
    ``order[k]``): an exact symmetry of the model (LayerNorm does not depend on the order; logits
    are dot products with the tied embedding). Raises KeyError for a parameter it does not know."""
    out = {}
    for name, t in state.items():
        if name.endswith(_READS_STREAM):
            out[name] = t[:, order]              # [out, d_model]: input columns
        elif name.endswith(_WRITES_STREAM):
            out[name] = t[order, :]              # [d_model, in]: output rows
        elif name.endswith(_STREAM_VECTORS):
            out[name] = t[order]
        elif name.endswith(_OTHER):
            out[name] = t
        else:
            raise KeyError(f"permute_residual: unknown parameter {name!r}")
    return out


def attention_blocks(kind: str) -> list[tuple[str, str]]:
    """(our attention module, transformers' Marian module) of an encoder or decoder layer."""
    return [("self_attn", "self_attn")] + ([("cross_attn", "encoder_attn")] if kind == "decoder" else [])


def layer_map(kind: str, i: int) -> dict[str, str]:
    """Our parameter names -> transformers' for layer i of the encoder or decoder (q/k/v separate
    there, K and V fused in our ``w_kv``: handled by the caller)."""
    src, dst = f"model.{kind}.layers.{i}.", f"{kind}.{i}."
    attn = {"w_q": "q_proj", "w_o": "out_proj"}
    out = {}
    blocks = attention_blocks(kind)
    for ours, theirs in blocks:
        for a, b in attn.items():
            for p in ("weight", "bias"):
                out[f"{dst}{ours}.{a}.{p}"] = f"{src}{theirs}.{b}.{p}"
    norms = (["self_attn_layer_norm", "final_layer_norm"] if kind == "encoder"
             else ["self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm"])
    our_norms = ["res1", "res2"] if kind == "encoder" else ["res.0", "res.1", "res.2"]
    for ours, theirs in zip(our_norms, norms):
        for p in ("weight", "bias"):
            out[f"{dst}{ours}.norm.{p}"] = f"{src}{theirs}.{p}"
    for ours, theirs in (("w1", "fc1"), ("w2", "fc2")):
        for p in ("weight", "bias"):
            out[f"{dst}ffn.{ours}.{p}"] = f"{src}{theirs}.{p}"
    return out


def stack_layers(kind: str, n: int, get) -> dict[str, torch.Tensor]:
    """Our parameters of ``n`` layers of stack ``kind`` from a BART-style transformers state dict
    (MarianMT, M2M100, MBart): ``get(name)`` returns a tensor (raising for a missing one); k and v
    projections concatenated into ``w_kv``."""
    out = {}
    for i in range(n):
        for ours, theirs in layer_map(kind, i).items():
            out[ours] = get(theirs)
        for ours, theirs in attention_blocks(kind):
            for p in ("weight", "bias"):
                k, v = (get(f"model.{kind}.layers.{i}.{theirs}.{x}_proj.{p}") for x in "kv")
                out[f"{kind}.{i}.{ours}.w_kv.{p}"] = torch.cat([k, v])
    return out
