"""Engine benchmark: sentences/s, generated tokens/s and latency p50/p99, side by side in one run.

    python -m service.bench_engine                          # every part, 1,000 sentences, greedy and beam 4
    python -m service.bench_engine --parts a,b,c --limit 200 --beams 1
    python -m service.bench_engine --parts e --layouts 1x2,2x1 --rounds 5
    python -m service.bench_engine --parts f --rounds 3 --json same_weights.json
    python -m service.bench_engine --parts a,b,c --rounds 3     # (b) and (c) alternate, medians shown

Parts (German test_2016_flickr sentences; tokenization is done before any clock starts):
  (a) sequential: ``model.inference.generate.generate`` on one sentence at a time (batch 1);
  (b) static: ``generate`` on length-sorted batches of 32, each running until its longest member ends;
  (c) the continuous engine with every sentence submitted at once (corpus order);
  (d) the engine with Poisson arrivals at 50% and 90% of (c)'s sentences/s;
  (e) the protocol of ``../shared/BENCHMARKS.md`` (random weights of the shipped shape, exactly 20
      generated tokens per sentence, layouts of processes x threads), see ``service/bench/protocol.py``;
  (f) same weights, one run: the shipped model exported, in this engine, transformers' generate() and
      CTranslate2 float32 / int8, with ratios and BLEU (``--json FILE``), see ``service/bench/same_weights.py``.
(a)-(d) and (f) need the shipped model (``--checkpoint``); (e) needs only its 8k tokenizer (``--tokenizer``).
Latency: from submission (everything at t=0 except in (d)) to the sentence's result. Generated
tokens: the best hypothesis' tokens, EOS included when it was generated. Figures, not a test.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from model.inference.linear import linear_dtype, pack_for_inference

E_BATCH = 32                  # sentences per static batch, in (b) and protocol (e)


@dataclass
class Run:
    """One measured configuration."""
    part: str
    system: str
    beam: int
    sentences: int
    tokens: int
    wall_s: float
    latencies: list[float]
    layout: str = ""
    profile: dict = field(default_factory=dict)
    outputs: list = field(default_factory=list)   # best hypotheses' target ids, in input order (part (f))

    @property
    def sentences_per_s(self) -> float:
        return self.sentences / self.wall_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    def pct(self, q: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def n_generated(h) -> int:
    return len(h.tokens) + (h.finish_reason == "eos")


# ---- (a), (b): offline decoding ------------------------------------------------------------------

def run_sequential(model, srcs, beam: int) -> Run:
    from model.inference.generate import generate
    from model.inference.generate import default_max_new_tokens
    lat, tokens = [], 0
    t0 = time.perf_counter()
    for s in srcs:
        t = time.perf_counter()
        h = generate(model, [s], beam, 1, default_max_new_tokens(len(s), model.cfg.max_len))[0][0]
        lat.append(time.perf_counter() - t)
        tokens += n_generated(h)
    return Run("(a)", "sequential, batch 1", beam, len(srcs), tokens, time.perf_counter() - t0, lat)


def run_static(model, srcs, beam: int, batch_size: int = E_BATCH, max_new: Optional[int] = None,
               part: str = "(b)") -> Run:
    """Length-sorted batches; every sentence is submitted at t=0, so its latency is its batch's end."""
    from model.inference.generate import generate
    from model.inference.generate import default_max_new_tokens
    order = sorted(range(len(srcs)), key=lambda i: len(srcs[i]))
    lat, tokens = [], 0
    t0 = time.perf_counter()
    for start in range(0, len(order), batch_size):
        batch = [srcs[i] for i in order[start: start + batch_size]]
        m = max_new or default_max_new_tokens(max(len(s) for s in batch), model.cfg.max_len)
        hyps = generate(model, batch, beam, 1, m)
        tokens += sum(n_generated(h[0]) for h in hyps)
        lat += [time.perf_counter() - t0] * len(batch)
    return Run(part, f"static generate(), batches of {batch_size}", beam, len(srcs), tokens,
               time.perf_counter() - t0, lat)


# ---- (c), (d), (e): the engine ---------------------------------------------------------------------

