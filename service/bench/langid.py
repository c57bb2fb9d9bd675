"""Language identification libraries on Multi30k val: accuracy, confidence and speed (figures, not a test).

    python -m service.bench.langid [--data-dir ../shared/data/multi30k] [--langs en de fr cs] [--limit N]
                                   [--libs py3langid lingua langdetect]

Each library runs in a child process of its own (so import time and memory are its own), twice:
detecting among all the languages it knows ("all"), among the service's candidate languages
(``service.translator.langid.COMMON_LANGUAGES`` plus ``--langs``: "common") and among ``--langs``
only ("served"; the languages a service of these pairs reads). Texts per language (val only, never test): every
sentence ("full"), the sentences of at most 5 words ("<=5w"), the first 3 words of each sentence
("3w") and its first word ("1w"). Columns: accuracy (%) per kind; ``conf ok/bad``: mean confidence
of right and of wrong answers; ``ECE``: expected calibration error (10 bins of confidence, the
mean gap between confidence and accuracy, in points); ``bad>=.9``: wrong answers given with confidence >= 0.9 (% of all
texts); ``ms``: mean milliseconds per call on full sentences, one thread; ``load s``: import, model
load and first call; ``MB``: resident memory of the child once done. Every model ships in its wheel:
nothing is downloaded (the service's machines reach no model hub). py3langid is a dependency of the
service; ``pip install .[langid-bench]`` adds the other two (a library not installed is skipped).
"""
from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DATA_DIR = "../shared/data/multi30k"
LIBS = ("py3langid", "lingua", "langdetect")
PACKAGES = {"py3langid": "py3langid", "lingua": "lingua-language-detector", "langdetect": "langdetect"}
KINDS = ("full", "<=5w", "3w", "1w")


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def candidates(mode: str, langs: list[str]) -> list[str] | None:
    if mode == "all":
        return None
    if mode == "served":
        return list(langs)
    from service.translator.langid import COMMON_LANGUAGES    # (the parent imports it, not the timed child)
    return sorted(set(COMMON_LANGUAGES) | set(langs))


def ece(answers: list[tuple[bool, float]], bins: int = 10) -> float:
    """Expected calibration error in points: sum over confidence bins of |accuracy - mean confidence|
    weighted by the bin's share of the answers."""
    total, err = len(answers), 0.0
    for b in range(bins):
        inside = [(r, c) for r, c in answers if min(int(c * bins), bins - 1) == b]
        if inside:
            err += abs(sum(r for r, _ in inside) / len(inside) - sum(c for _, c in inside) / len(inside)) * len(inside)
    return 100 * err / max(1, total)


def detector(lib: str, langs: list[str] | None):
    """``detect(text) -> (code, confidence 0..1)`` of ``lib``, among ``langs`` (None: all it knows)."""
    if lib == "py3langid":
        from py3langid.langid import MODEL_FILE, LanguageIdentifier
        ident = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
        if langs:
            ident.set_languages(langs)
        return ident.classify
    if lib == "lingua":
        from lingua import IsoCode639_1, LanguageDetectorBuilder
        builder = (LanguageDetectorBuilder.from_iso_codes_639_1(*(getattr(IsoCode639_1, c.upper()) for c in langs))
                   if langs else LanguageDetectorBuilder.from_all_languages())
        det = builder.with_preloaded_language_models().build()

        def lingua_detect(text: str):
            values = det.compute_language_confidence_values(text)
            if not values or values[0].value == 0:
                return "und", 0.0
            return values[0].language.iso_code_639_1.name.lower(), values[0].value
        return lingua_detect
    if lib == "langdetect":
        from langdetect.detector_factory import PROFILES_DIRECTORY, DetectorFactory
        from langdetect.lang_detect_exception import LangDetectException
        factory = DetectorFactory()
        factory.seed = 0     # its sampling is random otherwise: the same text may get another answer
        names = [n for n in sorted(os.listdir(PROFILES_DIRECTORY))          # zh: its profiles zh-cn, zh-tw
                 if langs is None or n.split("-")[0] in langs]
        factory.load_json_profile([Path(PROFILES_DIRECTORY, n).read_text(encoding="utf-8") for n in names])

        def langdetect_detect(text: str):
            d = factory.create()
            d.append(text)
            try:
                best = d.get_probabilities()
            except LangDetectException:     # no features (no letters)
                return "und", 0.0
            return (best[0].lang.split("-")[0], best[0].prob) if best else ("und", 0.0)
        return langdetect_detect
    raise ValueError(f"unknown library {lib!r}; choose from {LIBS}")


