"""Tiny random models and sources shared by the model, engine and runner tests (not a test module)."""
from __future__ import annotations

import pytest
import torch

from model.config import ModelConfig
from model.transformer import Transformer, padding_mask

VOCAB = 64  # the "tiny" preset's vocabulary


def make_model(dtype=torch.float64, seed=0, **overrides) -> Transformer:
    """The "tiny" preset with random weights (seeded), in eval mode."""
    torch.manual_seed(seed)
    cfg = ModelConfig.from_name("tiny", **overrides)
    return Transformer(cfg).to(dtype).eval()


def make_engine_model(dtype=torch.float64, seed=1) -> Transformer:
    """A random tiny model. Untied output weights and pre-LN keep a random model from copying its
    input token forever (tied weights make each token predict itself), so outputs depend on the
    source and some end with EOS: mixups between requests cannot go unnoticed."""
    return make_model(dtype, seed, share_embeddings=False, norm_first=True)


def rand_source(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    """n source ids: random ordinary ids (>= 4), then EOS (3)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n - 1,), generator=g).tolist() + [3]


@torch.no_grad()
def uncached_greedy(model: Transformer, src: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    """Reference: re-run the whole decoder on the growing prefix, no KV cache."""
    cfg = model.cfg
    s = torch.tensor([src])
    mask = padding_mask(s, cfg.pad_id)
    memory, _ = model.encode(s, mask)
    kv = model.cross_kv(memory)
    tgt, lp = [cfg.bos_id], 0.0
    for _ in range(max_new_tokens):
        logits, _ = model.decode(torch.tensor([tgt]), kv, mask)
        logits = logits[0, -1].clone()
        logits[[cfg.pad_id, cfg.bos_id]] = float("-inf")
        log_probs = torch.log_softmax(logits, -1)
        t = int(log_probs.argmax())
        lp += float(log_probs[t])
        if t == cfg.eos_id:
            break
        tgt.append(t)
    return tgt[1:], lp


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine thread hand-offs dominate.
    Applies to every test of a module that imports it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
