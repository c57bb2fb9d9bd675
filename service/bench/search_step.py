"""One beam-search step over many sentences: ``search_step`` (every sentence's candidates ranked at
once, ``model.inference.search.rank_candidates``) against each sentence ranking its own (python lists and a
python sort per sentence, ``BeamSearch.step``: the path before), interleaved, on the same candidates:

    python -m service.bench.search_step                   # 172 beam-4 sentences (the engine's (c) shape)
    python -m service.bench.search_step --sentences 32    # static batches of 32

The top-k over the vocabulary is done once beforehand (``kernels.log_softmax_topk`` of random logits;
timed on its own in the last line), so the two rows differ only in what follows it. Every sentence
has k alive hypotheses of 12 tokens. Median ms per step of 30 interleaved repeats, 2 torch threads,
in a process tuned as the engine's (``service.engine.tune_process``).
A timing, not a test; both give the same hypotheses (``tests/test_search.py``).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time


class _NoCache:
    def reorder(self, slots, index, length=None) -> None:  # the reorder is slot ids only: not timed
        pass


def main(argv=None) -> int:
    import torch
    from model.inference.step import StepOutput
    from model.inference.search import ActiveSearch, BeamSearch, PartialHypothesis, search_step
    from model.inference.topk import row_topk
    ap = argparse.ArgumentParser(prog="python -m service.bench.search_step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=int, default=172, help="beam searches per step (default 172)")
    ap.add_argument("--beam", type=int, default=4, help="beam size (default 4)")
    ap.add_argument("--vocab", type=int, default=8000, help="vocabulary size (default 8000)")
    args = ap.parse_args(argv)
    for name, value, low in (("--sentences", args.sentences, 1), ("--beam", args.beam, 2), ("--vocab", args.vocab, 16)):
        if value < low:
            ap.error(f"{name} must be >= {low}, got {value}")
    from service.engine import tune_process
    torch.set_num_threads(2)
    S, K, V = args.sentences, args.beam, args.vocab
    g = torch.Generator().manual_seed(0)
    log_probs = torch.randn(S * K, V, generator=g).mul_(3).log_softmax(-1)
    top_v, top_i = row_topk(log_probs, 2 * K)
    candidates = (top_v, top_i)
    base = []
    for j in range(S):
        b = BeamSearch(K, 3, 100)
        b.alive = [PartialHypothesis(tuple(range(5, 17)), -1.0 - 0.1 * h) for h in range(K)]
        base.append(ActiveSearch(b, list(range(j * K, j * K + K)), [7] * K, position=12))

    def batched(searches) -> None:
        import model.inference.search as search_mod
        real = search_mod._candidates
        search_mod._candidates = lambda outs, k, masked, eos: candidates
        try:
            search_step(_NoCache(), [(StepOutput(log_probs), searches)])
        finally:
            search_mod._candidates = real

    def per_sentence(searches) -> None:
        v, i = top_v.tolist(), top_i.tolist()
        for s in searches:
            a = s.slots[0] // K * K
            s.search.step(v[a: a + K], i[a: a + K])

    tune_process()      # as in the engine's process (gc.freeze() of what exists now, GIL interval)
    times: dict[str, list[float]] = {"search_step (ranked at once)": [], "per sentence (python sort)": []}
    results = {}
    for _ in range(30):
        for (name, fn) in zip(times, (batched, per_sentence)):
            searches = copy.deepcopy(base)
            t = time.perf_counter()
            fn(searches)
            times[name].append(time.perf_counter() - t)
            results[name] = [(h.tokens, h.log_prob) for s in searches for h in s.search.alive]
    same = len({repr(r) for r in results.values()}) == 1
    print(f"{S} beam-{K} sentences ({S * K} rows), vocabulary {V}, top-k done beforehand:")
    for name, v in times.items():
        print(f"  {name:30s} {1000 * statistics.median(v):.2f} ms per step")
    print(f"  same hypotheses: {same}")
    from model.inference import kernels
    op = kernels.log_softmax_topk_op()
    if op is not None:
        banned = torch.full((S * K,), -1, dtype=torch.long)
        logits = torch.randn(S * K, V, generator=g).mul_(3)
        t = [0.0] * 10
        for r in range(10):
            t0 = time.perf_counter()
            op(logits, 2 * K, banned)
            t[r] = time.perf_counter() - t0
        print(f"  (the top-k itself, kernels.log_softmax_topk over the logits: {1000 * statistics.median(t):.2f} ms)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
