"""Same-weights speed at the multilingual families' published shapes: engine int8 against CTranslate2 int8.

    python -m service.bench.families --shape nllb-600m --rounds 3 [--limit N] [--beams 1,4] [--layouts 1x2,2x1]
    python -m service.bench.families --shape madlad-3b-4x4 --rounds 3 --dir /tmp/madlad   # keeps the models
    python -m service.bench.families --shape nllb-600m --dir /tmp/nllb --profile --beams 4 --limit 64

A random transformers model of the shape (``SHAPES``) is written in the published on-disk layout
(NLLB-200: ``M2M100ForConditionalGeneration`` with an ``NllbTokenizer``; MADLAD-400:
``T5ForConditionalGeneration``, untied ``lm_head``, with a ``T5Tokenizer``), each tokenizer holding the
full vocabulary of made-up pieces plus three language tokens; then imported with our importer
(the importer ``python -m model.convert --from-transformers`` runs, float32) and converted with CTranslate2's own converter
(``model.interop.ct2.convert_to_ct2``, int8), in a temporary directory (``--dir DIR``: there, reused
when present). Sources: test_2016_flickr's German sentences, each word mapped to a piece by a CRC32
of the word (a fixed tokenization into the synthetic vocabulary), in the family's template (NLLB:
``deu_Latn pieces </s>``, the target ``fra_Latn`` forced first at log-prob 0; MADLAD: ``<2fr>
pieces </s>``). Every system generates exactly ``--tokens`` tokens per sentence (the forced language
token included), through part (f)'s machinery (``same_weights.run_rounds``: one spawned worker per
process, interleaved rounds, medians by tokens/s, ratios; ``--systems`` among engine int8, engine,
CTranslate2 int8, CTranslate2 float32). Memory: each worker's VmRSS growth over loading its model
(the engine: ``load_model`` with its int8 copies, before the KV cache is allocated; CTranslate2: the
``Translator``). ``same``: the share of sentences whose output equals CTranslate2's of the same
arithmetic (engine int8: CTranslate2 int8; engine: CTranslate2 float32, here from int8 weights).

``--profile``: no comparison; engine int8 in this process over the sources, twice (the first a
warm-up), and where the second run's time goes: the engine's own split of its steps (prefill, decode
step, search update, loop), the decode step's output projection (``linear.output_logits``) and
pad/BOS masking, and the search update's log-softmax + top-k (``search._candidates``) and beam
ranking, each timed by a wrapper (the compiled kernels bypass torch's dispatcher, so torch.profiler
would not see them). Figures, not a test.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from .engine import beams_and_layouts, in_children, median_run
from .same_weights import DATA, print_rows, run_rounds, table_rows

SYSTEMS = ("engine int8", "engine", "CTranslate2 int8", "CTranslate2 float32")
NLLB_LANGS = ["deu_Latn", "eng_Latn", "fra_Latn"]          # source deu_Latn, target fra_Latn
T5_TAGS = ["<2de>", "<2en>", "<2fr>"]                      # target <2fr>
COUNTERPART = {"engine int8": "CTranslate2 int8", "engine": "CTranslate2 float32"}   # the "same" column


@dataclass(frozen=True)
class Shape:
    """A published model's shape, random weights."""
    family: str               # "nllb" (M2M100 layout, pre-LN) or "t5" (MADLAD-400's T5 layout)
    d_model: int
    layers: int               # encoder layers = decoder layers
    n_heads: int
    d_ff: int                 # T5: gated-GELU width
    vocab_size: int
    sentences: int            # the sentence count (the default --limit)
    d_kv: int = 0             # T5 head width (n_heads * d_kv may differ from d_model)


SHAPES = {
    "nllb-600m": Shape("nllb", 1024, 12, 16, 4096, 256_206, 300),             # NLLB-200-distilled-600M
    "madlad-3b-4x4": Shape("t5", 1024, 4, 16, 8192, 256_000, 200, d_kv=128),  # MADLAD-400-3B's layers, 4+4
    "nllb-tiny": Shape("nllb", 32, 2, 4, 64, 300, 8),                          # for the tests
    "madlad-tiny": Shape("t5", 32, 2, 4, 64, 300, 8, d_kv=16),
}


# ---- the models, written and converted in a spawned process (its memory is returned when it ends) ----

