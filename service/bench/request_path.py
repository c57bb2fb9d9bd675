"""Where each millisecond of a request goes: the request path profiled at one client and at saturation.

    python -m service.bench.request_path                                  # 1 and 128 clients, 15 s each
    python -m service.bench.request_path --clients 1,128 --duration 15 --port 8047 --json out.json

It starts ``python -m service`` on 127.0.0.1 (the default layout: ingress replicas holding the
translators, behind HAProxy), waits for ``/readyz``, and for each client count N runs the project's
load generator (``python -m service.loadtest -c N --beam-size 1 --texts 1``, one sentence per request,
greedy) against it, then the engine alone the same way in one process (``--engine CHECKPOINT
--threads T``, the service idle meanwhile), then the service again while ``py-spy record --format raw
--threads`` samples every thread of each ingress replica (``ray::ServeReplica:*:Gateway``; ``--idle``
off). The stacks are folded into stages (``service.bench.stages``); each thread's CPU time over the
run (``/proc/PID/task``) is shared among the stages of its samples (py-spy's idle test misses some
waits, so sample counts alone overstate them), and threads with no Python frame are one row. Printed
per stage: share of the replicas' CPU and CPU ms per request answered; beside it the CPU per request
of each process of the service (HAProxy, the replicas, Ray's own) from ``/proc``, the median
``latency_ms`` of the replicas' access-log lines (time inside the replica) against the client's p50,
and the unprofiled HTTP / engine-alone requests/s ratio and the p50 HTTP adds, measured side by side.

Figures, not a test: only shares and ratios from one run mean anything on a shared machine. Only
127.0.0.1 is contacted; every run is bounded by ``--duration``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from model.checkpoint import DEFAULT_CHECKPOINT
from service.bench.stages import NATIVE, fold_threads, weigh
from service.bench.trees import _cpu_ms_per_request, _cpu_s, _processes
from service.loadtest.replica_kill import ingress_replicas, start_service, stop_service, wait_ready
from service.loadtest.serve_app import free_port

PY_SPY = str(Path(sys.executable).with_name("py-spy"))
LOAD_ARGS = ["--beam-size", "1", "--texts", "1", "--seed", "1", "--timeout", "60", "-q"]
_LATENCY = re.compile(r"\baccess\b.*?\bpath=/v1/translate\b.*?\blatency_ms=([0-9.]+)")


def loadtest(target: list[str], clients: int, duration: float, warmup: int, out: Path,
             measure_cpu: bool = False) -> dict:
    """One ``python -m service.loadtest`` run; its summary. With ``measure_cpu`` (the engine alone),
    ``summary["cpu_ms_per_request"]``: the process's CPU over its last ``duration`` seconds (read from
    /proc every 0.2 s; the load is what it does then) per request answered."""
    cmd = [sys.executable, "-m", "service.loadtest", *target, "-c", str(clients), "-d", str(duration),
           "--warmup", str(warmup), *LOAD_ARGS, "--json", str(out)]
    err = open(out.with_suffix(".log"), "w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    series: list[tuple[float, float]] = []
    deadline = time.monotonic() + duration + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if measure_cpu:
            cpu = _cpu_s([proc.pid]).get(proc.pid)
            if cpu is not None:
                series.append((time.monotonic(), cpu))
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    if proc.wait() != 0:
        err.seek(0)
        raise RuntimeError(f"load test {' '.join(cmd[3:])} failed: {err.read().strip()[-800:]}")
    summary = json.loads(out.read_text())["summary"]
    if measure_cpu and series:
        end_t, end_cpu = series[-1]
        start_cpu = next((c for t, c in series if t >= end_t - summary["duration_s"]), series[0][1])
        summary["cpu_ms_per_request"] = (end_cpu - start_cpu) * 1000 / max(summary["ok"], 1)
    return summary


def thread_cpu(pids: list[int]) -> dict[int, tuple[str, float]]:
    """tid -> (thread name, user + system CPU seconds) of every thread of ``pids``."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                head, rest = (task / "stat").read_text().rsplit(")", 1)
            except OSError:
                continue
            fields = rest.split()
            out[int(task.name)] = (head.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / tick)
    return out


def replica_logs(pids: list[int]) -> list[Path]:
    """The Serve log files (``replica_*.log``) the replica processes hold open."""
    out = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    target = Path(os.readlink(fd))
                except OSError:
                    continue
                if target.name.startswith("replica_") and target.suffix == ".log":
                    out.add(target)
        except OSError:
            continue
    return sorted(out)


