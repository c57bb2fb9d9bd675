"""Run the translation service: ``python -m service`` (what ``make serve`` runs).

Starts a local Ray instance with fixed ports (or joins one with --address), deploys the app from
``service.app.build_app`` with every model under model/checkpoints/ (de-en first), serves HTTP on 127.0.0.1:8000 and
blocks until Ctrl-C, then shuts down what it started.

    python -m service [--host 127.0.0.1] [--port 8000] [--config app.yaml] [--checkpoint DIR]
                      [--num-cpus N] [--metrics-export-port 8080] [--address auto] [--api-keys-file FILE]
                      [--ingress translator|separate] [--proxy haproxy|ray]

--config takes the one config shape of the service (``service.app.AppArgs``, docs/deploy.md#configuration):
a YAML (or JSON) file with ``build_app`` arguments, e.g. ``{engine: {max_num_seqs: 32}, translator:
{num_replicas: 3}}``, or a Serve config file (``deploy/serve_config.yaml``), whose one application's
``args`` are the same keys. --checkpoint, --api-keys-file and --ingress override what it says.

Layout: the default (``ingress: translator``) runs the translators inside the ingress replicas, two
of them on a machine with at least two CPUs and no GPU unless the config sets the translators'
``num_replicas`` or ``autoscaling_config`` (``local_layout``); ``--ingress separate`` (or
``ingress: separate``) puts a Gateway in front of one translator deployment per model.

--proxy haproxy (default): Ray Serve's throughput mode, HAProxy in front of the ingress replicas
(``service/ray_env.py``, docs/deploy.md#ingress-proxy); --proxy ray: Ray Serve's own HTTP proxy.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

from .ray_env import (DEFAULT_METRICS_EXPORT_PORT, PROXIES, REPLICA_GRPC_HOOK, apply_loopback_ray, apply_serve_env,
                      apply_worker_path, haproxy_ports, metrics_export_port, remove_workdir, serve_http_host)

# Replicas of the default layout on a machine with >= 2 CPUs and no GPU: 0.8 CPU each (AppArgs.num_cpus),
# one torch thread each. On 2 cores, in one hour: 263.8 single-sentence requests/s at 32 clients against
# 189.3 for the separate layout (docs/performance.md "One process per replica, and the handles' transport").
LOCAL_REPLICAS = 2


def load_config(path: str | None) -> dict:
    """``build_app`` arguments from a YAML or JSON file: ``AppArgs``' keys, or a Serve config file
    whose one application's ``args`` are those keys. Raises OSError, ValueError (yaml's errors too)."""
    if not path:
        return {}
    text = Path(path).read_text()
    if path.endswith(".json"):
        data = json.loads(text)
    else:
        import yaml
        data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of build_app arguments, got {type(data).__name__}")
    if "applications" in data:   # a Serve config file: the args of its one application
        apps = data["applications"] or []
        if len(apps) != 1:
            raise ValueError(f"{path}: expected one application, got {len(apps)}")
        if apps[0].get("deployments"):
            raise ValueError(f"{path}: deployment options go in the application's args (translator:, "
                             "gateway:, models[].deployment:), not in deployments:")
        data = dict(apps[0].get("args") or {})
    return data


def local_layout(config: dict, cpus: int | None = None, gpu: bool | None = None) -> dict:
    """``config`` (build_app arguments) sized for this machine as ``python -m service`` runs it: in
    the default layout (``ingress: translator``) with no ``num_replicas`` or ``autoscaling_config``
    in ``config["translator"]``, LOCAL_REPLICAS replicas when the machine has at least that many CPUs
    (``cpus``, default os.cpu_count()) and no GPU (``gpu``, default torch.cuda.is_available(): one
    GPU replica per model copy would need a GPU each), else one. The caller's dict is left as it was."""
    from .app import AppArgs      # here: Ray Serve reads its settings when imported (see main)
    config = dict(config)
    translator = dict(config.get("translator") or {})
    layout = config.get("ingress", AppArgs.model_fields["ingress"].default)
    if layout == "translator" and not {"num_replicas", "autoscaling_config"} & set(translator):
        if gpu is None:
            import torch
            gpu = torch.cuda.is_available()
        cpus = (os.cpu_count() or 1) if cpus is None else cpus
        translator["num_replicas"] = LOCAL_REPLICAS if cpus >= LOCAL_REPLICAS and not gpu else 1
        config["translator"] = translator
    return config


def _port(value: str) -> int:
    port = int(value)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 1..65535, got {port}")
    return port


