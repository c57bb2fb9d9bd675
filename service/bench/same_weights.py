"""Part (f) of the engine benchmark: the same weights in four systems, side by side in one run.

    python -m service.bench_engine --parts f --rounds 3 --json same_weights.json
    python -m service.bench_engine --parts f --limit 100 --rounds 1 --beams 1 --layouts 2x1   # a quick look

    python -m service.bench_engine --parts f --preset base --vocab-size 32000 --tokens 20 --limit 300

The shipped model (``--checkpoint``) is exported to MarianMT (``model/interop/marian_export.py``, float32) and
converted to CTranslate2 (``model/interop/ct2.py``) in a temporary directory; then test_2016_flickr's sentences
(``--limit N``: the first N) are translated by each system (``--f-systems``):

  engine               this repository's continuous engine, float32 linear layers, all sentences
                       submitted at once (``--engine-slots`` KV-cache slots)
  engine int8          the same engine with int8 linear layers (the CPU default, ``model/inference/linear.py``)
                       (each worker builds and starts one engine, its KV cache allocated, outside the clock, as
                       CTranslate2's translator is built; it takes the sentences in corpus order)
  transformers         ``MarianMTModel.generate()`` on the export (its generation_config: our search)
  CTranslate2 float32  the conversion, ``compute_type`` float32
  CTranslate2 int8     the same weights, ``compute_type`` int8

transformers and CTranslate2 get length-sorted batches of 32 with the budget of the batch's longest
source (``default_max_new_tokens``, which the engine applies per sentence). CTranslate2 returns each
hypothesis' score (``return_scores``), as the engine does for every result: without scores its greedy
search takes the argmax of the logits and skips the log-softmax over the 8k vocabulary, work the
engine must do (before 2026-12-01 the table was measured that way). Layouts (``--layouts``):
``1x2`` = one process with 2 threads (CTranslate2: ``intra_threads`` 2), ``2x1`` = two processes with
one thread each, the length-sorted sentences dealt round-robin. Every worker runs in its own spawned
process (torch and CTranslate2 bundle different OpenMP runtimes), warms up outside the clock, and
waits at a barrier; a run's wall time is first start to last end. Rounds (``--rounds``) interleave
every (beam, layout, system), in a rotated order; the median run by tokens/s is reported.
Generated tokens: the best hypothesis' tokens plus EOS when it was generated, for every system.
BLEU: cased sacreBLEU (13a) of the median run's outputs, decoded by our tokenizer, against the
English references. Tokenization is done before any clock starts. Figures, not a test.

Other shapes: ``--preset NAME`` translates with random weights of that ``ModelConfig`` preset (seed
``--seed``) instead of the checkpoint, written to a temporary checkpoint with the checkpoint's
tokenizer; ``--vocab-size V`` gives it V output rows, the ids past the tokenizer's pieces named
``<extra_i>`` in a ``vocab.json`` (a synthetic vocabulary: the sources use the tokenizer's pieces,
the outputs may be any of the V). ``--tokens N`` makes every system generate exactly N tokens per
sentence (EOS banned before N, the search stopped at N: the engine's ``min_new_tokens`` =
``max_new_tokens``, CTranslate2's ``min_decoding_length`` = ``max_decoding_length``, transformers'
``min_new_tokens`` = ``max_new_tokens``), as ``../shared/BENCHMARKS.md``'s protocol does, so that every
system does the same work whatever its weights; BLEU of random weights means nothing.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from .engine import E_BATCH, Run, beam_name, in_children, median_run, run_engine

SYSTEMS = ("engine", "engine int8", "transformers", "CTranslate2 float32", "CTranslate2 int8")
REFERENCES = ("CTranslate2 float32", "CTranslate2 int8")      # the ratios' denominators
DATA = Path(__file__).resolve().parents[2] / "model" / "data" / "multi30k"


# ---- workers: one spawned process each -------------------------------------------------------------

def _batches(srcs, budgets):
    """Length-sorted srcs (as dealt) in batches of E_BATCH, with the budget of each batch's longest
    (budgets: ``default_max_new_tokens`` of each source, computed by the parent: importing
    model.translate would load torch into a CTranslate2 worker)."""
    for start in range(0, len(srcs), E_BATCH):
        yield srcs[start: start + E_BATCH], max(budgets[start: start + E_BATCH])


def _translator(spec: dict):
    """``translate(srcs) -> (outputs without EOS, generated tokens)`` for spec's system, loaded here."""
    system, threads, beam, eos, budgets = spec["system"], spec["threads"], spec["beam"], spec["eos"], spec["budgets"]
    fixed = spec.get("tokens")           # --tokens: exactly this many tokens per sentence
    prefix = spec.get("prefix") or None  # a forced target-language token (multilingual families)
    if system.startswith("CTranslate2"):
        from model.interop.ct2 import CT2Model
        before = rss_mb()
        ct2 = CT2Model(spec["ct2"], system.split()[1], inter_threads=1, intra_threads=threads)
        loaded = rss_mb() - before

        def translate(srcs):
            outs = []
            for batch, budget in _batches(srcs, budgets):
                # with scores, as the engine (every result carries its score; without them CTranslate2's
                # greedy search skips the log-softmax)
                outs += ct2.translate_ids(batch, beam, budget, E_BATCH, with_eos=True, return_scores=True,
                                          min_new_tokens=fixed or 0, target_prefix=prefix)
            return [o[:-1] if o[-1:] == [eos] else o for o in outs], sum(map(len, outs))
        translate.rss_mb = loaded
        return translate
    import torch
    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    if system == "transformers":
        from transformers import MarianMTModel
        from model.inference.generate import pad_batch
        hf = MarianMTModel.from_pretrained(spec["export"]).eval()

        def translate(srcs):
            outs, n = [], 0
            for batch, budget in _batches(srcs, budgets):
                ids = pad_batch(batch, spec["pad"])
                rows = hf.generate(input_ids=ids, attention_mask=(ids != spec["pad"]).long(), num_beams=beam,
                                   do_sample=False, max_new_tokens=budget, min_new_tokens=fixed or 0).tolist()
                for r in rows:              # start token, then tokens, EOS, pad after EOS
                    r = r[1:]
                    ended = eos in r
                    outs.append(r[: r.index(eos)] if ended else r)
                    n += len(outs[-1]) + ended
            return outs, n
        return translate
    from model.load import load_model
    from service.engine import torch_threads, tune_process
    before = rss_mb()
    with torch_threads(1):                 # see engine._engine_parts_worker
        model, _, _ = load_model(spec["checkpoint"], linear_dtype="int8" if system == "engine int8" else "float32")
    loaded = rss_mb() - before
    tune_process()

    # One engine per worker, built and started outside the clock as CTranslate2's translator is (its
    # KV cache allocated once, as a replica's), serving the warm-up and then the timed sentences. It
    # takes them all at once in corpus order (as part (c), and as requests arrive), not length-sorted:
    # sorted, the longest would be admitted last and decode alone at the end. The outputs go back in
    # the order given.
    from service.engine import Engine, EngineConfig
    loop = asyncio.new_event_loop()
    engine = Engine(model, EngineConfig(max_num_seqs=spec["slots"], max_waiting=max(len(spec["srcs"]), 1)))
    loop.run_until_complete(engine.start())
    order = sorted(range(len(spec["index"])), key=spec["index"].__getitem__)

    def translate(srcs):
        ids = order if len(srcs) == len(order) else range(len(srcs))
        run = loop.run_until_complete(run_engine(model, [srcs[i] for i in ids], beam, spec["slots"], part="(f)",
                                                 fixed_len=fixed, engine=engine, prefix=prefix or ()))
        outputs: list = [None] * len(srcs)
        for i, out in zip(ids, run.outputs):
            outputs[i] = out
        return outputs, run.tokens
    translate.close = lambda: loop.run_until_complete(engine.stop())     # its step loop ends before the process
    translate.rss_mb = loaded
    return translate