def access_latencies(logs: list[Path], offsets: dict[Path, int]) -> list[float]:
    """``latency_ms`` of the ``/v1/translate`` access lines written after ``offsets``."""
    ms = []
    for log in logs:
        with open(log, "rb") as f:
            f.seek(offsets.get(log, 0))
            for line in f.read().decode(errors="replace").splitlines():
                m = _LATENCY.search(line)
                if m:
                    ms.append(float(m.group(1)))
    return ms


def profiled_run(service_pid: int, url: str, clients: int, duration: float, rate: int, native: bool,
                 work: Path) -> dict:
    """A load run while py-spy samples each ingress replica; stages, CPU by process, access-log latency."""
    replicas = ingress_replicas(service_pid)
    if not replicas:
        raise RuntimeError("no ingress replica process (ray::ServeReplica:*:Gateway) under the service")
    logs = replica_logs(replicas)
    offsets = {log: log.stat().st_size for log in logs}
    spies = []
    for pid in replicas:
        cmd = [PY_SPY, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw", "--full-filenames",
               "--threads", "--output", str(work / f"spy-{clients}-{pid}.txt")]
        cmd += ["--native"] if native else ["--nonblocking"]     # native stacks need the target paused
        spies.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(work / f"spy-{clients}-{pid}.log", "w"),
                                      start_new_session=True))
    time.sleep(2)                                                # py-spy attaches
    for spy, pid in zip(spies, replicas):
        if spy.poll() is not None:
            raise RuntimeError(f"py-spy stopped: {(work / f'spy-{clients}-{pid}.log').read_text().strip()[-500:]}")
    before, threads_before = _cpu_s(_processes(service_pid)), thread_cpu(replicas)
    summary = loadtest(["--url", url], clients, duration, 0, work / f"http-prof-{clients}.json")
    cpu = _cpu_ms_per_request(service_pid, before, summary["ok"])
    threads = {tid: (name, t - threads_before[tid][1]) for tid, (name, t) in thread_cpu(replicas).items()
               if tid in threads_before}
    for spy in spies:
        spy.send_signal(signal.SIGINT)                           # py-spy writes its file on Ctrl-C
    samples: dict = {}
    for spy, pid in zip(spies, replicas):
        try:
            spy.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(spy.pid, signal.SIGKILL)
            spy.wait()
        raw = work / f"spy-{clients}-{pid}.txt"
        if raw.exists():
            samples.update(fold_threads(raw.read_text(errors="replace").splitlines()))
    if not samples:
        raise RuntimeError(f"py-spy wrote no samples (see {work}/spy-{clients}-*.log)")
    latencies = access_latencies(logs, offsets)
    ok = max(summary["ok"], 1)
    stage_ms = {k: v * 1000 / ok for k, v in weigh(samples, {t: s for t, (_, s) in threads.items()}).items()}
    unsampled: dict[str, float] = {}
    for tid, (name, seconds) in threads.items():
        if not sum(samples.get(tid, {}).values()):
            unsampled[name] = unsampled.get(name, 0.0) + seconds * 1000 / ok
    return {"summary": summary, "stage_cpu_ms_per_request": stage_ms, "native_threads_ms": unsampled,
            "samples": sum(sum(c.values()) for c in samples.values()), "rate_hz": rate, "cpu_ms_per_request": cpu,
            "access_latency_ms_p50": statistics.median(latencies) if latencies else None,
            "access_lines": len(latencies)}


def stage_table(prof: dict) -> list[tuple[str, float, float]]:
    """(stage, share of the replicas' CPU, CPU ms per request), largest first."""
    ms = prof["stage_cpu_ms_per_request"]
    total = sum(ms.values()) or 1.0
    return [(stage, v / total, v) for stage, v in sorted(ms.items(), key=lambda kv: -kv[1])]


