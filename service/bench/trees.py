"""Two versions of the service side by side: an older commit against this working tree, the same
client, interleaved rounds, medians and ratios (issue #14's "run the old commit and the new main in
one run"):

    python -m service.bench.trees --old 96d0bc0                   # 3 rounds, all five runs
    python -m service.bench.trees --old 96d0bc0 --rounds 5 --runs greedy32,greedy1

The old commit is checked out with ``git worktree add`` into a temporary directory (removed at the
end; it uses this tree's virtual environment). Each round starts each tree's service in turn (the
order alternates between rounds), ``python -m service --port P --metrics-export-port M`` run in that
tree (this tree also gets ``--new-args``, by default ``--checkpoint model/checkpoints/de-en`` so that
both serve the one de-en model), waits for ``/readyz``, runs the load-test client of this tree
(``python -m service.loadtest``, a separate process) for each run, and stops the service with
SIGINT. Runs (``--runs``):

    greedy32  -c 32 --beam-size 1 --texts 1 --warmup 4   requests/s (single-sentence greedy, 32 clients)
    greedy128 -c 128 --beam-size 1 --texts 1 --warmup 4  requests/s (the same at 128 clients: saturation)
    greedy1   -c 1  --beam-size 1 --texts 1 --warmup 2   p50 latency (one client)
    beam4     -c 32 --beam-size 4 --texts 1              requests/s
    stream8   -c 8  --beam-size 1 --texts 1 --stream     time to first token p50
    texts16   -c 32 --beam-size 1 --texts 16             texts/s

Each run also reads the CPU time (user + system, from ``/proc``) that the service's processes spent
per completed request, by role (HAProxy, Serve's proxy, each deployment's replicas, Ray's own
processes): a figure that moves far less with the machine's load than requests/s, and that shows
which part of the served stack a difference comes from.

Figures, not a test: a machine of this kind moves up to 2x from day to day, so only ratios from one
run mean anything. Only 127.0.0.1 is contacted; every run is bounded by ``--duration``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import httpx

from service.loadtest.serve_app import free_port

ROOT = Path(__file__).resolve().parents[2]
# name -> (load-test arguments, summary field, label, higher is better)
RUNS = {
    "greedy32": (["-c", "32", "--beam-size", "1", "--texts", "1", "--warmup", "4"], "requests_per_s",
                 "greedy, 1 sentence, 32 clients: req/s", True),
    "greedy128": (["-c", "128", "--beam-size", "1", "--texts", "1", "--warmup", "4"], "requests_per_s",
                  "greedy, 1 sentence, 128 clients: req/s", True),
    "greedy1": (["-c", "1", "--beam-size", "1", "--texts", "1", "--warmup", "2"], "latency_p50_s",
                "greedy, 1 sentence, 1 client: p50 latency s", False),
    "beam4": (["-c", "32", "--beam-size", "4", "--texts", "1"], "requests_per_s",
              "beam 4, 1 sentence, 32 clients: req/s", True),
    "stream8": (["-c", "8", "--beam-size", "1", "--texts", "1", "--stream"], "ttft_p50_s",
                "streaming, 8 clients: time to first token p50 s", False),
    "texts16": (["-c", "32", "--beam-size", "1", "--texts", "16"], "texts_per_s",
                "16 texts per request, 32 clients: texts/s", True),
}


def _processes(root: int) -> dict[int, str]:
    """Every process under ``root`` (``root`` included), pid -> role: Serve's replicas and actors by
    the title Ray gives them (``ray::ServeReplica:APP:DEPLOYMENT``), else the program's name."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    roles, todo = {}, [root]
    while todo:
        pid = todo.pop()
        try:
            argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        title = argv[0].decode(errors="replace").split()[0] if argv and argv[0] else "?"
        roles[pid] = title[len("ray::"):] if title.startswith("ray::") else Path(title).name
        todo.extend(children.get(pid, []))
    return roles


