"""Greedy decoding of a model with the T5 family's flags (random weights) in the eager decode step
against the variant ``step.choose_variant`` picks on CPU (the compiled attention and the fused layer
step), int8 linear layers (or float32), one torch thread, runs interleaved:

    python -m service.bench.t5_step [--sentences 16] [--repeats 3] [--linear-dtype float32]

Shape: d_model 512, 8 heads of d_kv 64, d_ff 2048, 3+3 layers, vocabulary 32,000, untied output;
sources of 20 random tokens in one batch, up to 32 new tokens each. Prints tokens/s of each (median
run), their ratio, in how many sentences the tokens agree (float32: all; int8 rounds the two paths'
slightly different inputs to other levels, which on a random model, whose top two tokens are often
within 0.1 nats, changes some tokens), and the machine's load average. A timing, not a test
(``tests/test_t5_paths.py`` checks that both paths give the same tokens).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def t5_config(**overrides):
    """The benchmark's ModelConfig: MADLAD-400's flags at a mid shape."""
    from model.config import ModelConfig
    flags = dict(vocab_size=32000, d_model=512, n_heads=8, d_kv=64, d_ff=2048, n_encoder_layers=3,
                 n_decoder_layers=3, dropout=0.0, max_len=128, norm="rmsnorm", scale_attention=False,
                 relative_buckets=32, relative_max_distance=128, gated_ffn=True, activation="gelu_new",
                 linear_bias=False, positional="none", scale_embedding=False, norm_first=True,
                 share_embeddings=True, separate_output=True, layer_norm_eps=1e-6)
    return ModelConfig(**{**flags, **overrides})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentences", type=int, default=16, help="sources in the batch")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each path (interleaved)")
    ap.add_argument("--linear-dtype", default="int8", choices=("int8", "float32"), help="the linear layers")
    args = ap.parse_args(argv)
    import torch

    from model.inference.generate import generate
    from model.inference.kv_cache import KVCache
    from model.inference.linear import pack_for_inference
    from model.transformer import Transformer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Transformer(t5_config()).eval()
    with torch.no_grad():   # a peaked output distribution, as a trained model's (a random one's is near
        model.out_proj.weight.mul_(16.0)   # uniform: int8 rounding would flip its argmax ties)
    pack_for_inference(model, args.linear_dtype)
    g = torch.Generator().manual_seed(1)
    eos = model.cfg.eos_id
    sources = [torch.randint(4, model.cfg.vocab_size, (19,), generator=g).tolist() + [eos]
               for _ in range(args.sentences)]

    def once(cpu_kernels: bool) -> tuple[float, int, list]:
        cache = KVCache.for_model(model, len(sources), 33, 20, cpu_kernels=cpu_kernels)
        start = time.perf_counter()
        out = generate(model, sources, 1, 1, 32, cache=cache)
        seconds = time.perf_counter() - start
        return seconds, sum(len(r[0].tokens) for r in out), [r[0].tokens for r in out]

    names = {False: "eager step", True: "chosen variant (compiled attention, fused step)"}
    once(True)                                       # builds / loads the kernels; warms up
    runs: dict[bool, list] = {False: [], True: []}
    for _ in range(args.repeats):
        for k in (False, True):
            runs[k].append(once(k))
    rate = {}
    for k, rs in runs.items():
        rate[k] = statistics.median(n / s for s, n, _ in rs)
        print(f"{names[k]:50s} {rate[k]:8.1f} tokens/s  ({rs[0][1]} tokens per run)")
    same = sum(a == b for a, b in zip(runs[False][0][2], runs[True][0][2]))
    print(f"ratio {rate[True] / rate[False]:.2f}x; same tokens in {same} of {len(sources)} sentences; "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