class StepProfile:
    """Sums of StepStats: where an engine run's time goes."""

    def __init__(self):
        self.steps = self.rows = self.prefills = self.prefill_rows = 0
        self.prefill_s = self.decode_s = self.update_s = self.step_s = 0.0

    def __call__(self, st) -> None:
        self.steps += 1
        self.rows += st.num_decode_seqs
        if st.num_prefill_requests:
            self.prefills += 1
            self.prefill_rows += st.num_prefill_requests
        self.prefill_s += st.prefill_s
        self.decode_s += st.decode_s
        self.update_s += st.update_s
        self.step_s += st.duration_s

    def as_dict(self, wall_s: float) -> dict:
        return {"steps": self.steps, "mean_decode_rows": self.rows / max(self.steps, 1),
                "prefill_batches": self.prefills, "mean_prefill_batch": self.prefill_rows / max(self.prefills, 1),
                "prefill_s": self.prefill_s, "decode_s": self.decode_s, "update_s": self.update_s,
                "loop_s": self.step_s - self.prefill_s - self.decode_s - self.update_s,
                "idle_s": wall_s - self.step_s, "wall_s": wall_s}


async def run_engine(model, srcs, beam: int, num_seqs: int, arrivals: Optional[list[float]] = None,
                     fixed_len: Optional[int] = None, policy: str = "decode_first", part: str = "(c)",
                     admission: str = "fifo",
                     system: str = "continuous engine, all at once", warmup: bool = True,
                     prefill_every: int = 4, dtype: str = "auto", engine=None, prefix: Sequence[int] = ()) -> Run:
    """Submit every sentence (at once, or at the given arrival offsets in seconds) and await all;
    with warmup, first push a few batches through a throw-away engine (outside the clock). With
    ``engine`` (started on this event loop), that engine serves the sentences and stays running, as a
    replica's does (the engine arguments and warmup are then unused). ``prefix``: target ids forced
    first at log-prob 0 (a multilingual model's target-language token; counted in ``fixed_len``)."""
    from service.engine import Engine, EngineConfig, GenerationOptions
    forced = {"target_prefix": tuple(prefix), "free_prefix": len(prefix)}
    opts = GenerationOptions(beam_size=beam, n_best=1, **forced)
    if fixed_len is not None:
        n = fixed_len - len(prefix)          # the engine counts its budgets after the prefix
        opts = GenerationOptions(beam_size=beam, max_new_tokens=n, min_new_tokens=n, **forced)
    config = EngineConfig(max_num_seqs=num_seqs, max_waiting=max(len(srcs), 1), policy=policy, admission=admission,
                          prefill_every=prefill_every, dtype=dtype)
    prof = StepProfile()
    own = engine is None
    if own:
        if warmup:
            warm = Engine(model, config)
            await asyncio.gather(*[warm.translate(s, opts) for s in srcs[: min(len(srcs), 2 * E_BATCH)]])
            await warm.stop()
        engine = Engine(model, config, on_step=prof)
        await engine.start()
    else:
        engine.on_step = prof
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    if arrivals is None:
        tasks = [asyncio.ensure_future(engine.translate(s, opts)) for s in srcs]
    else:
        tasks, start = [], loop.time()
        for s, at in zip(srcs, arrivals):
            delay = start + at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(engine.translate(s, opts)))
    results = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    if own:
        await engine.stop()
    tokens = sum(r.timings.generated_tokens for r in results)
    return Run(part, system, beam, len(srcs), tokens, wall, [r.timings.total_s for r in results],
               profile=prof.as_dict(wall), outputs=[r.hypotheses[0].tokens for r in results])


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


# ---- (c), (d) in a child process -------------------------------------------------------------------

def _engine_parts_worker(spec: dict, barrier, queue) -> None:
    """(c) and (d) in a fresh process whose set-up runs single-threaded, so that only the engine's
    worker thread runs multi-threaded OpenMP regions (see ``service.engine.torch_threads``: a
    second thread team on a 2-core machine slows small ops down). (a) and (b) run in the
    parent's main thread, which is equally alone."""
    try:
        import torch
        from service.engine import torch_threads, tune_process
        torch.set_grad_enabled(False)
        torch.set_num_threads(spec["threads"])
        with torch_threads(1):
            model, _, _, dtype = bench_model(spec)
        tune_process()
        srcs, beam, slots = spec["srcs"], spec["beam"], spec["slots"]
        kw = {"policy": spec["policy"], "prefill_every": spec["prefill_every"], "dtype": dtype,
              "admission": spec.get("admission", "fifo")}
        out = []
        cont = asyncio.run(run_engine(model, srcs, beam, slots, **kw))
        out.append(cont)
        if "d" in spec["parts"]:
            for frac in (0.5, 0.9):
                rate = frac * cont.sentences_per_s
                out.append(asyncio.run(run_engine(
                    model, srcs, beam, slots, arrivals=poisson_arrivals(len(srcs), rate, spec["seed"]), part="(d)",
                    system=f"continuous, Poisson {frac:.0%} of (c) = {rate:.1f}/s", **kw)))
        queue.put({"ok": True, "runs": out})
    except BaseException as e:  # noqa: BLE001 - report to the parent instead of hanging it
        queue.put({"ok": False, "error": repr(e)})


