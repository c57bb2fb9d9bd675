"""The redeploy step of ``python -m service.loadtest.chaos``: a second Ray driver that joins the Ray
instance a ``python -m service`` started and applies a changed config to its app ``mt`` under load,
as ``serve.run`` / ``serve deploy`` would (the test service's redeploys: tests/test_redeploy_default.py).

    python -m service.loadtest.redeploy --address 127.0.0.1:GCS_PORT [--config F] [--cpus N] [--change JSON]

It builds two apps first: the service's (``F`` sized as ``python -m service --config F [--num-cpus N]``
sizes it) and the same merged with ``--change`` (default: each translator replica's ``num_cpus``
0.05 lower, a new resource request, so Serve replaces every translator replica), prints ``ready``, then
applies the changed one for each line it reads on stdin, the service's for the next, and so on,
printing ``applied T`` before ``serve.run`` and ``running T`` once the app runs again (T:
``time.monotonic()``, one clock for every process on the machine). It ends at the end of stdin.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

APP, PREFIX = "mt", "/"        # what python -m service deploys


def merged(base: dict, change: dict) -> dict:
    """``base`` with ``change`` written over it, mappings merged key by key."""
    out = dict(base)
    for k, v in change.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def configs(path: Optional[str], cpus: Optional[float], change: Optional[dict]) -> list[dict]:
    """[the service's build_app arguments, the changed ones], as ``python -m service`` sizes them."""
    from service.__main__ import load_config, local_layout
    from service.app import AppArgs
    base = load_config(path)
    if change is None:
        change = {"num_cpus": round(base.get("num_cpus", AppArgs.model_fields["num_cpus"].default) - 0.05, 2)}
    n = int(cpus) if cpus else None
    return [local_layout(base, cpus=n), local_layout(merged(base, change), cpus=n)]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m service.loadtest.redeploy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", required=True, help="the service's Ray GCS, 127.0.0.1:PORT")
    ap.add_argument("--config", help="the service's --config file")
    ap.add_argument("--cpus", type=float, help="the service's --num-cpus")
    ap.add_argument("--change", type=json.loads, help="build_app arguments merged over the config (JSON)")
    args = ap.parse_args(argv)
    from service.ray_env import REPLICA_GRPC_HOOK, apply_loopback_ray, apply_worker_path
    apply_loopback_ray()          # this driver's node is the service's (127.0.0.1), before ray is imported
    apply_worker_path()
    # a local ray.init (python -m service's) turns on Ray's token authentication, its token in ~/.ray/auth_token;
    # a driver joining it must send that token
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray
    from ray import serve

    from service.app import LOGGING_CONFIG, AppArgs, build_app
    apps = [build_app(AppArgs.model_validate(c)) for c in configs(args.config, args.cpus, args.change)]
    ray.init(address=args.address, namespace="serve", log_to_driver=False,
             runtime_env={"worker_process_setup_hook": REPLICA_GRPC_HOOK})     # as python -m service's job
    print("ready", flush=True)
    n = 1
    for _ in sys.stdin:
        print(f"applied {time.monotonic():.3f}", flush=True)
        serve.run(apps[n % 2], name=APP, route_prefix=PREFIX, blocking=False, logging_config=LOGGING_CONFIG)
        print(f"running {time.monotonic():.3f}", flush=True)
        n += 1
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
