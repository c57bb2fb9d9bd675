"""Part (e) of the engine benchmark: the protocol of ``../shared/BENCHMARKS.md``. That table's figures
were measured on other days, on machines that differ by up to 2x, so they are no yardstick here: part
(f) (``service/bench/same_weights.py``) runs transformers and CTranslate2 beside the engine.
Random weights of the shipped shape (small preset, the shipped 8k vocabulary), exactly E_TOKENS
generated tokens per sentence (EOS masked via ``min_new_tokens``), length-sorted batches of E_BATCH
sentences (engine: E_BATCH x beam_size slots). Each layout runs in fresh processes: "1x2" = one
process with 2 torch threads, "2x1" = two processes with 1 thread each, splitting the sentences.
"""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Optional

from .engine import E_BATCH, Run, in_children, median_run, print_profile, print_table, run_engine, run_static
from model.inference.linear import pack_for_inference

E_TOKENS = 20                 # generated tokens per sentence


# ---- (e) workers: one process per worker, so that threads and OpenMP pools are the layout's --------

def _e_worker(spec: dict, barrier, queue) -> None:
    import torch
    torch.set_num_threads(spec["threads"])
    torch.set_grad_enabled(False)
    from model.config import ModelConfig
    from model.transformer import Transformer
    from service.engine import torch_threads, tune_process
    torch.manual_seed(spec["seed"])
    with torch_threads(1 if spec["system"] == "engine" else spec["threads"]):  # see engine._engine_parts_worker
        model = Transformer(ModelConfig.from_name(spec.get("preset") or "small", vocab_size=spec["vocab_size"])).eval()
        pack_for_inference(model, spec.get("linear_dtype"))
        model.to(device=spec.get("device") or "cpu", dtype=getattr(torch, spec.get("dtype") or "float32"))
    tune_process()
    srcs, beam = spec["srcs"], spec["beam"]
    try:
        # warm-up outside the clock (allocators, kernels)
        if spec["system"] == "static":
            run_static(model, srcs[:2 * E_BATCH], beam, E_BATCH, E_TOKENS, "(e)")
        else:
            asyncio.run(run_engine(model, srcs[:2 * E_BATCH], beam, E_BATCH * beam, fixed_len=E_TOKENS, warmup=False,
                                   dtype=spec.get("dtype") or "auto"))
        barrier.wait()
        t_start = time.time()
        if spec["system"] == "static":
            run = run_static(model, srcs, beam, E_BATCH, E_TOKENS, "(e)")
        else:
            run = asyncio.run(run_engine(model, srcs, beam, E_BATCH * beam, fixed_len=E_TOKENS, part="(e)",
                                         warmup=False, dtype=spec.get("dtype") or "auto"))
        queue.put({"ok": True, "start": t_start, "end": time.time(), "tokens": run.tokens,
                   "sentences": run.sentences, "latencies": run.latencies, "profile": run.profile})
    except BaseException as e:  # noqa: BLE001 - report to the parent instead of hanging it
        queue.put({"ok": False, "error": repr(e)})
        try:
            barrier.abort()
        except Exception:  # noqa: BLE001
            pass


def run_layout(srcs, beam: int, layout: str, system: str, vocab_size: int, seed: int = 0,
               where: Optional[dict] = None) -> Run:
    """Run (e) with `processes x threads` = layout; sentences are length-sorted and dealt round-robin."""
    procs_n, threads = (int(x) for x in layout.split("x"))
    ordered = sorted(srcs, key=len)
    specs = [{"threads": threads, "seed": seed, "vocab_size": vocab_size, "srcs": ordered[i::procs_n], "beam": beam,
              "system": system, **(where or {})} for i in range(procs_n)]
    outs = in_children(_e_worker, specs, "(e) worker", omp_threads=threads)
    wall = max(o["end"] for o in outs) - min(o["start"] for o in outs)
    name = "continuous engine" if system == "engine" else f"static generate(), batches of {E_BATCH}"
    return Run("(e)", name, beam, sum(o["sentences"] for o in outs), sum(o["tokens"] for o in outs), wall,
               [x for o in outs for x in o["latencies"]], layout, outs[0]["profile"])


def run_protocol(args, lines: list[str], beams: list[int], ckpt: Path) -> int:
    """Runs (e) for every beam, system and layout of args (--rounds rounds each, the median kept) and
    prints the reference table and ours; returns the exit status (2: no tokenizer)."""
    from model.tokenizer import Tokenizer
    from model.tokenizer import encode_source
    tok_path = Path(args.tokenizer) if args.tokenizer else ckpt / "tokenizer.model"
    if not tok_path.exists():
        print(f"part (e) needs the shipped 8k tokenizer, and {tok_path} does not exist; pass --tokenizer PATH.",
              file=sys.stderr)
        return 2
    tok = Tokenizer(tok_path)
    srcs = [encode_source(tok, line, 256) for line in lines]
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    systems = [x.strip() for x in args.e_systems.split(",") if x.strip()]
    from service.engine.config import resolve_dtype
    where = {"device": args.device, "preset": args.preset, "linear_dtype": args.linear_dtype,
             "dtype": resolve_dtype(args.dtype, "cuda" if args.device.startswith("cuda") else "cpu")}
    print(f"\n(e) protocol of BENCHMARKS.md: random weights, {args.preset or 'small'} preset on {args.device} "
          f"in {where['dtype']}, vocab {tok.vocab_size}; "
          f"{len(srcs)} sentences, exactly {E_TOKENS} generated tokens each, length-sorted batches of {E_BATCH}; "
          f"{args.rounds} round(s), median shown")
    runs = []
    for beam in beams:
        for system in systems:
            for layout in layouts:
                rounds = []
                for _ in range(args.rounds):
                    rounds.append(run_layout(srcs, beam, layout, system, tok.vocab_size, args.seed, where))
                runs.append(median_run(rounds))
    print_table(runs, "(e) this repository")
    for r in runs:
        if r.system.startswith("continuous"):
            print_profile(r)
    return 0
