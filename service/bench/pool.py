"""Many models, uneven traffic: a model pool against one deployment per model, on the same CPUs.

    python -m service.bench.pool [--models 12] [--requests 240] [--clients 16] [--zipf 1.1]

Models: the shipped de-en and en-de, plus MarianMT folders written at run time in the published
OPUS-MT layout (config.json, model.safetensors, generation_config.json, source.spm, target.spm,
vocab.json, tokenizer_config.json) with random weights, the shipped models' size (d_model 256, 3+3
layers, 8 heads, FFN 1024) and SentencePiece models trained on Multi30k val. Traffic: each request
names a model drawn from a Zipf distribution over them (rank r with probability ~ 1/r^s, the
same seeded sequence for both layouts) and carries one Multi30k test sentence, greedy, at most
``--max-new-tokens`` tokens; ``--clients`` closed-loop clients send ``--requests`` requests in all,
after one request for each shipped model (``--warm-all``: for every model, so the pool starts warm).

Layouts, both ``ingress: separate`` behind a 0.2-CPU Gateway on ``--num-cpus`` CPUs:
    pool:      a Pool deployment of 2 replicas x 0.8 CPU, each holding up to ``--max-models`` models
               (Serve's model multiplexing, service/pool.py); models load on their first request
    per-model: one Translator deployment per model, 1 replica each, the same 1.6 CPUs split among them

Prints per layout: time to ready, requests/s, p50/p99 latency, errors, model loads and evictions (the
pool's counters from /metrics), and the resident memory (RSS) of the translator processes. Bounded:
a fixed number of requests (and ``--max-seconds`` per phase), 127.0.0.1 only; needs ``transformers``
(the dev extra) to write the MarianMT folders.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from model.checkpoint import SHIPPED_CHECKPOINTS
from model.tokenizer import read_lines
from service.loadtest.serve_app import ServeApp

DATA = Path(__file__).resolve().parents[2] / "model" / "data" / "multi30k"
EXPORT_S = 11.0   # Ray's metrics_report_interval_ms is 10 s: a counter read sooner misses recent loads
# made-up pair names for the random MarianMT models (the languages do not matter to random weights)
PAIRS = ["fr-en", "es-en", "it-en", "nl-en", "pt-en", "sv-en", "da-en", "fi-en", "pl-en", "cs-en", "ro-en",
         "hu-en", "el-en", "bg-en", "sk-en", "sl-en", "et-en", "lv-en", "lt-en", "hr-en", "ca-en", "gl-en"]


def write_marian_dir(d: Path, source_lang: str, target_lang: str, lines: list[str], seed: int,
                     d_model: int = 256, layers: int = 3, heads: int = 8, ffn: int = 1024,
                     vocab_size: int = 2000, tokenizer_from: Path | None = None) -> Path:
    """A MarianMT folder in the published OPUS-MT layout with random weights (see the module doc).
    Joint vocabulary: ``</s>`` 0, ``<unk>`` 1, the pieces of both SentencePiece models, ``<pad>`` last.
    ``tokenizer_from``: a folder written before whose SentencePiece models are copied (not retrained)."""
    import sentencepiece as spm
    import torch
    from transformers import MarianConfig, MarianMTModel
    d.mkdir(parents=True, exist_ok=True)
    files = []
    if tokenizer_from is not None:
        files = [Path(shutil.copy(tokenizer_from / f"{name}.spm", d / f"{name}.spm")) for name in ("source", "target")]
    else:
        txt = d / "train.txt"
        txt.write_text("\n".join(lines) + "\n", encoding="utf-8")
        for name in ("source", "target"):
            spm.SentencePieceTrainer.train(input=str(txt), model_prefix=str(d / name), vocab_size=vocab_size,
                                           model_type="unigram", character_coverage=1.0, hard_vocab_limit=False,
                                           minloglevel=2)
            (d / f"{name}.vocab").unlink()
            files.append((d / f"{name}.model").rename(d / f"{name}.spm"))
        txt.unlink()
    vocab = {"</s>": 0, "<unk>": 1}
    for f in files:
        sp = spm.SentencePieceProcessor(model_file=str(f))
        for i in range(sp.get_piece_size()):
            if not (sp.is_control(i) or sp.is_unknown(i)):
                vocab.setdefault(sp.id_to_piece(i), len(vocab))
    vocab["<pad>"] = pad = len(vocab)
    (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (d / "tokenizer_config.json").write_text(json.dumps({"source_lang": source_lang, "target_lang": target_lang,
                                                         "model_max_length": 512, "separate_vocabs": False}))
    cfg = MarianConfig(vocab_size=len(vocab), decoder_vocab_size=len(vocab), d_model=d_model,
                       encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=heads,
                       decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn,
                       max_position_embeddings=512, pad_token_id=pad, eos_token_id=0, decoder_start_token_id=pad,
                       forced_eos_token_id=0, activation_function="swish", scale_embedding=True)
    torch.manual_seed(seed)
    model = MarianMTModel(cfg).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 0.5)
        model.final_logits_bias[0, 0] += 4.0      # EOS likelier: outputs of mixed lengths
    model.save_pretrained(d)
    (d / "generation_config.json").write_text(json.dumps({
        "bad_words_ids": [[pad]], "bos_token_id": 0, "decoder_start_token_id": pad, "eos_token_id": 0,
        "forced_eos_token_id": 0, "max_length": 512, "num_beams": 4, "pad_token_id": pad}, indent=2))
    return d


def build_models(root: Path, n: int) -> tuple[list[dict], Path]:
    """(the shipped checkpoints as ModelSpecs, a folder of n - 2 MarianMT models named by pair)."""
    shipped = [{"name": name, "checkpoint": str(path)} for name, path in SHIPPED_CHECKPOINTS.items()
               if (path / "config.json").exists()]
    lines = read_lines(DATA / "val.de.gz") + read_lines(DATA / "val.en.gz")
    marian = root / "marian"
    first = None
    for i, pair in enumerate(PAIRS[: max(0, n - len(shipped))]):
        src, tgt = pair.split("-")
        d = write_marian_dir(marian / f"opus-mt-{pair}", src, tgt, lines, seed=i, tokenizer_from=first)
        first = first or d
    return shipped, marian


def zipf_sequence(models: list[str], n: int, s: float, seed: int = 0) -> list[str]:
    """n model names, rank r (1-based, in list order) drawn with probability proportional to 1/r^s."""
    weights = [1.0 / (r + 1) ** s for r in range(len(models))]
    return random.Random(seed).choices(models, weights=weights, k=n)


async def drive(url: str, sequence: list[str], texts: dict[str, list[str]], clients: int, max_new_tokens: int,
                max_seconds: float) -> dict:
    """Send the sequence's requests from ``clients`` closed-loop clients; latencies of the answered ones."""
    todo = list(enumerate(sequence))[::-1]
    lat, errors = [], {}
    end = time.perf_counter() + max_seconds
    async with httpx.AsyncClient(timeout=120, trust_env=False, limits=httpx.Limits(max_connections=clients)) as c:
        async def worker():
            while todo and time.perf_counter() < end:
                i, model = todo.pop()
                pool = texts[model]
                t0 = time.perf_counter()
                r = await c.post(url + "/v1/translate", json={"text": pool[i % len(pool)], "model": model,
                                                              "beam_size": 1, "max_new_tokens": max_new_tokens})
                if r.status_code == 200:
                    lat.append(time.perf_counter() - t0)
                else:
                    errors[r.status_code] = errors.get(r.status_code, 0) + 1
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
    lat.sort()
    return {"rps": len(lat) / wall, "p50": statistics.median(lat) if lat else float("nan"),
            "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan"),
            "answered": len(lat), "errors": errors, "seconds": wall}


