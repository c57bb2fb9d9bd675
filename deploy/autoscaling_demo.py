"""Autoscaling demo: the service's deployment goes from 1 replica to 2 under load and back to 1.

    .venv/bin/python deploy/autoscaling_demo.py            # ~2-3 minutes, prints a line every 2 s

It starts its own local Ray instance (2 logical CPUs), deploys ``deploy/serve_config.yaml`` the way
``serve run`` does, with demo settings: HTTP on 127.0.0.1 and a free port, a low
``target_ongoing_requests`` (4) and short delays (upscale 5 s, downscale 10 s), and Serve's
autoscaling metrics pushed every 2 s instead of 10 s. Then it
1. waits for 1 running replica (idle),
2. runs N closed-loop clients (default 16) against POST /v1/translate until 2 replicas have been
   running for a while,
3. stops the load and waits for the deployment to shrink back to 1 replica,
printing time, phase, running/starting replicas, ongoing requests, completed requests/s and median
latency. Traffic goes to 127.0.0.1 only; every loop is bounded; the whole run ends within 5 minutes
(``--budget-s``), and it shuts down only the Ray instance it started.

It serves the shipped model (model/checkpoints/de-en); without it, a tiny random model is built
(``--tiny``), which exercises the same scaling path.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from service.loadtest.serve_app import free_port  # noqa: E402 (the repo, when not pip-installed)
SERVE_CONFIG = ROOT / "deploy" / "serve_config.yaml"
DATA = ROOT / "model" / "data" / "multi30k"
APP = "translator"

# Set before Ray starts, so that every Ray process inherits them: Serve's replicas and handles push
# autoscaling metrics every 10 s by default, 2 s makes the demo react within seconds; on a busy
# machine Ray's worker processes start slowly, so the HTTP proxy gets 30 s (default 5 s) to come up.
DEMO_ENV = {"RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "2",
            "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "2",
            "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30"}


def tiny_checkpoint(directory: Path) -> Path:
    """A random tiny de->en model (tokenizer trained on 300+300 Multi30k val lines)."""
    import torch
    from model.checkpoint import save_checkpoint
    from model.config import ModelConfig
    from model.tokenizer import Tokenizer, read_lines
    from model.transformer import Transformer
    lines = read_lines(DATA / "val.de.gz")[:300] + read_lines(DATA / "val.en.gz")[:300]
    tok = Tokenizer.train(lines, directory / "spm", vocab_size=500)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("tiny", vocab_size=tok.vocab_size))
    return save_checkpoint(directory / "ckpt", model, directory / "spm.model",
                           {"source_lang": "de", "target_lang": "en", "note": "random weights, demo"},
                           dtype="float32")


def demo_config(http_port: int, checkpoint: str | None, target: float, up_s: float, down_s: float) -> dict:
    import yaml
    cfg = yaml.safe_load(SERVE_CONFIG.read_text())
    cfg["http_options"].update(host="127.0.0.1", port=http_port)
    cfg["proxy_location"] = "HeadOnly"
    [app] = cfg["applications"]
    if checkpoint:
        for m in app["args"]["models"]:
            m["checkpoint"] = checkpoint
    app["args"]["translator"]["autoscaling_config"].update(
        target_ongoing_requests=target, upscale_delay_s=up_s, downscale_delay_s=down_s,
        min_replicas=1, initial_replicas=1, max_replicas=2)
    return cfg


def scaled_deployment(app_args: dict) -> tuple[str, dict]:
    """(name, autoscaling_config) of the deployment that holds the translator: the ingress ("Gateway")
    in the default layout, Translator-<model> with ``ingress: separate``."""
    from service.app import AppArgs, deployment_options
    return next((name, o["autoscaling_config"]) for name, o in deployment_options(AppArgs.model_validate(app_args)).items()
                if "autoscaling_config" in o)


def replica_counts(deployment: str) -> tuple[int, int]:
    """(running, starting) replicas of the deployment."""
    from ray import serve
    app = serve.status().applications.get(APP)
    if app is None or deployment not in app.deployments:
        return 0, 0
    states = {str(getattr(k, "value", k)): v for k, v in app.deployments[deployment].replica_states.items()}
    return states.get("RUNNING", 0), states.get("STARTING", 0) + states.get("PENDING_MIGRATION", 0)


class Load:
    """N closed-loop clients; records (finish time, latency, status) of every request."""

    def __init__(self, url: str, sentences: list[str], clients: int, deadline: float):
        self.url, self.sentences, self.clients, self.deadline = url, sentences, clients, deadline
        self.done: list[tuple[float, float, int]] = []
        self.in_flight = 0
        self.stop = asyncio.Event()

    async def client(self, http, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set() and time.time() < self.deadline:
            text = rng.choice(self.sentences)
            t0 = time.perf_counter()
            self.in_flight += 1
            try:
                r = await http.post("/v1/translate", json={"text": text, "beam_size": 4})
                status = r.status_code
            except Exception:  # noqa: BLE001 - counted as a failed request
                status = 0
            finally:
                self.in_flight -= 1
            self.done.append((time.time(), time.perf_counter() - t0, status))
            if status != 200:
                await asyncio.sleep(0.2)

    async def run(self) -> None:
        import httpx
        limits = httpx.Limits(max_connections=self.clients + 4)
        async with httpx.AsyncClient(base_url=self.url, timeout=60, limits=limits) as http:
            await asyncio.gather(*(self.client(http, i) for i in range(self.clients)))

    def window(self, seconds: float) -> tuple[float, float | None, int]:
        """(completed requests/s, median latency s, errors) over the last `seconds`."""
        now = time.time()
        recent = [d for d in self.done if d[0] >= now - seconds]
        ok = [lat for _, lat, s in recent if s == 200]
        return len(ok) / seconds, (statistics.median(ok) if ok else None), len(recent) - len(ok)


async def main_async(args, url: str, deployment: str, t_start: float) -> dict:
    from model.tokenizer import read_lines
    sentences = read_lines(DATA / "test_2016_flickr.de.gz")[:200]
    deadline = t_start + args.budget_s - 15          # leave time to shut down
    figures: dict = {}
    period = 2.0

    def line(phase: str, load: Load | None) -> tuple[int, int]:
        running, starting = replica_counts(deployment)
        t = time.time() - t_start
        if load is None:
            print(f"{t:6.1f}s  {phase:<9} replicas running={running} starting={starting}", flush=True)
        else:
            rps, p50, errors = load.window(5.0)
            p50s = f"{p50 * 1000:7.0f} ms" if p50 is not None else "      - ms"
            print(f"{t:6.1f}s  {phase:<9} replicas running={running} starting={starting}  "
                  f"in-flight={load.in_flight:3d}  done/s={rps:5.1f}  p50={p50s}  errors(5s)={errors}", flush=True)
        return running, starting

    # 1) idle: one replica
    while (counts := line("idle", None)) != (1, 0):
        if time.time() > deadline:
            raise SystemExit("the app did not settle at 1 replica")
        await asyncio.sleep(period)

    # 2) load until 2 replicas have been running for `hold_s`
    load = Load(url, sentences, args.clients, deadline)
    runner = asyncio.create_task(load.run())
    t_load = time.time()
    t_two = None
    one_replica_rps = []
    two_replica_rps = []
    while time.time() < deadline:
        await asyncio.sleep(period)
        running, starting = line("load", load)
        rps = load.window(5.0)[0]
        if running == 1 and starting == 0 and time.time() - t_load > 6:
            one_replica_rps.append(rps)
        if running >= 2:
            t_two = t_two or time.time()
            if time.time() - t_two > 6:
                two_replica_rps.append(rps)
            if time.time() - t_two >= args.hold_s:
                break
    load.stop.set()
    await runner
    if t_two is None:
        raise SystemExit("the deployment did not scale up to 2 replicas within the time budget")
    figures["scale_up_s"] = t_two - t_load

    # 3) no load: back to one replica
    t_idle = time.time()
    t_one = None
    while time.time() < deadline:
        running, starting = line("cool-down", None)
        if running == 1 and starting == 0:
            t_one = time.time()
            break
        await asyncio.sleep(period)
    if t_one is None:
        raise SystemExit("the deployment did not scale back down to 1 replica within the time budget")
    figures["scale_down_s"] = t_one - t_idle
    ok = [d for d in load.done if d[2] == 200]
    figures.update(
        requests=len(load.done), ok=len(ok), errors=len(load.done) - len(ok),
        rps_1_replica=statistics.mean(one_replica_rps) if one_replica_rps else float("nan"),
        rps_2_replicas=statistics.mean(two_replica_rps) if two_replica_rps else float("nan"),
        p50_s=statistics.median(lat for _, lat, _ in ok) if ok else float("nan"))
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16, help="concurrent closed-loop clients during the load phase")
    ap.add_argument("--target", type=float, default=4, help="target_ongoing_requests per replica")
    ap.add_argument("--upscale-delay-s", type=float, default=5)
    ap.add_argument("--downscale-delay-s", type=float, default=10)
    ap.add_argument("--hold-s", type=float, default=20, help="keep the load this long once 2 replicas run")
    ap.add_argument("--budget-s", type=float, default=280, help="hard limit for the whole run (seconds)")
    ap.add_argument("--tiny", action="store_true", help="use a tiny random model instead of the shipped one")
    args = ap.parse_args()
    assert args.upscale_delay_s <= 10 and args.downscale_delay_s <= 10, "short delays (<= 10 s) keep the demo short"
    t_start = time.time()

    import ray
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from model.checkpoint import DEFAULT_CHECKPOINT
    tmp = tempfile.TemporaryDirectory(prefix="autoscaling-demo-")
    checkpoint = None
    if args.tiny or not (DEFAULT_CHECKPOINT / "model.safetensors").exists():
        print("using a tiny random model (the shipped checkpoint is missing or --tiny was given)")
        checkpoint = str(tiny_checkpoint(Path(tmp.name)))
    http_port = free_port()
    config = ServeDeploySchema.model_validate(demo_config(http_port, checkpoint, args.target, args.upscale_delay_s,
                                                          args.downscale_delay_s))
    deployment, auto = scaled_deployment(config.applications[0].args)
    print(f"deployment {deployment}: min/max replicas {auto['min_replicas']}/{auto['max_replicas']}, "
          f"target_ongoing_requests {args.target}, upscale_delay_s {args.upscale_delay_s}, "
          f"downscale_delay_s {args.downscale_delay_s}; {args.clients} clients; http://127.0.0.1:{http_port}")

    for key, value in DEMO_ENV.items():
        os.environ.setdefault(key, value)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=100 * 1024 ** 2, namespace="autoscaling-demo")
    try:
        serve.start(proxy_location=config.proxy_location, http_options=config.http_options.model_dump())
        _get_global_client().deploy_apps(config)        # as `serve run deploy/serve_config.yaml` does
        figures = asyncio.run(main_async(args, f"http://127.0.0.1:{http_port}", deployment, t_start))
    finally:
        serve.shutdown()
        ray.shutdown()
        tmp.cleanup()
    print("\nsummary")
    print(f"  1 -> 2 replicas: {figures['scale_up_s']:.1f} s after the load started")
    print(f"  2 -> 1 replicas: {figures['scale_down_s']:.1f} s after the load stopped")
    print(f"  completed requests/s: {figures['rps_1_replica']:.2f} with 1 replica, "
          f"{figures['rps_2_replicas']:.2f} with 2 replicas (2 CPUs shared with everything else)")
    print(f"  requests: {figures['requests']} ({figures['ok']} ok, {figures['errors']} errors), "
          f"median latency {figures['p50_s'] * 1000:.0f} ms")
    print(f"  total run time: {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