def _cpus(value: str) -> float:
    n = float(value)
    if not n > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {value}")
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m service", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1",
                    help="HTTP bind address (default 127.0.0.1): HAProxy's frontend, or Serve's proxy with --proxy ray; "
                         "everything else the service starts listens on 127.0.0.1 (docs/security.md#what-listens-where)")
    ap.add_argument("--port", type=_port, default=8000, help="HTTP port (default 8000)")
    ap.add_argument("--config", help="YAML/JSON file with build_app arguments (or a Serve config file)")
    ap.add_argument("--checkpoint", help="serve this checkpoint directory as the default model")
    ap.add_argument("--api-keys-file", help="require API keys: one per line, re-read when it changes "
                                            "(MT_API_KEYS adds comma-separated keys; docs/limits.md)")
    ap.add_argument("--num-cpus", type=_cpus, default=None, help="CPUs of the local Ray instance (default: all)")
    ap.add_argument("--metrics-export-port", type=_port, default=None,
                    help="Ray metrics agent port, scraped on 127.0.0.1 by GET /metrics (default "
                         f"{DEFAULT_METRICS_EXPORT_PORT}, or a free port when another instance holds it)")
    ap.add_argument("--address", default="local",
                    help="Ray address: 'local' starts a new instance (default); 'auto' or HOST:PORT joins one")
    ap.add_argument("--ingress", default=None, metavar="{translator,separate}",
                    help="the layout, overriding the config's: 'translator' (the default): the translators run in "
                         f"the ingress replicas, {LOCAL_REPLICAS} of them on a CPU machine; 'separate': a Gateway "
                         "in front of one translator deployment per model")
    ap.add_argument("--proxy", choices=PROXIES, default="haproxy",
                    help="HTTP ingress: 'haproxy' (Ray Serve's throughput mode, default) or 'ray' (its Python proxy)")
    args = ap.parse_args(argv)
    from model.inference import settings
    try:
        settings.from_env()   # MT_LINEAR_DTYPE etc. are read by every replica: refuse a bad value now
    except ValueError as e:
        ap.error(str(e))

    if args.address == "local":
        apply_loopback_ray()     # Ray's own servers on 127.0.0.1, whatever --host is (before ray is imported)
        apply_worker_path()      # the workers' setup hook (REPLICA_GRPC_HOOK) imports this copy of service
        try:
            metrics_port = metrics_export_port(args.metrics_export_port)
        except ValueError as e:
            ap.error(str(e))
        if metrics_port != (args.metrics_export_port or DEFAULT_METRICS_EXPORT_PORT):
            print(f"the Ray metrics agent's default port {DEFAULT_METRICS_EXPORT_PORT} is taken (another instance?): "
                  f"using {metrics_port}", flush=True)

    # Ray Serve reads its data-plane settings when imported, in every process: into os.environ before
    # ray is imported here and before ray.init starts the processes that inherit them.
    ports = haproxy_ports() if args.proxy == "haproxy" else {}
    if ports:
        print(f"Serve's default HAProxy stats/metrics or fallback-proxy ports are taken (another instance?): "
              f"using {ports}", flush=True)
    serve_env = apply_serve_env(args.proxy, **ports)
    # On a local instance HAProxy's frontend alone takes --host (the replicas' HTTP ports stay on loopback)
    serve_host = serve_http_host(args.host, serve_env) if args.address == "local" else args.host
    import ray
    import yaml
    from ray import serve

    from .app import LOGGING_CONFIG, AppArgs, build_app

    # Everything a user can get wrong in the arguments is checked before Ray starts, as one line.
    try:
        config = load_config(args.config)
        if args.checkpoint:
            models = list(config.get("models") or [{}])
            models[0] = {**models[0], "checkpoint": args.checkpoint}
            config["models"] = models
        if args.api_keys_file:
            config["api_keys_file"] = args.api_keys_file
        if args.ingress:
            config["ingress"] = args.ingress
        app_args = AppArgs.model_validate(local_layout(config, cpus=int(args.num_cpus) if args.num_cpus else None))
        app = build_app(app_args)        # reads every checkpoint's config: a wrong directory fails here
    except (OSError, ValueError, yaml.YAMLError) as e:   # (pydantic's ValidationError is a ValueError)
        remove_workdir(serve_env)                        # nothing started: no HAProxy directory left behind
        ap.error(" ".join(str(e).split()))

    started_ray = args.address == "local"
    # Every worker of this job, the replicas among them, runs REPLICA_GRPC_HOOK (the replicas' gRPC
    # servers for handle calls on the node's address). A cluster that runs already: its raylets'
    # environment decides for the processes they have started; the job's env_vars reach the Serve
    # controller, proxies and replicas this run creates.
    runtime_env = {"worker_process_setup_hook": REPLICA_GRPC_HOOK, **({} if started_ray else {"env_vars": serve_env})}
    init = dict(address=args.address, namespace="serve", runtime_env=runtime_env)
    if started_ray:
        init.update(include_dashboard=False, num_cpus=int(args.num_cpus) if args.num_cpus else None,
                    _metrics_export_port=metrics_port,
                    _system_config={"metrics_report_interval_ms": 2000})
    try:
        ray.init(**init)
    except BaseException:       # e.g. Ray's start timing out; HAProxy has not started: its directory goes
        remove_workdir(serve_env)
        raise
    stop = threading.Event()

    def on_signal(*_):
        if stop.is_set():           # a second Ctrl-C / SIGTERM: stop now, without draining
            raise KeyboardInterrupt
        stop.set()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        serve.start(http_options={"host": serve_host, "port": args.port})
        serve.run(app, name="mt", route_prefix="/", blocking=False, logging_config=LOGGING_CONFIG)
        url = f"http://{args.host}:{args.port}"
        print(f"service ready on {url}  (docs {url}/docs, metrics {url}/metrics); Ctrl-C to stop", flush=True)
        while not stop.is_set():
            stop.wait(1.0)
        # Graceful: the app's replicas leave the routing, finish what they accepted (up to
        # drain_timeout_s, docs/deploy.md#graceful-shutdown-and-redeploys) and exit, while the HTTP
        # proxy stays up to deliver their answers; only then do the proxy and Ray stop.
        print("shutting down: draining accepted requests", flush=True)
        serve.delete("mt")
        print("drained", flush=True)
    finally:
        try:
            serve.shutdown()
        finally:
            if started_ray:
                ray.shutdown()
                remove_workdir(serve_env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