def samples(data_dir: Path, langs: list[str], limit: int | None) -> dict[str, list[tuple[str, str]]]:
    """kind -> [(language, text)]."""
    out: dict[str, list[tuple[str, str]]] = {k: [] for k in KINDS}
    for lang in langs:
        with gzip.open(data_dir / f"val.{lang}.gz", "rt", encoding="utf-8") as f:
            lines = [s.strip() for s in f.read().splitlines() if s.strip()][:limit]
        for s in lines:
            words = s.split()
            out["full"].append((lang, s))
            if len(words) <= 5:
                out["<=5w"].append((lang, s))
            out["3w"].append((lang, " ".join(words[:3])))
            out["1w"].append((lang, words[0]))
    return out


def run_one(lib: str, mode: str, among: list[str] | None, data_dir: Path, langs: list[str],
            limit: int | None) -> dict:
    """One library detecting ``among`` these languages (None: all), in this process: the row's figures."""
    texts = samples(data_dir, langs, limit)
    start = time.perf_counter()
    detect = detector(lib, among)
    detect("Warm-up sentence.")
    load_s = time.perf_counter() - start
    row: dict = {"lib": lib, "mode": mode, "load_s": load_s}
    ok_conf, bad_conf, bad_high, total, pairs = [], [], 0, 0, []
    for kind, items in texts.items():
        t0 = time.perf_counter()
        answers = [detect(t) for _, t in items]
        if kind == "full":
            row["ms"] = (time.perf_counter() - t0) * 1000 / max(1, len(items))
        right = [a[0] == lang for (lang, _), a in zip(items, answers)]
        row[kind] = 100 * sum(right) / max(1, len(items))
        row[f"n_{kind}"] = len(items)
        for r, (_, conf) in zip(right, answers):
            (ok_conf if r else bad_conf).append(conf)
            bad_high += (not r) and conf >= 0.9
            pairs.append((r, conf))
        total += len(items)
        row[f"per_lang_{kind}"] = {lang: 100 * sum(r for (l2, _), r in zip(items, right) if l2 == lang)
                                   / max(1, sum(l2 == lang for l2, _ in items)) for lang in langs}
    row["conf_ok"] = sum(ok_conf) / max(1, len(ok_conf))
    row["conf_bad"] = sum(bad_conf) / max(1, len(bad_conf))
    row["bad_high"] = 100 * bad_high / max(1, total)
    row["ece"] = ece(pairs)
    row["no_letters"] = {t: list(detect(t)) for t in ("12345", "\U0001F600", "...")}
    row["mb"] = rss_mb()
    return row


def table(rows: list[dict]) -> str:
    head = ("| library | among | full | <=5w | 3w | 1w | conf ok/bad | ECE | bad>=.9 | ms/call | sent/s | load s "
            "| MB |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['lib']} | {r['mode']} | {r['full']:.1f} | {r['<=5w']:.1f} | {r['3w']:.1f} | "
                     f"{r['1w']:.1f} | {r['conf_ok']:.2f}/{r['conf_bad']:.2f} | {r['ece']:.1f} | {r['bad_high']:.1f} | "
                     f"{r['ms']:.2f} | {1000 / r['ms']:.0f} | {r['load_s']:.1f} | {r['mb']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", default=DATA_DIR, help="holds val.{lang}.gz")
    ap.add_argument("--langs", nargs="+", default=["en", "de", "fr", "cs"])
    ap.add_argument("--libs", nargs="+", default=list(LIBS), choices=LIBS)
    ap.add_argument("--modes", nargs="+", default=["all", "common", "served"],
                    choices=["all", "common", "served"])
    ap.add_argument("--limit", type=int, default=None, help="first N sentences per language only")
    ap.add_argument("--one", nargs=3, metavar=("LIB", "MODE", "AMONG"), help=argparse.SUPPRESS)   # the child's part
    args = ap.parse_args(argv)
    data_dir = Path(args.data_dir)
    if args.one:
        lib, mode, among = args.one
        print(json.dumps(run_one(lib, mode, None if among == "all" else among.split(","), data_dir, args.langs,
                                 args.limit)))
        return
    counts = {k: len(v) for k, v in samples(data_dir, args.langs, args.limit).items()}
    print(f"Multi30k val {'/'.join(args.langs)} ({data_dir}): texts per kind {counts}", flush=True)
    rows = []
    for lib in args.libs:
        if importlib.util.find_spec(lib) is None:
            print(f"{lib}: skipped, not installed (pip install {PACKAGES[lib]})", flush=True)
            continue
        for mode in args.modes:
            among = candidates(mode, args.langs)
            cmd = [sys.executable, "-m", "service.bench.langid", "--one", lib, mode, ",".join(among or ["all"]),
                   "--data-dir", str(data_dir),
                   "--langs", *args.langs] + (["--limit", str(args.limit)] if args.limit else [])
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{lib} {mode} failed:\n{done.stderr[-3000:]}")
            out = done.stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"{lib} {mode}: per language (full) "
                  f"{ {k: round(v, 1) for k, v in r['per_lang_full'].items()} }, (1w) "
                  f"{ {k: round(v, 1) for k, v in r['per_lang_1w'].items()} }; no letters -> {r['no_letters']}",
                  flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