def replica_rss_mib(app: str, prefixes: tuple[str, ...]) -> float:
    """Summed RSS (MiB) of this machine's replica processes of ``app`` whose deployment name starts
    with one of ``prefixes`` (process title ``ray::ServeReplica:<app>:<deployment>``; Linux /proc)."""
    total = 0.0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            title = (d / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            if any(title.startswith(f"ray::ServeReplica:{app}:{p}") for p in prefixes):
                total += next(int(line.split()[1]) for line in (d / "status").read_text().splitlines()
                              if line.startswith("VmRSS:")) / 1024
        except (OSError, StopIteration, ValueError):
            continue
    return total


def pool_counters(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    out = {"loads": 0.0, "evictions": 0.0, "load_s": 0.0}
    text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "ray_mt_pool_model_loads_total" and s.labels.get("outcome") == "ok":
                out["loads"] += s.value
            elif s.name == "ray_mt_pool_model_evictions_total":
                out["evictions"] += s.value
            elif s.name == "ray_mt_pool_model_load_seconds_sum":
                out["load_s"] += s.value
    return out


def zipf_rates(total: float, pairs: int, s: float) -> list[float]:
    """Requests/s of each of ``pairs`` pairs when ``total`` requests/s follow Zipf(s) over them, hottest first."""
    w = [1.0 / r ** s for r in range(1, pairs + 1)]
    return [total * x / sum(w) for x in w]


def capacity(rates: list[float], mu: float, k: int, utilization: float = 0.7) -> dict:
    """Replicas that serve ``rates`` (requests/s per pair) when one replica sustains ``mu`` requests/s
    of a model and holds at most ``k`` models, each replica kept at ``utilization`` of ``mu``:

    per-model: every pair its own deployment, sum over pairs of max(1, ceil(rate / (u mu))).
    pool: ceil-free packing: each pair's whole multiples of u mu get replicas of their own (one model
    each, always resident); the remainders are packed first-fit decreasing into replicas of at most
    ``k`` models and u mu requests/s. Every model then stays resident (no load after start-up);
    ``copies`` is how many model copies the pool holds (each loaded once, ``load_s`` each)."""
    cap = utilization * mu
    per_model = sum(max(1, math.ceil(r / cap - 1e-9)) for r in rates)
    full = [int(r // cap) for r in rates]
    rest = sorted((r - f * cap for r, f in zip(rates, full) if r - f * cap > 1e-9), reverse=True)
    bins: list[list[float]] = []
    for r in rest:
        for b in bins:
            if b[0] + r <= cap and b[1] < k:
                b[0] += r
                b[1] += 1
                break
        else:
            bins.append([r, 1])
    return {"per_model": per_model, "pool": sum(full) + len(bins), "copies": sum(full) + len(rest),
            "compute_bound": math.ceil(sum(rates) / cap - 1e-9)}


def capacity_report(total: float, pairs: int, s: float, mu: float, load_s: float, k: int,
                    utilization: float) -> None:
    rates = zipf_rates(total, pairs, s)
    c = capacity(rates, mu, k, utilization)
    print(f"{total:g} requests/s over {pairs} pairs, Zipf s={s}: hottest {rates[0]:.1f}/s, coldest {rates[-1]:.2f}/s")
    print(f"one replica: mu = {mu:g} requests/s of a model, kept at {utilization:.0%}; holds k = {k} models; "
          f"a load takes {load_s:g} s")
    print(f"per-model deployments: {c['per_model']} replicas")
    print(f"pool:                  {c['pool']} replicas ({c['copies']} model copies, loaded once: "
          f"{c['copies'] * load_s:.0f} replica-seconds of loading at start-up); compute alone needs {c['compute_bound']}")
    for kk in sorted({1, 2, k, 2 * k}):
        print(f"  pool with k = {kk}: {capacity(rates, mu, kk, utilization)['pool']} replicas")


def delete(app: ServeApp, timeout_s: float = 300.0) -> None:
    """Delete the app and wait until it is gone (a loaded machine takes more than serve.delete's 60 s)."""
    from ray import serve
    serve.delete(app.name, _blocking=False)
    end = time.monotonic() + timeout_s
    while app.name in serve.status().applications and time.monotonic() < end:
        time.sleep(1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m service.bench.pool", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=int, default=12, help="models in all (the shipped ones included)")
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--zipf", type=float, default=1.1, help="the Zipf exponent s")
    ap.add_argument("--max-models", type=int, default=4, help="models per pool replica")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--max-seconds", type=float, default=240, help="time bound of each measured phase")
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--layouts", default="pool,per-model")
    ap.add_argument("--warm-all", action="store_true",
                    help="one request per model before measuring (default: the two shipped ones only)")
    cap = ap.add_argument_group("capacity model (no benchmark run): python -m service.bench.pool --capacity ...")
    cap.add_argument("--capacity", action="store_true", help="print the replicas a traffic mix needs, then exit")
    cap.add_argument("--rate", type=float, default=1000.0, help="requests/s in all")
    cap.add_argument("--pairs", type=int, default=50)
    cap.add_argument("--mu", type=float, default=20.0, help="requests/s one replica sustains for one model")
    cap.add_argument("--load-s", type=float, default=1.0, help="seconds to load a model")
    cap.add_argument("--utilization", type=float, default=0.7)
    args = ap.parse_args(argv)
    if args.capacity:
        capacity_report(args.rate, args.pairs, args.zipf, args.mu, args.load_s, args.max_models, args.utilization)
        return
    root = Path(tempfile.mkdtemp(prefix="mt-bench-pool-"))
    try:
        t0 = time.perf_counter()
        shipped, marian = build_models(root, args.models)
        names = [m["name"] for m in shipped] + sorted(p.name for p in marian.iterdir())
        print(f"{len(names)} models written/found in {time.perf_counter() - t0:.0f} s: {', '.join(names)}", flush=True)
        test = {lang: read_lines(DATA / f"test_2016_flickr.{lang}.gz")[:200] for lang in ("de", "en")}
        texts = {n: test["en" if n.startswith("en-") else "de"] for n in names}
        sequence = zipf_sequence(names, args.requests, args.zipf)
        counts = {n: sequence.count(n) for n in names}
        print("requests per model:", ", ".join(f"{n} {c}" for n, c in counts.items()), flush=True)
        engine = {"max_num_seqs": 16, "max_waiting": 256}
        marian_specs = [{"name": p.name, "checkpoint": str(p)} for p in sorted(marian.iterdir())]
        layouts = {
            "pool": {"models": [], "ingress": "separate", "num_cpus": 0.8, "num_gpus": 0, "engine": engine,
                     "gateway": {"ray_actor_options": {"num_cpus": 0.2}},
                     "pool": {"models": shipped, "models_dir": str(marian), "max_models_per_replica": args.max_models,
                              "deployment": {"num_replicas": 2}}},
            "per-model": {"models": shipped + marian_specs, "ingress": "separate", "num_gpus": 0, "engine": engine,
                          "num_cpus": round(1.6 / len(names), 3), "translator": {"num_replicas": 1},
                          "gateway": {"ray_actor_options": {"num_cpus": 0.2}}},
        }
        app = ServeApp(num_cpus=args.num_cpus, namespace="mt-bench-pool")
        results = {}
        try:
            for layout in args.layouts.split(","):
                t0 = time.perf_counter()
                app.deploy(layouts[layout], timeout_s=900)
                ready_s = time.perf_counter() - t0
                warm = names if args.warm_all else names[:2] * 2    # --warm-all: every model loaded before
                asyncio.run(drive(app.url, warm, texts, 2, args.max_new_tokens, 300))
                time.sleep(EXPORT_S)         # Ray's metrics agent exports every 10 s: the warm-up's loads first
                before = pool_counters(app.url)
                r = asyncio.run(drive(app.url, sequence, texts, args.clients, args.max_new_tokens, args.max_seconds))
                time.sleep(EXPORT_S)
                after = pool_counters(app.url)
                r.update(ready_s=ready_s, loads=after["loads"] - before["loads"],
                         evictions=after["evictions"] - before["evictions"],
                         load_s=(after["load_s"] - before["load_s"]) / max(1.0, after["loads"] - before["loads"]),
                         rss=replica_rss_mib(ServeApp.name, ("Pool", "Translator-")))
                results[layout] = r
                print(f"{layout:>9}: ready {ready_s:5.0f} s, {r['rps']:5.2f} req/s, p50 {r['p50'] * 1e3:6.0f} ms, "
                      f"p99 {r['p99'] * 1e3:6.0f} ms, answered {r['answered']}/{len(sequence)} errors {r['errors']}, "
                      f"loads {r['loads']:.0f}, evictions {r['evictions']:.0f}, RSS {r['rss']:.0f} MiB", flush=True)
                delete(app)
        finally:
            app.close()
        print(f"\n{len(names)} models, Zipf s={args.zipf}, {args.requests} requests, {args.clients} clients, "
              f"{args.num_cpus} CPUs")
        print("layout      ready s   req/s   p50 ms   p99 ms  errors  loads  evictions  load s  translator RSS MiB")
        for layout, r in results.items():
            print(f"{layout:<10} {r['ready_s']:7.0f} {r['rps']:7.2f} {r['p50'] * 1e3:8.0f} {r['p99'] * 1e3:8.0f} "
                  f"{sum(r['errors'].values()):7d} {r['loads']:6.0f} {r['evictions']:10.0f} {r['load_s']:7.2f} "
                  f"{r['rss']:19.0f}")
        if {"pool", "per-model"} <= set(results):
            p, m = results["pool"], results["per-model"]
            print(f"pool / per-model: req/s x{p['rps'] / m['rps']:.2f}, p50 x{p['p50'] / m['p50']:.2f}, "
                  f"p99 x{p['p99'] / m['p99']:.2f}, RSS x{p['rss'] / m['rss']:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