def bench_model(spec: dict):
    """(model, tokenizer, metadata, dtype name) of a run: random weights of ``spec["preset"]`` (a
    ``ModelConfig`` preset, the checkpoint's tokenizer, seed ``spec["seed"]``) when given, else the
    checkpoint; on ``spec["device"]`` (default cpu) in ``spec["dtype"]`` (default auto: bfloat16 on
    CUDA, float32 on CPU; ``service.engine.config.resolve_dtype``), its linear layers prepared in
    ``spec["linear_dtype"]`` (default: the process's, ``model.inference.settings``)."""
    import torch
    from model.load import load_model
    from service.engine.config import resolve_dtype
    device = torch.device(spec.get("device") or "cpu")
    dtype = resolve_dtype(spec.get("dtype") or "auto", device.type)
    if spec.get("preset"):
        from model.config import ModelConfig
        from model.tokenizer import Tokenizer
        from model.transformer import Transformer
        tok = Tokenizer(Path(spec["checkpoint"]) / "tokenizer.model")
        torch.manual_seed(spec.get("seed", 0))
        model = Transformer(ModelConfig.from_name(spec["preset"], vocab_size=tok.vocab_size)).eval()
        pack_for_inference(model, spec.get("linear_dtype"))
        meta = {"note": f"random weights, {spec['preset']} preset"}
    else:
        model, tok, meta = load_model(spec["checkpoint"], device=device, linear_dtype=spec.get("linear_dtype"))
    return model.to(device=device, dtype=getattr(torch, dtype)), tok, meta, dtype


