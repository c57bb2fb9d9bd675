"""The performance report: one bounded run that starts the service (ServeApp), measures each
phase (capacity probe, Poisson sweep, run at half the saturation rate, comparisons), and writes
``report.json`` and the sweep plots. The markdown made from it is in ``markdown.py``."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .config import DEFAULT_SENTENCES, LoadConfig
from .generator import Progress, RunResult, run_load
from .plots import plot_sweep
from .serve_app import ServeApp
from .stats import format_summary, saturation
from .targets import EngineTarget

SWEEP_FRACTIONS = (0.3, 0.6, 0.8, 0.95, 1.1, 1.3)   # sweep rates, as fractions of the closed-loop capacity


@dataclass
class ReportPlan:
    """Durations and loads of the report's runs; ``scale`` multiplies every duration."""
    scale: float = 1.0
    probe_s: float = 10.0           # closed-loop capacity probe before each sweep
    probe_users: int = 32           # its concurrency (batching off: a quarter, enough to keep one slot busy)
    point_requests: float = 80.0    # a sweep point lasts ~point_requests / capacity seconds ...
    point_s: tuple[float, float] = (10.0, 25.0)   # ... clamped to this range
    half_s: tuple[float, float] = (15.0, 30.0)    # the run at 50% of saturation lasts ~half_requests / rate s
    half_requests: float = 60.0
    fixed_s: float = 10.0           # each closed-loop run of the attention and overhead comparisons
    loaded_users: int = 16          # "under load" concurrency of those comparisons
    budget_s: float = 780.0         # every load run ends by then (shortened or skipped): the report stays < 15 min
    timeout_s: float = 30.0         # per request; also bounds the drain after the budget
    warmup: int = 4                 # uncounted requests before each probe


class _OutOfTime(Exception):
    pass


def _clamp(x: float, lo_hi: tuple[float, float]) -> float:
    return min(max(x, lo_hi[0]), lo_hi[1])


def _round2(x: float) -> float:
    """x rounded to 2 significant digits (readable sweep rates)."""
    return float(f"{x:.2g}")


def _cmd(cfg: LoadConfig, sweep: str = "", engine: bool = False) -> str:
    """The command line that repeats a report run against a service at $URL (or the engine alone)."""
    parts = ["python -m service.loadtest", "--engine $CHECKPOINT --threads $THREADS" if engine else "--url $URL"]
    if sweep:
        parts.append(sweep)
    elif cfg.concurrency is not None:
        parts.append(f"-c {cfg.concurrency}")
    else:
        parts.append(f"-r {cfg.rate:g}")
    if cfg.duration is not None:
        parts.append(f"-d {cfg.duration:g}")
    if cfg.requests is not None:
        parts.append(f"-n {cfg.requests}")
    parts.append(f"--beam-size {cfg.beam_size}")
    if cfg.texts != "1":
        parts.append(f"--texts {cfg.texts}")
    if cfg.attention:
        parts.append(f"--attention {cfg.attention:g}")
    if cfg.stream:
        parts.append("--stream")
    if cfg.warmup:
        parts.append(f"--warmup {cfg.warmup}")
    parts.append(f"--timeout {cfg.timeout:g} --seed {cfg.seed}")
    return " ".join(parts)