def rss_mb() -> float:
    """This process's resident memory (VmRSS), MiB; the "loaded model" figure is its growth over a load."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _f_worker(spec: dict, barrier, queue) -> None:
    try:
        translate = _translator(spec)
        translate(spec["srcs"][: 2 * E_BATCH])          # warm-up outside the clock
        barrier.wait()
        t_start = time.time()
        outputs, tokens = translate(spec["srcs"])
        queue.put({"ok": True, "start": t_start, "end": time.time(), "tokens": tokens, "outputs": outputs,
                   "index": spec["index"], "rss_mb": getattr(translate, "rss_mb", None)})
        getattr(translate, "close", lambda: None)()
    except BaseException as e:  # noqa: BLE001 - report to the parent instead of hanging it
        queue.put({"ok": False, "error": f"{spec['system']}: {e!r}"})
        try:
            barrier.abort()
        except Exception:  # noqa: BLE001
            pass


def run_f_layout(common: dict, srcs: list[list[int]], system: str, layout: str, beam: int) -> Run:
    """One run of ``system`` over srcs in ``layout`` (processes x threads); outputs in srcs' order."""
    from model.inference.generate import default_max_new_tokens
    procs_n, threads = (int(x) for x in layout.split("x"))
    order = sorted(range(len(srcs)), key=lambda i: len(srcs[i]))
    specs = [common | {"system": system, "threads": threads, "beam": beam, "index": order[i::procs_n],
                       "srcs": [srcs[j] for j in order[i::procs_n]],
                       "budgets": [common.get("tokens") or default_max_new_tokens(len(srcs[j]), common["max_len"])
                                   for j in order[i::procs_n]]}
             for i in range(procs_n)]
    outs = in_children(_f_worker, specs, "(f) worker", omp_threads=threads)
    outputs: list = [None] * len(srcs)
    for o in outs:
        for i, hyp in zip(o["index"], o["outputs"]):
            outputs[i] = hyp
    wall = max(o["end"] for o in outs) - min(o["start"] for o in outs)
    return Run("(f)", system, beam, len(srcs), sum(o["tokens"] for o in outs), wall, [], layout,
               profile={"rss_mb": [o["rss_mb"] for o in outs]}, outputs=outputs)