def _cpu_s(pids) -> dict[int, float]:
    """User + system CPU seconds each live process has used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _cpu_ms_per_request(root: int, before: dict[int, float], requests: int) -> dict[str, float]:
    """CPU milliseconds per request by role since ``before`` (processes present at both reads)."""
    roles = _processes(root)
    after = _cpu_s(roles)
    per: dict[str, float] = {}
    for pid, t in after.items():
        if pid in before:
            role = roles[pid]
            if role.startswith("ServeReplica:"):
                role = "replica " + role.rsplit(":", 1)[-1]
            per[role] = per.get(role, 0.0) + (t - before[pid]) * 1000 / max(requests, 1)
    per = {k: v for k, v in per.items() if v >= 0.005}
    per["total"] = sum(per.values())
    return per


def _field(summary: dict, name: str) -> Optional[float]:
    """A figure of a load-test summary (``service.loadtest.stats``)."""
    if name == "latency_p50_s":
        return (summary.get("latency_s") or {}).get("p50")
    if name == "ttft_p50_s":
        return (summary.get("ttft_s") or {}).get("p50")
    return summary.get(name)


class Service:
    """``python -m service`` of one tree on free ports; stopped with SIGINT (as a user's Ctrl-C)."""

    def __init__(self, tree: Path, args: list[str], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "service", "--port", str(self.port), "--metrics-export-port",
               str(free_port()), *args]
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, cwd=tree, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": str(tree)})

    def wait_ready(self, timeout_s: float = 900) -> None:   # the old tree compiles its CPU kernels first
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the service exited with status {self.proc.returncode} (log: {self.log.name})")
            try:
                if httpx.get(self.url + "/readyz", timeout=2, trust_env=False).status_code == 200:
                    time.sleep(3)   # let the replicas' start-up work settle
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.log.flush()
        tail = Path(self.log.name).read_text(errors="replace")[-2000:]
        raise RuntimeError(f"the service was not ready within {timeout_s:.0f} s; the end of its log:\n{tail}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        time.sleep(5)        # Ray's processes leave


def _load(url: str, run: str, duration: float, out: Path, root: Optional[int] = None) -> dict:
    """One load-test run; with ``root`` (the service's pid), ``summary["cpu_ms_per_request"]`` gives
    the CPU time the service's processes spent per completed request, by role."""
    args, _, _, _ = RUNS[run]
    before = _cpu_s(_processes(root)) if root else {}
    cmd = [sys.executable, "-m", "service.loadtest", "--url", url, "-q", "--timeout", "60", "--seed", "1",
           "-d", str(duration), *args, "--json", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=duration + 300)
    if done.returncode != 0:
        raise RuntimeError(f"{run}: the load test failed: {done.stderr.strip()[-500:]}")
    summary = json.loads(out.read_text())["summary"]
    if root:
        summary["cpu_ms_per_request"] = _cpu_ms_per_request(root, before, summary.get("ok") or 0)
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m service.bench.trees",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--old", required=True, help="the older commit (anything git rev-parse takes)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (>= 1); medians are shown")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds per run (> 0)")
    ap.add_argument("--old-args", default="", help="extra python -m service arguments for the old tree")
    ap.add_argument("--new-args", default="--checkpoint model/checkpoints/de-en",
                    help="extra python -m service arguments for this tree")
    ap.add_argument("--json", metavar="FILE", help="write every run's figures as JSON")
    args = ap.parse_args(argv)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not runs or not set(runs) <= set(RUNS):
        ap.error(f"--runs must be a non-empty subset of {','.join(RUNS)}, got {args.runs!r}")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if not args.duration > 0:
        ap.error(f"--duration must be > 0, got {args.duration}")
    rev = subprocess.run(["git", "rev-parse", "--short", args.old], cwd=ROOT, capture_output=True, text=True)
    if rev.returncode != 0:
        ap.error(f"--old {args.old!r}: not a commit of this repository")
    old_rev = rev.stdout.strip()
    new_rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True).stdout.strip() + "+working tree"
    tmp = Path(tempfile.mkdtemp(prefix="mt-trees-"))
    old_tree = tmp / "old"
    subprocess.run(["git", "worktree", "add", "--detach", "-f", str(old_tree), old_rev], cwd=ROOT, check=True,
                   capture_output=True)
    trees = {"old": (old_tree, args.old_args.split()), "new": (ROOT, args.new_args.split())}
    figures: dict[str, dict[str, list[float]]] = {t: {r: [] for r in runs} for t in trees}
    cpu: dict[str, dict[str, list[dict[str, float]]]] = {t: {r: [] for r in runs} for t in trees}
    try:
        for rnd in range(args.rounds):
            for name in (("old", "new") if rnd % 2 == 0 else ("new", "old")):
                tree, extra = trees[name]
                svc = Service(tree, extra, tmp / f"{name}-{rnd}.log")
                try:
                    svc.wait_ready()
                    for run in runs:
                        s = _load(svc.url, run, args.duration, tmp / f"{name}-{rnd}-{run}.json",
                                  root=svc.proc.pid)
                        value = _field(s, RUNS[run][1])
                        figures[name][run].append(value)
                        cpu[name][run].append(s["cpu_ms_per_request"])
                        roles = "  ".join(f"{k} {v:.2f}" for k, v in sorted(s["cpu_ms_per_request"].items()))
                        print(f"round {rnd + 1} {name:3} {run:9} {value}   CPU ms/request: {roles}", flush=True)
                finally:
                    svc.stop()
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nold = {old_rev}, new = {new_rev}; medians of {args.rounds} interleaved round(s), "
          f"{args.duration:g} s per run")
    print(f"{'run':50} {'old':>10} {'new':>10} {'new/old':>8}")
    for run in runs:
        o, n = statistics.median(figures["old"][run]), statistics.median(figures["new"][run])
        print(f"{RUNS[run][2]:50} {o:10.3f} {n:10.3f} {n / o:8.2f}")
    print("\nCPU milliseconds per request of the service's processes, by role (medians):")
    for run in runs:
        roles = sorted({k for t in trees for d in cpu[t][run] for k in d}, key=lambda k: (k == "total", k))
        for role in roles:
            o, n = (statistics.median(d.get(role, 0.0) for d in cpu[t][run]) for t in ("old", "new"))
            print(f"  {run:9} {role:42} {o:10.3f} {n:10.3f} {n / o if o else float('nan'):8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"old": old_rev, "new": new_rev, "figures": figures, "cpu": cpu},
                                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
