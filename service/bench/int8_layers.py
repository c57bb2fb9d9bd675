"""The int8 linear layer's two paths side by side, interleaved, one torch thread:

    python -m service.bench.int8_layers

(1) per layer shape of the shipped model and row count: the one-call compiled kernel
(``kernels.int8_linear_kernel``: AVX-512 VNNI, or AVX2 without VNNI) against quantize ->
``torch._int_mm`` -> dequantize and against the oneDNN-prepacked float32 layer, in microseconds (median of
interleaved repeats); the layer takes the one-call kernel for every row count where there is one.
(2) ``generate`` on one sentence at a time (batch 1, greedy, the first ``--sentences`` German
test_2016_flickr sentences) with the one-call kernel and with it switched off, in ms per sentence:
the effect on a single client's latency. Both paths give the same bits (``tests/test_kernels.py``).
A timing, not a test.
"""
from __future__ import annotations

import argparse
import gzip
import statistics
import sys
import time
from pathlib import Path
from model.inference.linear import linear_dtype, packed_output

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SOURCES = Path(__file__).resolve().parents[2] / "model" / "data" / "multi30k" / "test_2016_flickr.de.gz"


def _median_us(fn, repeats: int, inner: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t) / inner)
    return statistics.median(times) * 1e6


def layers(model, repeats: int = 7) -> None:
    """Part (1): every distinct [in, out] of the model's linear layers."""
    import torch
    from model.inference import kernels
    from model.inference.linear import PackedLinear, PackedWeight
    shapes: dict[tuple[int, int], tuple] = {}   # (in, out) -> (float32 weight, bias, int8 PackedWeight)
    for m in model.modules():
        if isinstance(m, PackedLinear) and m.packed is not None and m.packed.small is not None:
            shapes.setdefault((m.in_features, m.out_features), (m.weight.detach(), m.bias, m.packed))
    out_proj = packed_output(model)
    if out_proj is not None and getattr(out_proj, "small", None) is not None:
        shapes[(model.cfg.d_model, out_proj.scale.numel())] = (model.tgt_embed.tok.weight.detach(), None, out_proj)
    print("(1) one linear layer, µs: int8 one-call kernel / int8 quantize + _int_mm + dequantize / prepacked float32")
    print(f"{'in -> out':>14} " + " ".join(f"{r:>22}" for r in ROWS))
    small = kernels.int8_linear_kernel()
    g = torch.Generator().manual_seed(0)
    for (n_in, n_out), (weight, bias, p) in sorted(shapes.items()):
        bias = None if bias is None else bias.detach()
        f32 = PackedWeight(weight, torch.float32)
        calls = (lambda x: small(x, *p.small, p.scale, bias, n_out), lambda x: p._int8(x, bias), lambda x: f32(x, bias))
        cells = []
        for rows in ROWS:
            x = torch.randn(rows, n_in, generator=g)
            times: list[list[float]] = [[] for _ in calls]
            inner = []
            for fn in calls:   # about 20 ms per repeat and path, at most 2000 / rows calls
                t = time.perf_counter()
                fn(x)
                inner.append(max(1, min(2000 // rows, int(0.02 / max(time.perf_counter() - t, 1e-7)))))
            for _ in range(repeats):   # interleaved
                for fn, n, ts in zip(calls, inner, times):
                    ts.append(_median_us(lambda: fn(x), 1, n))
            a, b, c = (statistics.median(ts) for ts in times)
            cells.append(f"{a:6.1f}/{b:7.1f}/{c:6.1f}")
        print(f"{n_in:>6} -> {n_out:<5} " + " ".join(f"{c:>22}" for c in cells))


def batch1_latency(model, srcs, paths: dict[str, dict], rounds: int = 3) -> None:
    """``generate`` on one sentence at a time (batch 1, greedy) over ``srcs`` under each path, in
    interleaved rounds; a path is the ``kernels._loaded`` entries it sets (e.g. ``{"int8_layer": None}``
    switches the one-call int8 layer off), and the last path is the baseline of the printed ratios."""
    from model.inference import kernels
    from model.inference.generate import generate
    times: dict[str, list[float]] = {name: [] for name in paths}
    tokens = 0
    for s in srcs[:5]:
        generate(model, [s])
    for _ in range(rounds):
        for name, switches in paths.items():
            kernels._loaded.update(switches)
            try:
                t = time.perf_counter()
                tokens = sum(len(generate(model, [s])[0][0].tokens) for s in srcs)
                times[name].append((time.perf_counter() - t) / len(srcs))
            finally:
                for key in switches:
                    kernels._loaded.pop(key, None)
    print(f"(2) generate, batch 1, greedy, {len(srcs)} sentences ({tokens} tokens), {linear_dtype(model)}, median of "
          f"{rounds} interleaved rounds:")
    base = statistics.median(times[list(paths)[-1]])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"    {name:<34} {m * 1e3:6.2f} ms/sentence  {m * len(srcs) / tokens * 1e3:5.3f} ms/token  "
              f"{base / m:4.2f}x")


def setup(prog: str, doc: str, argv, parts_help: str):
    """The two benchmarks' command line and set-up: (args, parts, model, tokenizer, test sources), or an
    exit status (1: no compiled kernels here, 2: the checkpoint does not load)."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc)
    ap.add_argument("--checkpoint", default="model/checkpoints/de-en")
    ap.add_argument("--sentences", type=int, default=100, help="(2): sentences translated per round (>= 1)")
    ap.add_argument("--parts", default="1,2", help=parts_help)
    args = ap.parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or not parts <= {"1", "2"}:
        ap.error(f"--parts must be 1, 2 or 1,2, got {args.parts!r}")
    if args.sentences < 1:
        ap.error(f"--sentences must be >= 1, got {args.sentences}")
    import torch
    from model.inference import kernels
    from model.load import load_model
    torch.set_num_threads(1)
    if kernels.decoder_step_op() is None:
        print("the compiled CPU kernels are unavailable here (MT_CPU_KERNELS=0, or no compiler)", file=sys.stderr)
        return 1
    try:
        model, tok, _ = load_model(args.checkpoint)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    lines = gzip.open(SOURCES, "rt", encoding="utf-8").read().splitlines()
    return args, parts, model, tok, [tok.encode(s) + [model.cfg.eos_id] for s in lines]


def main(argv=None) -> int:
    ready = setup("python -m service.bench.int8_layers", __doc__, argv, "1 (layers), 2 (batch-1 latency), or both")
    if isinstance(ready, int):
        return ready
    args, parts, model, _, srcs = ready
    from model.inference import kernels
    if kernels.int8_linear_kernel() is None:
        print("no one-call int8 kernel here (it needs AVX-512 VNNI or AVX2)", file=sys.stderr)
        return 1
    if linear_dtype(model) != "int8":
        print(f"error: the model's linear layers are {linear_dtype(model)}, not int8 (unset MT_LINEAR_DTYPE)",
              file=sys.stderr)
        return 2
    if "1" in parts:
        layers(model)
    if "2" in parts:
        batch1_latency(model, srcs[:args.sentences],
                       {"one-call kernel": {}, "quantize + _int_mm + dequantize": {"int8_layer": None}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
