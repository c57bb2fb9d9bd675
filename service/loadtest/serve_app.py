"""The service started by the tools (the report, the ingress benchmark): a local Ray instance and
the Serve app on free 127.0.0.1 ports; ``free_port`` (``ray_env.spare_port``), the one the tests use too."""
from __future__ import annotations

import contextlib
import os
import time
from typing import Optional

import httpx

# A port free when asked, outside the ports the OS hands Ray's processes while Serve starts.
from service.ray_env import spare_port as free_port


class ServeApp:
    """A Ray instance and the service's Serve app, started on free 127.0.0.1 ports.

    ``proxy``: the Ray Serve data plane (``service.ray_env``: "haproxy", the default of ``python -m
    service``, or "ray"). ``close()`` shuts down only what this started (serve.shutdown +
    ray.shutdown; never `ray stop`)."""

    name = "mt"   # the Serve application's name

    def __init__(self, num_cpus: Optional[int] = None, namespace: str = "mt-loadtest-report", proxy: str = "haproxy"):
        from service.ray_env import HAPROXY_DEFAULT_PORTS, apply_serve_env
        apply_serve_env(proxy, **{arg: free_port() for arg in HAPROXY_DEFAULT_PORTS})   # before Ray starts
        import ray
        from ray import serve
        self.port = free_port()
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                 _metrics_export_port=free_port(), log_to_driver=False, namespace=namespace)
        try:
            try:
                serve.start(http_options={"host": "127.0.0.1", "port": self.port})
            except ray.exceptions.RayActorError:
                # On a busy machine the HTTP proxy can miss its readiness checks; the controller then
                # restarts it and start() gives up. Connect to that controller; deploy() waits for HTTP.
                serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        except BaseException:
            ray.shutdown()
            raise
        self.url = f"http://127.0.0.1:{self.port}"

    def deploy(self, app_args: dict, timeout_s: float = 300.0) -> None:
        """(Re)deploys build_app(app_args) and waits until /readyz answers and /v1/models shows the
        engine settings of app_args["engine"]. Raises RuntimeError after timeout_s."""
        from ray import serve
        from service.app import LOGGING_CONFIG, build_app
        serve.run(build_app(app_args), name=self.name, route_prefix="/", blocking=False, logging_config=LOGGING_CONFIG)
        want = app_args.get("engine", {})
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=self.url, timeout=10, trust_env=False) as client:
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError, KeyError, IndexError, ValueError):
                    if client.get("/readyz").status_code == 200:
                        engine = client.get("/v1/models").json()["data"][0].get("engine", {})
                        if all(engine.get(k) == v for k, v in want.items()):
                            return
                time.sleep(0.5)
        raise RuntimeError(f"the service did not become ready with engine {want} within {timeout_s:.0f} s")

    def delete(self) -> None:
        """Deletes the Serve app (its replicas stop); Ray and Serve keep running for the next deploy()."""
        from ray import serve
        serve.delete(self.name)

    def close(self) -> None:
        import ray
        from ray import serve

        from service.ray_env import remove_workdir
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            remove_workdir(dict(os.environ))   # HAProxy's files (Ray makes the directory again if needed)
