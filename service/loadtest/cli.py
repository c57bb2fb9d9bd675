"""Load generator for the translation service: closed and open loop, sweeps, plots, a report.

    python -m service.loadtest --concurrency 16 --duration 30                 # closed loop, 16 users
    python -m service.loadtest --rate 8 --requests 500 --beam-size 1:3,4:1   # open loop, Poisson 8/s
    python -m service.loadtest --rate 4 -d 20 --texts 1:4,3:1 --attention 0.1 --stream --json run.json
    python -m service.loadtest --sweep rate=1,2,4,8 -d 20 --plot sweep.png   # latency/throughput plot
    python -m service.loadtest --engine model/checkpoints/de-en -c 4 -d 10   # the engine alone, no HTTP
    python -m service.loadtest report --out deploy/performance               # the load-test report
    python -m service.loadtest --compare-echo -c 32 -d 15 --beam-size 1      # service / echo app ratio
    python -m service.loadtest --compare-echo -c 32 -d 15 --beam-size 1 --rounds 3   # median of 3 rounds
    python -m service.loadtest soak                                          # 10,000 mixed requests, a replica killed

Closed loop: N users, each sending its next request when its previous one is answered. Open loop:
Poisson arrivals of rate R, latency measured from the scheduled arrival (no coordinated omission).
Every run is bounded by a request count and/or a duration, each request by --timeout, and it
targets only the URL it is given (loopback unless --allow-remote). A run keeps up when its achieved
rate is >= 95% of the offered one; 429 and 503 answers are counted as rejected, apart from failed.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from .config import DEFAULT_SENTENCES, DEFAULT_URL, LoadConfig
from .generator import Progress, run_load, run_sweep
from .markdown import report_markdown
from .plots import plot_sweep
from .report import ReportPlan, run_report
from .stats import format_summary, saturation
from .targets import EngineTarget


def _values(text: str) -> tuple[str, list[float]]:
    kind, _, vals = text.partition("=")
    kind = kind.strip()
    if kind not in ("rate", "concurrency") or not vals:
        raise argparse.ArgumentTypeError(f"expected rate=R1,R2,... or concurrency=N1,N2,..., got {text!r}")
    try:
        values = sorted(float(v) for v in vals.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sweep values must be numbers, got {vals!r}") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("--sweep values must be > 0")
    return kind, values


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m service.loadtest", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=DEFAULT_URL, help="service base URL (default %(default)s)")
    ap.add_argument("--path", default="/v1/translate", help="endpoint (default %(default)s)")
    loop = ap.add_mutually_exclusive_group()
    loop.add_argument("-c", "--concurrency", type=int, help="closed loop: concurrent users (default 8)")
    loop.add_argument("-r", "--rate", type=float, help="open loop: Poisson arrivals, requests/s")
    ap.add_argument("-n", "--requests", type=int, help="stop after this many requests")
    ap.add_argument("-d", "--duration", type=float, help="stop after this many seconds (default 30 without -n)")
    ap.add_argument("--sentences", default=str(DEFAULT_SENTENCES), help="sentence file, plain or .gz")
    ap.add_argument("--texts", default="1", help="texts per request, a mix VALUE[:WEIGHT],... (default 1)")
    ap.add_argument("--beam-size", default="4", help="beam sizes, a mix VALUE[:WEIGHT],... (default 4)")
    ap.add_argument("--attention", type=float, default=0.0, help="fraction of requests with return_attention")
    ap.add_argument("--stream", action="store_true", help="stream (SSE) and measure time to first token")
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--model")
    ap.add_argument("--source-lang", default="de")
    ap.add_argument("--target-lang", default="en")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per request (default 60)")
    ap.add_argument("--max-inflight", type=int, default=1024, help="open loop: in-flight cap (default 1024)")
    ap.add_argument("--warmup", type=int, default=0, help="uncounted requests sent first, one by one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sweep", type=_values, metavar="rate=R1,R2,...|concurrency=N1,N2,...",
                    help="run once per value and plot latency and throughput against offered load")
    ap.add_argument("--plot", default="loadtest_sweep.png", help="PNG written by --sweep (default %(default)s)")
    ap.add_argument("--json", metavar="FILE", help="write the figures (and every sweep point) as JSON")
    ap.add_argument("--engine", metavar="CHECKPOINT",
                    help="load an engine in this process instead of HTTP (the baseline for HTTP overhead)")
    ap.add_argument("--engine-config", default="{}", help="EngineConfig fields as JSON, with --engine")
    ap.add_argument("--threads", type=int, help="torch threads for --engine")
    ap.add_argument("--allow-remote", action="store_true", help="permit a non-loopback --url")
    ap.add_argument("--compare-echo", action="store_true",
                    help="start Ray here, run the load against the service and then a trivial echo app of the same "
                         "layout and Serve options (service/loadtest/echo.py), print the ratio; --url is not used")
    ap.add_argument("--proxy", choices=("haproxy", "ray"), default="haproxy",
                    help="--compare-echo: Ray Serve data plane (default %(default)s, as python -m service)")
    ap.add_argument("--app-config", metavar="FILE",
                    help="--compare-echo: build_app arguments, laid out as python -m service --config FILE "
                         "would (service.__main__.local_layout)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="--compare-echo: rounds of both apps, alternating which goes first; prints each round's "
                         "ratio and their median (default %(default)s)")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    return ap


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    concurrency = args.concurrency if args.concurrency is not None or args.rate is not None else 8
    duration = args.duration if args.duration is not None or args.requests is not None else 30.0
    return LoadConfig(url=args.url, path=args.path, concurrency=concurrency, rate=args.rate,
                      requests=args.requests, duration=duration, sentences=args.sentences, texts=args.texts,
                      beam_size=args.beam_size, attention=args.attention, stream=args.stream,
                      max_new_tokens=args.max_new_tokens, source_lang=args.source_lang,
                      target_lang=args.target_lang, model=args.model, timeout=args.timeout,
                      max_inflight=args.max_inflight, warmup=args.warmup, seed=args.seed,
                      allow_remote=args.allow_remote)


async def _amain(args: argparse.Namespace, cfg: LoadConfig) -> dict[str, Any]:
    target = None
    if args.engine:
        target = EngineTarget(cfg, args.engine, json.loads(args.engine_config), args.threads)
    try:
        if args.sweep:
            kind, values = args.sweep
            points = await run_sweep(cfg, kind, values, target, progress=not args.quiet)
            sat = saturation(points)
            plot = plot_sweep(points, args.plot, title=f"{kind} sweep: texts {cfg.texts}, beam {cfg.beam_size}")
            print(f"saturation: {_describe_saturation(sat)}; plot written to {plot}")
            return {"config": dataclasses.asdict(cfg), "sweep": kind, "points": points, "saturation": sat,
                    "plot": str(plot)}
        res = await run_load(cfg, target, Progress(not args.quiet))
        s = res.summary()
        print(format_summary(s))
        return {"config": dataclasses.asdict(cfg), "summary": s}
    finally:
        if target is not None:
            await target.aclose()


def _describe_saturation(sat: Optional[dict[str, Any]]) -> str:
    if sat is None:
        return "none of the points kept up"
    load = f"rate {sat['rate']:g}/s" if sat["loop"] == "open" else f"{sat['concurrency']} users"
    return f"{load}, {sat['achieved_rate']:.2f} req/s, {sat['generated_tokens_per_s']:.1f} tokens/s"


def build_report_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m service.loadtest report",
                                 description="Measure the load-test report in one bounded run: starts the service "
                                             "itself on a free 127.0.0.1 port (its own Ray instance) and writes "
                                             "report.json, the plots and performance.md into --out.")
    from model.checkpoint import DEFAULT_CHECKPOINT
    ap.add_argument("--out", default="deploy/performance", help="plots, report.json, performance.md (default %(default)s)")
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT), help="served model (default: the shipped one)")
    ap.add_argument("--sentences", default=str(DEFAULT_SENTENCES))
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every run's duration (0.3 = a quick try)")
    ap.add_argument("--budget", type=float, default=ReportPlan.budget_s,
                    help="seconds by which every load run has ended, shortened or skipped if need be (default "
                         "%(default)g; with service start-up and shut-down the report stays under 15 minutes)")
    ap.add_argument("-q", "--quiet", action="store_true")
    return ap


def report_main(argv: Sequence[str]) -> int:
    ap = build_report_parser()
    args = ap.parse_args(list(argv))
    if not (args.scale > 0 and args.budget > 0):
        ap.error("--scale and --budget must be > 0")
    if not (Path(args.checkpoint) / "config.json").exists():
        ap.error(f"--checkpoint {args.checkpoint}: no config.json there")
    out = Path(args.out)
    plan = ReportPlan(scale=args.scale, budget_s=args.budget)
    data = run_report(out, args.checkpoint, plan, args.quiet, args.sentences)
    command = "python -m service.loadtest report" + (" " + shlex.join(argv) if argv else "")
    (out / "performance.md").write_text(report_markdown(data, command))
    print(f"report written to {out}/ (report.json, performance.md, plots) in {data['elapsed_s'] / 60:.1f} min")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:
        return report_main(argv[1:])
    if argv[:1] == ["soak"]:
        from .soak import soak_main     # docs/limits.md#soak-test
        return soak_main(argv[1:])
    ap = build_parser()
    args = ap.parse_args(argv)
    cfg = config_from_args(args)
    if args.engine:
        cfg.url = DEFAULT_URL   # unused: the engine runs in this process
    try:
        cfg.validate()
    except ValueError as e:
        ap.error(str(e))
    if args.compare_echo:
        if args.engine or args.sweep or cfg.loop != "closed" or cfg.stream:
            ap.error("--compare-echo runs one closed loop (-c) over HTTP without --stream, --sweep or --engine")
        if args.rounds < 1:
            ap.error(f"--rounds must be >= 1, got {args.rounds}")
        from service.__main__ import load_config, local_layout

        from .echo import compare_echo
        # the layout python -m service would run with this config (the echo app takes the same)
        out = compare_echo(cfg, local_layout(load_config(args.app_config)), args.proxy, args.quiet, args.rounds)
    else:
        out = asyncio.run(_amain(args, cfg))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    summaries = [out["summary"]] if "summary" in out else [p for p in out.get("points", []) if isinstance(p, dict)]
    if summaries and all(x.get("requests") and not x.get("ok") for x in summaries):
        errors = {k: v for x in summaries for k, v in x.get("errors", {}).items()}
        print(f"no request succeeded (errors: {errors}): check --url, --path and the request options", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