def _nllb_dir(d: Path, shape: Shape) -> dict:
    import torch
    from transformers import M2M100Config, M2M100ForConditionalGeneration, NllbTokenizer
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    n = shape.vocab_size - len(specials) - len(NLLB_LANGS) - 1          # then the languages and <mask>
    vocab = {t: i for i, t in enumerate(specials)} | {f"\u2581p{i}": len(specials) + i for i in range(n)}
    tok = NllbTokenizer(vocab=vocab, merges=[], extra_special_tokens=list(NLLB_LANGS), src_lang=NLLB_LANGS[0])
    if len(tok) > shape.vocab_size:
        raise ValueError(f"the synthetic tokenizer has {len(tok)} entries, more than {shape.vocab_size}")
    tok.save_pretrained(d)
    cfg = M2M100Config(vocab_size=shape.vocab_size, d_model=shape.d_model, encoder_layers=shape.layers,
                       decoder_layers=shape.layers, encoder_attention_heads=shape.n_heads,
                       decoder_attention_heads=shape.n_heads, encoder_ffn_dim=shape.d_ff, decoder_ffn_dim=shape.d_ff,
                       max_position_embeddings=1024, activation_function="relu", scale_embedding=True,
                       pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                       dropout=0.1, attention_dropout=0.1, tie_word_embeddings=True)
    torch.manual_seed(0)
    M2M100ForConditionalGeneration(cfg).eval().save_pretrained(d)
    gen = {"bos_token_id": 0, "decoder_start_token_id": 2, "eos_token_id": 2, "max_length": 200, "pad_token_id": 1}
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2))         # NLLB-200's, as published
    ids = tok.convert_tokens_to_ids(NLLB_LANGS)
    return {"pieces": [len(specials), n], "eos": 2, "pad": 1, "source_start": [ids[0]], "prefix": [ids[2]]}