def in_children(target, specs: list[dict], what: str, omp_threads: Optional[int] = None) -> list[dict]:
    """Run ``target(spec, barrier, queue)`` in one spawned process per spec (the barrier spans all of
    them) and return what each put on the queue; raises RuntimeError if one reported a failure.
    ``omp_threads`` sets OMP_NUM_THREADS for the children."""
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(len(specs)), ctx.Queue()
    old_env = os.environ.get("OMP_NUM_THREADS")
    if omp_threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(omp_threads)
    try:
        procs = [ctx.Process(target=target, args=(spec, barrier, queue), daemon=True) for spec in specs]
        for p in procs:
            p.start()
        outs = [queue.get(timeout=3600) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    finally:
        if old_env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old_env
    bad = [o["error"] for o in outs if not o["ok"]]
    if bad:
        raise RuntimeError(f"{what} failed: {bad[0]}")
    return outs


def run_engine_parts(spec: dict) -> list[Run]:
    return in_children(_engine_parts_worker, [spec], "engine part")[0]["runs"]


# ---- reporting ------------------------------------------------------------------------------------

def beams_and_layouts(ap, beams: str, layouts: str) -> tuple[list[int], list[tuple[int, ...]]]:
    """``--beams`` ("1,4") and ``--layouts`` ("1x2,2x1": processes x threads) as lists; a malformed one
    is ``ap.error`` naming both (exit 2)."""
    try:
        return ([int(b) for b in beams.split(",")],
                [tuple(int(n) for n in x.split("x")) for x in layouts.split(",") if x.strip()])
    except ValueError:
        ap.error(f"--beams takes integers (1,4) and --layouts PROCESSESxTHREADS (1x2,2x1), got {beams!r} "
                 f"and {layouts!r}")


def beam_name(beam: int) -> str:
    return "greedy" if beam == 1 else f"beam {beam}"


def print_table(runs: list[Run], title: str) -> None:
    print(f"\n{title}")
    print(f"{'part':5} {'system':44} {'layout':6} {'decoding':8} {'sent/s':>8} {'tok/s':>9} "
          f"{'p50 ms':>9} {'p99 ms':>9}")
    for r in runs:
        print(f"{r.part:5} {r.system:44} {r.layout:6} {beam_name(r.beam):8} {r.sentences_per_s:8.1f} "
              f"{r.tokens_per_s:9.0f} {r.pct(0.5) * 1e3:9.0f} {r.pct(0.99) * 1e3:9.0f}")


def print_profile(run: Run) -> None:
    p = run.profile
    if not p:
        return
    w = p["wall_s"]
    where = f" {run.layout} (first worker)" if run.layout else ""
    print(f"  profile {run.part}{where} {beam_name(run.beam)}: {p['steps']} steps, "
          f"{p['mean_decode_rows']:.1f} decode rows/step, "
          f"{p['prefill_batches']} prefills x {p['mean_prefill_batch']:.1f} sentences; time: prefill "
          f"{p['prefill_s'] / w:.0%}, decode_step {p['decode_s'] / w:.0%}, top-k+search+reorder "
          f"{p['update_s'] / w:.0%}, loop hand-off {p['loop_s'] / w:.0%}, idle {p['idle_s'] / w:.0%}")


def median_run(runs: list[Run]) -> Run:
    return sorted(runs, key=lambda r: r.tokens_per_s)[len(runs) // 2]


def run_model_parts(args, parts: set[str], beams: list[int], ckpt: Path, lines: list[str]) -> None:
    """Parts (a)-(d) on the shipped model: (b) and (c) alternate for --rounds rounds, medians shown."""
    import torch
    from model.inference.generate import generate
    from model.tokenizer import encode_source
    from service.engine import tune_process
    torch.set_num_threads(args.threads)
    where = {"checkpoint": str(ckpt), "preset": args.preset, "device": args.device, "dtype": args.dtype,
             "seed": args.seed, "linear_dtype": args.linear_dtype}
    model, tok, meta, dtype = bench_model(where)
    srcs = [encode_source(tok, line, model.cfg.max_len) for line in lines]
    tune_process()  # as in every process of this benchmark, static and engine alike
    print(f"(a)-(d): {ckpt} ({meta.get('note', 'shipped model')}); {len(srcs)} sentences, "
          f"{sum(map(len, srcs))} source tokens; {args.threads} torch threads; engine: policy "
          f"{args.policy}, admission {args.admission}, prefill_every {args.prefill_every}, {args.engine_slots} sentences in flight "
          f"({args.engine_slots} x beam slots); linear layers "
          f"{linear_dtype(model)}; {next(model.parameters()).device}, {dtype}")
    generate(model, srcs[:8], 2, 1, 20)  # warm-up outside the clock
    runs, per_round = [], []
    for beam in beams:
        slots = args.engine_slots * beam   # the paged cache makes slots cheap: as many sentences for beams
        if "a" in parts:
            runs.append(run_sequential(model, srcs, beam))
        # (b) and (c) alternate for --rounds rounds and the medians are shown: this machine is noisy
        statics, conts, others = [], [], []
        for r in range(args.rounds):
            if "b" in parts:
                statics.append(run_static(model, srcs, beam))
            if "c" in parts or ("d" in parts and r == args.rounds - 1):
                todo = {"c"} | ({"d"} & parts if r == args.rounds - 1 else set())
                got = run_engine_parts({**where, "threads": args.threads, "srcs": srcs,
                                        "beam": beam, "slots": slots, "policy": args.policy, "admission": args.admission,
                                        "prefill_every": args.prefill_every, "seed": args.seed,
                                        "parts": sorted(todo)})
                conts += [x for x in got if x.part == "(c)"]
                others += [x for x in got if x.part != "(c)"]
        runs += ([median_run(statics)] if statics else []) + ([median_run(conts)] if "c" in parts else []) + others
        if len(statics) > 1 and len(conts) == len(statics):  # per round: (b) and (c) ran back to back
            pairs = [f"{b.sentences_per_s:.1f}/{c.sentences_per_s:.1f}={c.tokens_per_s / b.tokens_per_s:.2f}x"
                     for b, c in zip(statics, conts)]
            per_round.append(f"  {beam_name(beam)} rounds, (b)/(c) sent/s = ratio: " + ", ".join(pairs))
    print_table(runs, f"(a)-(d) {'random ' + args.preset if args.preset else 'shipped model'} on {args.device}")
    for beam in beams:
        by = {r.part: r for r in runs if r.beam == beam and r.part != "(d)"}
        ratios = []
        if "(c)" in by and "(b)" in by:
            r = by["(c)"].tokens_per_s / by["(b)"].tokens_per_s
            ratios.append(f"continuous/static {r:.2f}x (target >= 1.3x)")
        if "(c)" in by and "(a)" in by:
            r = by["(c)"].tokens_per_s / by["(a)"].tokens_per_s
            ratios.append(f"continuous/sequential {r:.2f}x (target >= 4x)")
        if ratios:
            print(f"  {beam_name(beam)}: " + "; ".join(ratios))
    for line in per_round:
        print(line)
    for r in runs:
        print_profile(r)