def report(results: dict) -> str:
    lines = []
    for c, r in results["clients"].items():
        prof, http, eng = r["profiled"], r["http"], r["engine"]
        table = stage_table(prof)
        lines += [f"\n## {c} client(s): ingress replicas, py-spy {prof['rate_hz']} Hz ({prof['samples']} samples), "
                  f"{prof['summary']['ok']} requests answered while sampled ({prof['summary']['requests_per_s']:.1f} req/s)",
                  "", "| stage | share of the replicas' CPU | CPU ms / request |", "|---|---:|---:|"]
        lines += [f"| {stage} | {share:.1%} | {ms:.3f} |" for stage, share, ms in table]
        lines.append(f"| **replicas, all threads** | 100% | **{sum(ms for *_, ms in table):.3f}** |")
        top = sorted(prof["native_threads_ms"].items(), key=lambda kv: -kv[1])[:5]
        lines.append(f"\n{NATIVE}, by thread name: " + ", ".join(f"{k} {v:.3f}" for k, v in top))
        cpu = prof["cpu_ms_per_request"]
        lines.append("\nCPU ms per request from /proc (same run): " +
                     ", ".join(f"{k} {v:.3f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])))
        p50 = (http["latency_s"]["p50"] or 0) * 1000
        e50 = (eng["latency_s"]["p50"] or 0) * 1000
        acc = prof["access_latency_ms_p50"]
        lines.append(f"Unprofiled: HTTP {http['requests_per_s']:.1f} req/s, p50 {p50:.2f} ms; engine alone "
                     f"{eng['requests_per_s']:.1f} sentences/s, p50 {e50:.2f} ms; ratio HTTP/engine "
                     f"**{http['requests_per_s'] / max(eng['requests_per_s'], 1e-9):.2f}**, added p50 "
                     f"**{p50 - e50:+.2f} ms**")
        if eng.get("cpu_ms_per_request") is not None:
            lines.append(f"CPU ms per request: service (all processes, /proc) {cpu['total']:.3f}, engine alone "
                         f"{eng['cpu_ms_per_request']:.3f} (ratio {cpu['total'] / max(eng['cpu_ms_per_request'], 1e-9):.2f})")
        if acc is not None:
            lines.append(f"Access log (profiled run, {prof['access_lines']} lines): replica latency_ms p50 "
                         f"{acc:.2f} against the client's p50 {prof['summary']['latency_s']['p50'] * 1000:.2f} ms")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m service.bench.request_path", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--clients", default="1,128", help="comma-separated client counts (default 1,128)")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds per load run (default 15)")
    ap.add_argument("--port", type=int, default=8047, help="the service's HTTP port (default 8047)")
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second per thread (default 200)")
    ap.add_argument("--native", action="store_true",
                    help="py-spy --native (C frames too; pauses the replicas at each sample)")
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT), help="the model served and run alone")
    ap.add_argument("--engine-threads", type=int, default=1, help="torch threads of the engine alone (default 1)")
    ap.add_argument("--service-args", default="", help="extra python -m service arguments")
    ap.add_argument("--json", metavar="FILE", help="write every figure and stage count as JSON")
    args = ap.parse_args(argv)
    try:
        clients = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        ap.error("--clients takes comma-separated integers")
    if not clients or min(clients) < 1 or args.duration <= 0 or args.rate < 1:
        ap.error("--clients needs positive counts, --duration and --rate positive values")
    if not Path(PY_SPY).exists():
        ap.error(f"py-spy not found at {PY_SPY} (pip install py-spy)")

    work = Path(tempfile.mkdtemp(prefix="mt-request-path-"))
    url = f"http://127.0.0.1:{args.port}"
    extra = ["--checkpoint", args.checkpoint, "--metrics-export-port", str(free_port()), *args.service_args.split()]
    print(f"starting python -m service on {url} (log {work}/service.log); load {os.getloadavg()[0]:.1f}", flush=True)
    proc = start_service(args.port, work / "service.log", extra)
    engine_target = ["--engine", args.checkpoint, "--threads", str(args.engine_threads)]
    results: dict = {"clients": {}, "command": sys.argv, "load_average": []}
    try:
        wait_ready(url, proc, 900)
        time.sleep(3)
        loadtest(["--url", url], 4, 5, 4, work / "warm.json")           # compiled paths, connections
        for c in clients:
            http = loadtest(["--url", url], c, args.duration, 2, work / f"http-{c}.json")
            eng = loadtest(engine_target, c, args.duration, 3, work / f"engine-{c}.json", measure_cpu=True)
            prof = profiled_run(proc.pid, url, c, args.duration, args.rate, args.native, work)
            results["clients"][c] = {"http": http, "engine": eng, "profiled": prof}
            results["load_average"].append(os.getloadavg()[0])
            print(f"{c} client(s): HTTP {http['requests_per_s']:.1f} req/s, p50 {http['latency_s']['p50'] * 1000:.2f}"
                  f" ms; engine alone {eng['requests_per_s']:.1f}/s; profiled {prof['samples']} samples", flush=True)
    finally:
        stop_service(proc)
    print(report(results))
    print(f"\nload average during the runs: {', '.join(f'{x:.1f}' for x in results['load_average'])}; files: {work}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