class Report:
    """Runs the report's phases within the plan's time budget and keeps every figure (``self.data``)."""

    def __init__(self, out: Path, checkpoint: str, plan: ReportPlan, quiet: bool = False):
        self.out, self.checkpoint, self.plan, self.quiet = out, checkpoint, plan, quiet
        self.t0 = time.monotonic()
        self.deadline = self.t0 + plan.budget_s
        self.data: dict[str, Any] = {"skipped": [], "shortened": [], "commands": {}}

    def log(self, text: str) -> None:
        if not self.quiet:
            print(text, flush=True)

    def run(self, cfg: LoadConfig, target=None, name: str = "") -> dict[str, Any]:
        """One load run, shortened to end by the deadline; raises _OutOfTime when under 3 s are left."""
        left = self.deadline - time.monotonic()
        if left < 3.0:
            raise _OutOfTime(name)
        if cfg.duration is not None and cfg.duration > left:
            self.data["shortened"].append(name)
            cfg = dataclasses.replace(cfg, duration=round(left, 1))
        res = asyncio.run(self._run(cfg, target))
        s = res.summary()
        self.log(format_summary(s))
        return s

    async def _run(self, cfg: LoadConfig, target) -> RunResult:
        target = target() if callable(target) else target
        try:
            return await run_load(cfg, target, Progress(not self.quiet))
        finally:
            if target is not None:
                await target.aclose()

    def phase(self, key: str, fn, *args) -> None:
        """Runs fn(*args) -> entry into data[key]; a phase out of time keeps what it measured."""
        entry: dict[str, Any] = {}
        try:
            fn(entry, *args)
        except _OutOfTime:
            self.data["skipped"].append(key if not entry else f"{key} (partly)")
            self.log(f"[report] time budget spent: {key} {'cut short' if entry else 'skipped'}")
        if entry:
            self.data[key] = entry

    def sweep(self, entry: dict, title: str, base: LoadConfig, users: int) -> None:
        """Capacity probe (closed loop), Poisson sweep around it, then a run at 50% of saturation."""
        p, key = self.plan, self._current_key
        entry["title"] = title
        self.log(f"[report] {title}: capacity probe, {users} users")
        probe_cfg = dataclasses.replace(base, concurrency=users, rate=None, duration=p.probe_s * p.scale,
                                        warmup=p.warmup)
        entry["probe"] = probe = self.run(probe_cfg, name=f"{title}: probe")
        entry["commands"] = {"probe": _cmd(probe_cfg)}
        capacity = max(probe["achieved_rate"], 1e-3)
        rates = sorted({_round2(capacity * f) for f in SWEEP_FRACTIONS})
        duration = round(_clamp(p.point_requests / capacity, p.point_s) * p.scale, 1)
        sweep_cfg = dataclasses.replace(base, concurrency=None, rate=rates[0], duration=duration)
        entry.update(capacity_estimate=capacity, rates=rates, duration_s=duration, points=[])
        entry["commands"]["sweep"] = _cmd(sweep_cfg, "--sweep rate=" + ",".join(f"{r:g}" for r in rates)
                                          + f" --plot sweep_{key}.png")
        self.log(f"[report] {title}: Poisson sweep over {rates} req/s, {duration:g} s each")
        try:
            for r in rates:
                entry["points"].append(self.run(dataclasses.replace(sweep_cfg, rate=r), name=f"{title}: rate {r:g}"))
        finally:
            if entry["points"]:
                entry["saturation"] = saturation(entry["points"])
                entry["plot"] = str(plot_sweep(entry["points"], self.out / f"sweep_{key}.png", title=title))
        if entry["saturation"] is not None:
            half_rate = entry["saturation"]["rate"] / 2
            half_cfg = dataclasses.replace(base, concurrency=None, rate=half_rate,
                                           duration=round(_clamp(p.half_requests / half_rate, p.half_s) * p.scale, 1))
            self.log(f"[report] {title}: 50% of saturation, {half_rate:g} req/s")
            entry["commands"]["half"] = _cmd(half_cfg)
            entry["half"] = self.run(half_cfg, name=f"{title}: 50%")

    def runs(self, entry: dict, cfgs: dict[str, LoadConfig], targets: Optional[dict[str, Any]] = None) -> None:
        for name, cfg in cfgs.items():
            self.log(f"[report] {self._current_key}: {name}")
            self.data["commands"][f"{self._current_key}/{name}"] = _cmd(cfg, engine=name.startswith("engine"))
            entry[name] = self.run(cfg, (targets or {}).get(name), name=f"{self._current_key}/{name}")

    def __call__(self, key: str, fn, *args) -> None:
        self._current_key = key   # names the plot and the commands of the phase
        self.phase(key, fn, *args)
        self.save()

    def save(self) -> None:
        """Writes report.json (after every phase, so an interrupted report keeps what it measured)."""
        self.data["elapsed_s"] = time.monotonic() - self.t0
        self.data["plan"] = dataclasses.asdict(self.plan)
        (self.out / "report.json").write_text(json.dumps(self.data, indent=2) + "\n")


# CPU flags that change the figures: the int8 kernel is VNNI's, AVX2's or torch's by what the CPU has,
# and bfloat16 linear layers need AVX512-BF16. (/proc/cpuinfo name, how the report writes it.)
CPU_FLAGS = (("avx512_vnni", "AVX-512 VNNI"), ("avx512_bf16", "AVX512-BF16"), ("avx2", "AVX2"), ("fma", "FMA"))