def _t5_dir(d: Path, shape: Shape) -> dict:
    import torch
    from transformers import T5Config, T5ForConditionalGeneration, T5Tokenizer
    specials = ["<pad>", "</s>", "<unk>"]
    n = shape.vocab_size - len(specials) - len(T5_TAGS)
    pieces = [(t, 0.0) for t in specials + T5_TAGS] + [(f"\u2581p{i}", -1.0 - i / n) for i in range(n)]
    tok = T5Tokenizer(vocab=pieces, extra_ids=0)
    tok.save_pretrained(d)
    cfg = T5Config(vocab_size=shape.vocab_size, d_model=shape.d_model, d_kv=shape.d_kv, d_ff=shape.d_ff,
                   num_layers=shape.layers, num_decoder_layers=shape.layers, num_heads=shape.n_heads,
                   relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.1,
                   feed_forward_proj="gated-gelu", decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    cfg.tie_word_embeddings = False          # an lm_head of its own (transformers 5 drops the keyword)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():                    # untied, transformers 5 draws each stack's embeddings apart:
        for stack in (model.encoder, model.decoder):     # one shared matrix, as MADLAD-400 has
            stack.embed_tokens.weight.copy_(model.shared.weight)
    model.save_pretrained(d)
    hf = json.loads((d / "config.json").read_text())          # MADLAD-400's fields, whatever transformers writes
    hf.update(tie_word_embeddings=False, architectures=["T5ForConditionalGeneration"])
    (d / "config.json").write_text(json.dumps(hf, indent=2))
    gen = {"decoder_start_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2))
    first = len(specials) + len(T5_TAGS)
    return {"pieces": [first, n], "eos": 1, "pad": 0, "source_start": [tok.convert_tokens_to_ids("<2fr>")],
            "prefix": []}


def _build_worker(spec: dict, barrier, queue) -> None:
    try:
        from model.interop.ct2 import convert_to_ct2
        from model.interop.multilingual import convert_multilingual
        from model.interop.t5 import convert_t5
        d, shape = Path(spec["dir"]), SHAPES[spec["shape"]]
        t0 = time.time()
        (d / "hf").mkdir(parents=True, exist_ok=True)
        info = (_nllb_dir if shape.family == "nllb" else _t5_dir)(d / "hf", shape)
        t1 = time.time()
        (convert_multilingual if shape.family == "nllb" else convert_t5)(str(d / "hf"), str(d / "ckpt"), "float32")
        t2 = time.time()
        convert_to_ct2(d / "hf", d / "ct2", "int8")
        info["build_s"] = {"transformers": round(t1 - t0, 1), "import": round(t2 - t1, 1),
                           "ct2": round(time.time() - t2, 1)}
        (d / "bench.json").write_text(json.dumps(info))
        queue.put({"ok": True})
    except BaseException as e:  # noqa: BLE001 - report to the parent instead of hanging it
        queue.put({"ok": False, "error": repr(e)})


def build(shape_name: str, d: Path) -> dict:
    """The model of ``shape_name`` under ``d`` (hf/: transformers' layout; ckpt/: our import; ct2/:
    CTranslate2 int8), written unless ``d/bench.json`` says it is there; returns bench.json (the
    synthetic pieces' first id and count, EOS, pad, the source's first id, the forced target prefix)."""
    if not (d / "bench.json").exists():
        in_children(_build_worker, [{"dir": str(d), "shape": shape_name}], "building the model")
    info = json.loads((d / "bench.json").read_text())
    print(f"models in {d} (seconds to write, import, convert: {info.get('build_s')})", flush=True)
    return info


def sources(info: dict, limit: int) -> list[list[int]]:
    """The first ``limit`` German test_2016_flickr sentences as source ids of the synthetic vocabulary:
    the template's first id, one piece per word (CRC32 of the word over the pieces), EOS."""
    from model.tokenizer import read_lines
    first, n = info["pieces"]
    lines = read_lines(DATA / "test_2016_flickr.de.gz")[:limit]
    return [info["source_start"] + [first + zlib.crc32(w.encode("utf-8")) % n for w in line.split()] + [info["eos"]]
            for line in lines]


# ---- the comparison ---------------------------------------------------------------------------------

def compare(args, d: Path, info: dict, srcs: list[list[int]]) -> list[dict]:
    """The interleaved rounds, the table (with memory and agreement columns), --json; returns the rows."""
    systems = [x.strip() for x in args.systems.split(",") if x.strip()]
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    beams = [int(b) for b in args.beams.split(",")]
    cfg = json.loads((d / "ckpt" / "config.json").read_text())
    common = {"checkpoint": str(d / "ckpt"), "ct2": str(d / "ct2"), "slots": args.engine_slots, "eos": info["eos"],
              "pad": info["pad"], "max_len": cfg["max_len"], "tokens": args.tokens, "prefix": info["prefix"]}
    print(f"\n{args.shape}: {SHAPES[args.shape]}; {len(srcs)} sentences, exactly {args.tokens} tokens each; "
          f"systems {', '.join(systems)}; layouts {', '.join(layouts)}; {args.rounds} interleaved round(s), "
          f"median by tokens/s", flush=True)
    rounds = run_rounds(common, srcs, systems, layouts, beams, args.rounds)
    runs = [median_run(rounds[(s, lay, b)]) for b in beams for lay in layouts for s in systems]
    rows = table_rows(runs, {}, rounds)
    by = {(r.system, r.layout, r.beam): r for r in runs}
    for row, r in zip(rows, runs):
        mems = [m for run in rounds[(r.system, r.layout, r.beam)] for m in run.profile["rss_mb"] if m is not None]
        row["loaded_mib"] = round(statistics.median(mems)) if mems else None
        ref = by.get((COUNTERPART.get(r.system), r.layout, r.beam))
        row["same_as_CTranslate2"] = (round(sum(a == b for a, b in zip(r.outputs, ref.outputs)) / len(srcs), 3)
                                      if ref else None)
    print_rows(rows)
    print(f"\n{'system':20} {'layout':6} {'decoding':8} {'loaded MiB':>10} {'same':>6}")
    for row in rows:
        same = row["same_as_CTranslate2"]
        print(f"{row['system']:20} {row['layout']:6} {row['beam_size']:8} {row['loaded_mib'] or '-':>10} "
              f"{'-' if same is None else f'{same:.0%}':>6}")
    print("(loaded MiB: each worker's VmRSS growth over loading the model, median over runs; same: share of "
          "sentences whose output equals CTranslate2's of the same arithmetic)")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": args.shape, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return rows


# ---- the profile ------------------------------------------------------------------------------------

class PartTimer:
    """Wall time and calls of named functions, summed: ``wrap(module, attr, part)`` replaces a module
    global by a timed one (callers that look the name up at call time go through it)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.restore: list = []

    def wrap(self, module, attr: str, part: str) -> None:
        inner = getattr(module, attr)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - t
                self.calls[part] = self.calls.get(part, 0) + 1
        setattr(module, attr, timed)
        self.restore.append((module, attr, inner))

    def close(self) -> None:
        for module, attr, inner in reversed(self.restore):
            setattr(module, attr, inner)
        self.restore = []


def profile(args, d: Path, info: dict, srcs: list[list[int]]) -> dict[str, float]:
    """Engine int8 over srcs in this process (``--threads`` torch threads), after a warm-up run:
    prints where the time goes; returns part -> seconds (the engine's split and the timed parts)."""
    import asyncio

    import torch

    from model.inference import fused_step, search, step
    from model.load import load_model
    from service.engine import torch_threads, tune_process

    from .engine import run_engine
    torch.set_grad_enabled(False)
    with torch_threads(1):
        model, _, _ = load_model(d / "ckpt", linear_dtype="int8")
    torch.set_num_threads(args.threads)
    tune_process()
    beam = int(args.beams.split(",")[0])
    kw = {"fixed_len": args.tokens, "prefix": info["prefix"], "part": "(f)", "warmup": False}
    asyncio.run(run_engine(model, srcs, beam, args.engine_slots, **kw))
    timer = PartTimer()
    for module in (step, fused_step):
        timer.wrap(module, "output_logits", "output projection")
    timer.wrap(step, "step_logits", "pad/BOS mask")
    timer.wrap(search, "_candidates", "log-softmax + top-k")
    timer.wrap(search, "rank_candidates", "beam ranking")
    try:
        run = asyncio.run(run_engine(model, srcs, beam, args.engine_slots, **kw))
    finally:
        timer.close()
    p, wall = run.profile, run.wall_s
    parts = {"prefill": p["prefill_s"],
             "decoder layers": p["decode_s"] - timer.seconds.get("output projection", 0.0)
             - timer.seconds.get("pad/BOS mask", 0.0),
             **{k: timer.seconds.get(k, 0.0) for k in ("output projection", "pad/BOS mask", "log-softmax + top-k",
                                                       "beam ranking")},
             "rest of the search update": p["update_s"] - timer.seconds.get("log-softmax + top-k", 0.0)
             - timer.seconds.get("beam ranking", 0.0),
             "loop and idle": p["loop_s"] + p["idle_s"]}
    cfg = model.cfg
    print(f"\nprofile {args.shape} (d_model {cfg.d_model}, {cfg.n_encoder_layers}+{cfg.n_decoder_layers} layers, "
          f"vocabulary {cfg.vocab_size}, norm {cfg.norm}), engine int8, "
          f"beam {beam}, {args.threads} thread(s), {len(srcs)} sentences x {args.tokens} tokens: "
          f"{run.tokens / wall:.0f} tokens/s, {wall:.1f} s; {p['steps']} steps, {p['mean_decode_rows']:.0f} rows/step")
    for name, s in parts.items():
        calls = timer.calls.get(name)
        per = f"  {s / calls * 1e3:7.2f} ms/call x {calls}" if calls else ""
        print(f"  {name:26} {s:7.2f} s {s / wall:6.1%}{per}")
    return parts


# ---- main -------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m service.bench.families", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--limit", type=int, default=None, help="sentences (default: the shape's, 300 / 200)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median run is reported")
    ap.add_argument("--beams", default="1,4", help="beam sizes (1 = greedy); --profile: the first")
    ap.add_argument("--layouts", default="1x2,2x1", help="processes x threads per process")
    ap.add_argument("--systems", default="engine int8,CTranslate2 int8", help=f"comma-separated among {SYSTEMS}")
    ap.add_argument("--tokens", type=int, default=20, help="tokens generated per sentence (the forced one included)")
    ap.add_argument("--engine-slots", type=int, default=128, help="the engine's max_num_seqs (hypotheses in flight)")
    ap.add_argument("--dir", type=Path, default=None, help="keep the models here and reuse them (default: a "
                    "temporary directory)")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the table's rows as JSON")
    ap.add_argument("--profile", action="store_true", help="profile engine int8 instead of comparing")
    ap.add_argument("--threads", type=int, default=2, help="--profile: torch threads")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    beams, layouts = beams_and_layouts(ap, args.beams, args.layouts)
    systems = [x.strip() for x in args.systems.split(",") if x.strip()]
    if not systems or set(systems) - set(SYSTEMS):
        ap.error(f"--systems: choose from {', '.join(SYSTEMS)}, got {args.systems!r}")
    for name, ok in (("--beams", beams and all(b >= 1 for b in beams)), ("--rounds", args.rounds >= 1),
                     ("--layouts", layouts and all(len(x) == 2 and min(x) >= 1 for x in layouts)),
                     ("--limit", args.limit is None or args.limit >= 1), ("--tokens", args.tokens >= 2),
                     ("--engine-slots", args.engine_slots >= max(beams or [1])), ("--threads", args.threads >= 1)):
        if not ok:
            ap.error(f"{name}: out of range (see --help)")
    keep = args.dir is not None
    with (contextlib.nullcontext(str(args.dir)) if keep else tempfile.TemporaryDirectory()) as tmp:
        d = Path(tmp)
        info = build(args.shape, d)
        srcs = sources(info, args.limit or SHAPES[args.shape].sentences)
        if args.profile:
            profile(args, d, info, srcs)
        else:
            compare(args, d, info, srcs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
