"""Training (model/train.py): a tiny model overfits a few pairs, token batches, the learning-rate schedule."""
from __future__ import annotations

import random

import pytest
import torch

from model.config import ModelConfig
from model.inference.generate import generate, pad_batch
from model.train import batch_loss, inverse_sqrt_lr, token_batches
from model.transformer import Transformer


def test_tiny_model_overfits_a_few_pairs():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("tiny", dropout=0.0))
    pairs = [([5, 6, 7, 3], [2, 10, 11, 12, 3]), ([8, 9, 3], [2, 13, 14, 3]),
             ([20, 21, 22, 23, 3], [2, 30, 31, 3]), ([40, 3], [2, 41, 42, 43, 44, 3])]
    src = pad_batch([p[0] for p in pairs], 0)
    tgt = pad_batch([p[1] for p in pairs], 0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.98), eps=1e-9)
    for step in range(1, 151):     # loss 0.013 and every pair exact by step 150 (0.09 and exact at 50)
        for g in opt.param_groups:
            g["lr"] = inverse_sqrt_lr(step, 3e-3, 30)
        model.train()
        loss, n, _ = batch_loss(model, src, tgt, 0.0)
        opt.zero_grad()
        (loss / n).backward()
        opt.step()
    assert float(loss / n) < 0.05
    hyps = [h[0] for h in generate(model.eval(), [p[0] for p in pairs], max_new_tokens=8)]
    assert [h.tokens for h in hyps] == [p[1][1:-1] for p in pairs]
    assert all(h.finish_reason == "eos" for h in hyps)


def test_token_batches_respect_budget_and_cover_everything():
    rng = random.Random(0)
    src = [rng.randint(1, 40) for _ in range(500)]
    tgt = [rng.randint(1, 40) for _ in range(500)]
    batches = token_batches(src, tgt, 300, rng)
    assert sorted(i for b in batches for i in b) == list(range(500))
    for b in batches:
        assert len(b) == 1 or max(max(src[i], tgt[i]) for i in b) * len(b) <= 300


def test_learning_rate_schedule():
    assert inverse_sqrt_lr(50, 1e-3, 100) == pytest.approx(5e-4)
    assert inverse_sqrt_lr(100, 1e-3, 100) == pytest.approx(1e-3)
    assert inverse_sqrt_lr(400, 1e-3, 100) == pytest.approx(5e-4)