def cpu_facts(cpuinfo: str) -> dict[str, Any]:
    """The CPU model name and its CPU_FLAGS, from the text of /proc/cpuinfo (first processor)."""
    fields = dict(line.split(":", 1) for line in cpuinfo.split("\n\n")[0].splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    facts: dict[str, Any] = {"cpu_flags": [name for flag, name in CPU_FLAGS if flag in flags]}
    if fields.get("model name"):
        facts["cpu_model"] = fields["model name"]
    return facts


def machine_facts(checkpoint: str) -> dict[str, Any]:
    """Where and when the report ran: CPU count, model and flags, platform, date, load average, torch,
    the model's shape."""
    import platform
    facts: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                             "date": time.strftime("%Y-%m-%d %H:%M %Z"), "checkpoint": str(checkpoint)}
    with contextlib.suppress(OSError):
        facts.update(cpu_facts(Path("/proc/cpuinfo").read_text()))
    with contextlib.suppress(OSError):
        facts["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
    with contextlib.suppress(Exception):
        import torch
        facts["torch"] = torch.__version__
        facts["cuda"] = torch.cuda.is_available()
    with contextlib.suppress(Exception):
        cfg = json.loads((Path(checkpoint) / "config.json").read_text())
        facts["model"] = {k: cfg[k] for k in ("d_model", "n_heads", "d_ff", "n_encoder_layers", "n_decoder_layers",
                                               "vocab_size") if k in cfg}
    return facts


def run_report(out: Path, checkpoint: str, plan: ReportPlan, quiet: bool = False,
               sentences: str = str(DEFAULT_SENTENCES)) -> dict[str, Any]:
    """Starts the service (its default deployment, serving checkpoint), measures every figure of the
    load-test report within plan.budget_s, and writes report.json and the plots into out. Returns the report data.

    Phases, most important first: greedy with continuous batching; the same with batching off
    (``max_running_requests`` = 1, applied by reconfigure); beam 4; return_attention and the engine
    alone at 1 and ``loaded_users`` users; streaming at 50% of the greedy saturation."""
    out.mkdir(parents=True, exist_ok=True)
    rep = Report(out, checkpoint, plan, quiet)
    rep.data["machine"] = machine_facts(checkpoint)
    from service.app import AppArgs
    defaults = AppArgs()
    threads = max(1, round(defaults.num_cpus))      # what a translator replica gives torch
    rep.data["service"] = {"num_cpus_per_replica": defaults.num_cpus, "torch_threads_per_replica": threads,
                           "replicas": 1, "ingress": defaults.ingress}
    models = [{"name": "de-en", "checkpoint": str(checkpoint)}]
    batching = {"models": models, "engine": {"max_running_requests": None}}
    no_batching = {"models": models, "engine": {"max_running_requests": 1}}
    app = ServeApp()
    try:
        rep.log(f"[report] service on {app.url}: continuous batching (default engine config)")
        app.deploy(batching)
        base = LoadConfig(url=app.url, duration=plan.fixed_s * plan.scale, sentences=sentences, beam_size="1",
                          timeout=plan.timeout_s, seed=1)
        rep("batching_greedy", rep.sweep, "continuous batching, greedy", base, plan.probe_users)
        if time.monotonic() < rep.deadline - 10:
            rep.log("[report] same service, batching off: max_running_requests = 1")
            app.deploy(no_batching)
            rep("no_batching_greedy", rep.sweep, "batching off (max_running_requests=1), greedy", base,
                max(4, plan.probe_users // 4))
            rep.log("[report] continuous batching again")
            app.deploy(batching)
        rep("batching_beam4", rep.sweep, "continuous batching, beam 4", dataclasses.replace(base, beam_size="4"),
            plan.probe_users)
        c1 = dataclasses.replace(base, concurrency=1, warmup=2)
        cn = dataclasses.replace(base, concurrency=plan.loaded_users, warmup=2)
        rep("attention", rep.runs, {"off_1": c1, "on_1": dataclasses.replace(c1, attention=1.0),
                                           "off_n": cn, "on_n": dataclasses.replace(cn, attention=1.0)})
        rep("overhead", rep.runs, {"engine_1": c1, "engine_n": cn},
            {"engine_1": lambda: EngineTarget(c1, checkpoint, {}, threads),
             "engine_n": lambda: EngineTarget(cn, checkpoint, {}, threads)})
        sat = rep.data.get("batching_greedy", {}).get("saturation")
        if sat is not None:
            rate = sat["rate"] / 2
            cfg = dataclasses.replace(base, rate=rate, stream=True,
                                      duration=round(_clamp(plan.half_requests / rate, plan.half_s) * plan.scale, 1))
            rep("stream_greedy_half", rep.runs, {"stream": cfg})
    finally:
        app.close()
    rep.save()
    return rep.data