# ---- other shapes: a random checkpoint -------------------------------------------------------------

def random_checkpoint(out: Path, preset: str, tokenizer_file: Path, vocab_size: Optional[int] = None,
                      seed: int = 0) -> Path:
    """Write a checkpoint directory ``out`` with random weights (``torch.manual_seed(seed)``) of the
    ``ModelConfig`` preset, float32, and the SentencePiece model ``tokenizer_file``. With
    ``vocab_size`` larger than the tokenizer's pieces, the tokenizer is written as an import's
    (``source.spm``, ``target.spm``, ``vocab.json``) whose ids past the pieces are ``<extra_i>``.
    Raises ValueError for a vocab_size smaller than the tokenizer's pieces."""
    import torch
    from model.checkpoint import save_checkpoint
    from model.config import ModelConfig
    from model.tokenizer import Tokenizer
    from model.transformer import Transformer
    tok = Tokenizer(tokenizer_file)
    v = vocab_size or tok.vocab_size
    if v < tok.vocab_size:
        raise ValueError(f"--vocab-size {v}: the tokenizer already has {tok.vocab_size} pieces")
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.from_name(preset, vocab_size=v)).eval()
    meta = {"note": f"random weights, {preset} preset, {v} vocabulary rows", "source_lang": "de", "target_lang": "en"}
    if v == tok.vocab_size:
        return save_checkpoint(out, model, tokenizer_file, meta, dtype="float32")
    out.mkdir(parents=True, exist_ok=True)
    vocab = {tok.sp.id_to_piece(i): i for i in range(tok.vocab_size)} | {f"<extra_{i}>": i for i in range(tok.vocab_size, v)}
    for name in ("source.spm", "target.spm"):
        shutil.copyfile(tokenizer_file, out / name)
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False) + "\n", encoding="utf-8")
    return save_checkpoint(out, model, [out / "source.spm", out / "target.spm", out / "vocab.json"], meta, dtype="float32")


