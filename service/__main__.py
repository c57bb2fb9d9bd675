"""Run the translation service: ``python -m service`` (what ``make serve`` runs).

Starts a local Ray instance with fixed ports (or joins one with --address), deploys the app from
``service.app.build_app`` with the shipped de->en model, serves HTTP on 127.0.0.1:8000 and
blocks until Ctrl-C, then shuts down what it started.

    python -m service [--host 127.0.0.1] [--port 8000] [--config app.yaml] [--checkpoint DIR]
                      [--num-cpus N] [--metrics-export-port 8080] [--address auto] [--api-keys-file FILE]

--config takes a YAML (or JSON) file with ``build_app`` arguments (see service/app.py AppArgs),
e.g.  ``{engine: {max_num_seqs: 32}, translator: {num_replicas: 2}}``; a Serve config file
(with ``applications:``) is also accepted and its first application's ``args`` are used.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path


def load_config(path: str | None) -> dict:
    if not path:
        return {}
    text = Path(path).read_text()
    if path.endswith(".json"):
        data = json.loads(text)
    else:
        import yaml
        data = yaml.safe_load(text) or {}
    if "applications" in data:   # a Serve config file: its first application's args and deployments
        app = (data["applications"] or [{}])[0]
        args = dict(app.get("args") or {})
        for d in app.get("deployments") or []:
            d = dict(d)
            name = d.pop("name", "")
            if name == "Gateway":
                args["gateway"] = {**args.get("gateway", {}), **d}
            elif name.startswith("Translator-"):
                models = args.setdefault("models", [{}])
                spec = next((m for m in models if m.get("name", "de-en") == name[len("Translator-"):]), None)
                if spec is None:
                    raise SystemExit(f"{path}: deployment {name} names no model in args.models")
                spec["deployment"] = {**spec.get("deployment", {}), **d}
            else:
                raise SystemExit(f"{path}: unknown deployment {name!r} (Gateway or Translator-<model>)")
        data = args
    return data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    ap.add_argument("--config", help="YAML/JSON file with build_app arguments (or a Serve config file)")
    ap.add_argument("--checkpoint", help="serve this checkpoint directory as the default model")
    ap.add_argument("--api-keys-file", help="require API keys: one per line, re-read when it changes "
                                            "(MT_API_KEYS adds comma-separated keys; docs/api.md#limits)")
    ap.add_argument("--num-cpus", type=float, default=None, help="CPUs of the local Ray instance (default: all)")
    ap.add_argument("--metrics-export-port", type=int, default=8080,
                    help="Ray metrics agent port, scraped on 127.0.0.1 by GET /metrics (default 8080)")
    ap.add_argument("--address", default="local",
                    help="Ray address: 'local' starts a new instance (default); 'auto' or HOST:PORT joins one")
    args = ap.parse_args(argv)
    from model.linear import default_dtype
    try:
        default_dtype()   # MT_LINEAR_DTYPE is read by every replica at load time: refuse a bad value now
    except ValueError as e:
        ap.error(str(e))

    import ray
    from ray import serve

    from .app import AppArgs, build_app

    config = load_config(args.config)
    if args.checkpoint:
        models = config.get("models") or [{}]
        models[0] = {**models[0], "checkpoint": args.checkpoint}
        config["models"] = models
    if args.api_keys_file:
        config["api_keys_file"] = args.api_keys_file
    app_args = AppArgs.model_validate(config)

    # A loaded small machine can take more than Serve's default 5 s to start the HTTP proxy.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    started_ray = args.address == "local"
    init = dict(address=args.address, namespace="serve")
    if started_ray:
        init.update(include_dashboard=False, num_cpus=int(args.num_cpus) if args.num_cpus else None,
                    _metrics_export_port=args.metrics_export_port,
                    _system_config={"metrics_report_interval_ms": 2000})
    ray.init(**init)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(app_args), name="mt", route_prefix="/", blocking=False)
        url = f"http://{args.host}:{args.port}"
        print(f"service ready on {url}  (docs {url}/docs, metrics {url}/metrics); Ctrl-C to stop", flush=True)
        while not stop.is_set():
            stop.wait(1.0)
        print("shutting down", flush=True)
    finally:
        try:
            serve.shutdown()
        finally:
            if started_ray:
                ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
