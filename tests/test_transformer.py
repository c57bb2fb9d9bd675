"""The model definition: config presets (model/config.py), positional encoding (model/layers.py),
the Transformer's variants (model/transformer.py)."""
from __future__ import annotations

import math

import pytest
import torch

from model.config import ModelConfig
from model.layers import sinusoidal_table
from tiny_model import make_model, rand_source


def test_presets_match_the_paper():
    base, big = ModelConfig.from_name("base"), ModelConfig.from_name("big")
    assert (base.d_model, base.n_heads, base.d_ff, base.n_encoder_layers, base.dropout) == (512, 8, 2048, 6, 0.1)
    assert (big.d_model, big.n_heads, big.d_ff, big.dropout) == (1024, 16, 4096, 0.3)
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(d_model=100, n_heads=8)


def test_sinusoidal_encoding_values():
    pe = sinusoidal_table(50, 16)
    assert pe.shape == (50, 16)
    assert pe[1, 0].item() == pytest.approx(math.sin(1.0), abs=1e-7)
    assert pe[1, 1].item() == pytest.approx(math.cos(1.0), abs=1e-7)
    # dims 2i use frequency 1 / 10000^(2i / d_model)
    assert pe[7, 4].item() == pytest.approx(math.sin(7 / 10000 ** (4 / 16)), abs=1e-6)
    assert pe[7, 5].item() == pytest.approx(math.cos(7 / 10000 ** (4 / 16)), abs=1e-6)
    assert torch.all(pe[0, 0::2] == 0) and torch.all(pe[0, 1::2] == 1)


def test_post_ln_and_pre_ln_and_learned_positions_build_and_run():
    for overrides in ({"norm_first": True}, {"positional": "learned"}, {"activation": "gelu"},
                      {"share_embeddings": False}):
        m = make_model(**overrides)
        src = torch.tensor([rand_source(6, 1)])
        logits = m(src, torch.tensor([[2, 5, 6]]))
        assert logits.shape == (1, 3, 64) and torch.isfinite(logits).all()