# ---- the table -------------------------------------------------------------------------------------

def table_rows(runs: list[Run], bleu: dict[tuple[str, str, int], float],
               rounds: Optional[dict[tuple[str, str, int], list[Run]]] = None) -> list[dict]:
    """One row per run (its system, layout and beam size): tokens/s, sentences/s, BLEU (None where
    ``bleu`` has none), and the ratio
    of tokens/s to each CTranslate2 system of the same layout and beam size (None if not run). With
    ``rounds`` (every round's run of each configuration, in round order; two or more rounds), also the
    median over rounds of the ratio within each round (``round_ratio_to_...``): each round's two runs
    are minutes apart, so this ratio is less exposed to the machine's drift than the ratio of medians."""
    by = {(r.system, r.layout, r.beam): r for r in runs}
    rows = []
    for r in runs:
        b = bleu.get((r.system, r.layout, r.beam))
        row = {"system": r.system, "layout": r.layout, "beam_size": r.beam, "tokens_per_s": round(r.tokens_per_s, 1),
               "sentences_per_s": round(r.sentences_per_s, 2), "bleu": None if b is None else round(b, 2),
               "sentences": r.sentences, "generated_tokens": r.tokens}
        for ref in REFERENCES:
            other = by.get((ref, r.layout, r.beam))
            key = ref.replace(" ", "_")
            row[f"ratio_to_{key}"] = round(r.tokens_per_s / other.tokens_per_s, 3) if other else None
            if rounds is not None:
                mine, theirs = rounds.get((r.system, r.layout, r.beam), []), rounds.get((ref, r.layout, r.beam), [])
                pairs = [a.tokens_per_s / b.tokens_per_s for a, b in zip(mine, theirs)]
                row[f"round_ratio_to_{key}"] = round(statistics.median(pairs), 3) if len(pairs) >= 2 else None
        rows.append(row)
    return rows


def print_rows(rows: list[dict]) -> None:
    def ratio(x):
        return f"{x:.2f}x" if x is not None else "-"
    by_round = any(r.get("round_ratio_to_CTranslate2_int8") is not None
                   or r.get("round_ratio_to_CTranslate2_float32") is not None for r in rows)
    extra = f" {'rounds/f32':>10} {'rounds/int8':>11}" if by_round else ""
    print(f"\n{'system':20} {'layout':6} {'decoding':8} {'sent/s':>8} {'tok/s':>8} {'/CT2 f32':>9} {'/CT2 int8':>9} "
          f"{'BLEU':>6}{extra}")
    for r in rows:
        extra = (f" {ratio(r.get('round_ratio_to_CTranslate2_float32')):>10} "
                 f"{ratio(r.get('round_ratio_to_CTranslate2_int8')):>11}") if by_round else ""
        print(f"{r['system']:20} {r['layout']:6} {beam_name(r['beam_size']):8} {r['sentences_per_s']:8.1f} "
              f"{r['tokens_per_s']:8.0f} {ratio(r['ratio_to_CTranslate2_float32']):>9} "
              f"{ratio(r['ratio_to_CTranslate2_int8']):>9} {'-' if r['bleu'] is None else format(r['bleu'], '6.2f'):>6}{extra}")
    if by_round:
        print("(/CT2: ratio of the median runs; rounds/: median over rounds of the ratio within a round)")


def report(runs: list[Run], decode, refs: list[str], json_path=None,
           rounds: Optional[dict[tuple[str, str, int], list[Run]]] = None) -> list[dict]:
    """BLEU of each run's outputs (``decode``: ids -> text) against refs, the table printed, and its
    rows (``table_rows``, with ``rounds``' per-round ratios) written to ``json_path`` as a JSON list
    when given; returns the rows."""
    import sacrebleu
    bleu = {(r.system, r.layout, r.beam): sacrebleu.corpus_bleu([decode(h) for h in r.outputs], [refs]).score
            for r in runs}
    rows = table_rows(runs, bleu, rounds)
    print_rows(rows)
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {json_path}")
    return rows


def run_same_weights(args, beams: list[int], ckpt: Path) -> int:
    """Part (f) for every beam, layout and system of args; prints the table and writes --json.
    Returns the exit status (2: an unknown system)."""
    systems = [x.strip() for x in args.f_systems.split(",") if x.strip()]
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    if unknown := set(systems) - set(SYSTEMS):
        print(f"--f-systems: unknown {sorted(unknown)}; choose from {', '.join(SYSTEMS)}", file=sys.stderr)
        return 2
    from model.load import load_model
    from model.interop.ct2 import convert_export
    from model.interop.marian_export import export_marian
    from model.tokenizer import read_lines
    from model.tokenizer import encode_source
    lines = read_lines(DATA / "test_2016_flickr.de.gz")[: args.limit]
    refs = read_lines(DATA / "test_2016_flickr.en.gz")[: args.limit]
    with tempfile.TemporaryDirectory() as tmp:
        if args.preset:
            ckpt = random_checkpoint(Path(tmp) / "random", args.preset, ckpt / "tokenizer.model",
                                     args.vocab_size, args.seed)
        _, tok, _ = load_model(ckpt, pack=False)
        cfg = json.loads((ckpt / "config.json").read_text())
        srcs = [encode_source(tok, line, cfg["max_len"]) for line in lines]
        export = export_marian(ckpt, Path(tmp) / "marian")
        common = {"checkpoint": str(ckpt), "export": str(export), "ct2": str(convert_export(export, Path(tmp) / "ct2")),
                  "slots": args.engine_slots, "eos": cfg["eos_id"], "pad": cfg["pad_id"], "max_len": cfg["max_len"],
                  "tokens": args.tokens}
        shape = (f"random {args.preset} (d_model {cfg['d_model']}, {cfg['n_encoder_layers']}+{cfg['n_decoder_layers']} "
                 f"layers, vocabulary {cfg['vocab_size']})" if args.preset else f"{ckpt} exported")
        length = f"exactly {args.tokens} tokens per sentence" if args.tokens else "the engine's length budgets"
        print(f"\n(f) same weights, one run: {shape}; {len(srcs)} sentences, {length}; systems {', '.join(systems)}; "
              f"layouts {', '.join(layouts)}; {args.rounds} interleaved round(s), median by tokens/s")
        rounds = run_rounds(common, srcs, systems, layouts, beams, args.rounds)
    runs = [median_run(rounds[(s, lay, b)]) for b in beams for lay in layouts for s in systems]
    report(runs, tok.decode, refs, args.json, rounds)
    return 0


def run_rounds(common: dict, srcs: list[list[int]], systems: list[str], layouts: list[str], beams: list[int],
               n_rounds: int) -> dict[tuple[str, str, int], list[Run]]:
    """``n_rounds`` interleaved rounds of every (beam, layout, system) over srcs (``run_f_layout``), the
    systems' order rotated each round; each run printed as it ends. Returns (system, layout, beam) ->
    its runs in round order (``median_run`` picks the reported one)."""
    rounds: dict[tuple[str, str, int], list[Run]] = {}
    for k in range(n_rounds):
        for beam in beams:
            for layout in layouts:
                for system in systems[k % len(systems):] + systems[: k % len(systems)]:
                    run = run_f_layout(common, srcs, system, layout, beam)
                    rounds.setdefault((system, layout, beam), []).append(run)
                    print(f"  round {k + 1}: {system:20} {layout} {beam_name(beam):7} {run.tokens_per_s:8.0f} tok/s",
                          flush=True)
    return rounds
