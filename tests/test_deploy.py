"""Static checks of the deployment files (deploy/, docker-compose.yml).

Docker cannot run on the build machine (no engine), so the compose file and the Dockerfile are
checked here instead: the compose file against the Compose specification's JSON schema (the copy
that the check-jsonschema package vendors from the compose-spec project, verified against its
recorded SHA-256), ports and volumes against the serve config, and every file they reference must
exist. The serve configs are validated with Ray Serve's own pydantic schema (``ServeDeploySchema``)
and, because that schema ignores unknown keys, also checked for misspelt field names; their ``args``
are the service's one config shape (``service.app.AppArgs``), the same object ``build_app`` and
``python -m service --config`` read, and the deployments ``build_app`` makes from them pass Serve's
own checks.
"""
from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
import re
import shlex
import subprocess
import warnings
from pathlib import Path

import jsonschema
import pytest
import yaml
from pydantic import BaseModel
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import (DeploymentSchema, HTTPOptionsSchema, LoggingConfig, RayActorOptionsSchema,
                              ServeApplicationSchema, ServeDeploySchema)

from conftest import exported_names
from service.__main__ import load_config
from service.app import LOGGING_CONFIG, AppArgs, ModelSpec, PoolSpec, build_app, deployment_options
from service.engine import EngineConfig
from service.ray_env import (GRPC_MESSAGE, HAPROXY_BINARY_VAR, HEADER_CHECK, HEADER_CHECK_VAR, LEAN, REPLICA_GRPC_HOOK, RETRY,
                             SETUP_HOOK_VAR, THROUGHPUT, serve_env)

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SERVE_CONFIGS = [DEPLOY / "serve_config.yaml", DEPLOY / "serve_config.gpu.yaml"]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "translator.json"
RAYSERVICE = DEPLOY / "rayservice.yaml"

# Where a key of the serve config is allowed, by the pydantic model that reads that mapping.
NESTED = {
    (ServeDeploySchema, "http_options"): HTTPOptionsSchema,
    (ServeDeploySchema, "logging_config"): LoggingConfig,
    (ServeDeploySchema, "applications"): ServeApplicationSchema,
    (ServeApplicationSchema, "deployments"): DeploymentSchema,
    (ServeApplicationSchema, "logging_config"): LoggingConfig,
    (ServeApplicationSchema, "args"): AppArgs,
    (AppArgs, "models"): ModelSpec,
    (AppArgs, "pool"): PoolSpec,
    (PoolSpec, "models"): ModelSpec,
    (PoolSpec, "deployment"): DeploymentSchema,
    (AppArgs, "translator"): DeploymentSchema,
    (AppArgs, "gateway"): DeploymentSchema,
    (ModelSpec, "deployment"): DeploymentSchema,
    (DeploymentSchema, "ray_actor_options"): RayActorOptionsSchema,
    (DeploymentSchema, "autoscaling_config"): AutoscalingConfig,
    (DeploymentSchema, "logging_config"): LoggingConfig,
}


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def unknown_keys(model: type[BaseModel], data, where: str = "") -> list[str]:
    """Keys of `data` that `model` (and the nested models above) do not declare."""
    if isinstance(data, list):
        return [k for i, item in enumerate(data) for k in unknown_keys(model, item, f"{where}[{i}]")]
    if not isinstance(data, dict):
        return []
    out = []
    for key, value in data.items():
        if key not in model.model_fields:
            out.append(f"{where}.{key}")
        elif (model, key) in NESTED:
            out += unknown_keys(NESTED[(model, key)], value, f"{where}.{key}")
    return out


def app_args(path: Path) -> dict:
    """The ``args`` of a serve config's one application."""
    [app] = load_yaml(path)["applications"]
    return app["args"]


def max_replicas(opts: dict) -> int:
    auto = opts.get("autoscaling_config")
    return auto["max_replicas"] if auto else opts.get("num_replicas", 1)


# ---- serve configs --------------------------------------------------------------------------------
@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_serve_config_validates_against_ray_serve_schema(path):
    raw = load_yaml(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")     # e.g. Serve's FutureWarning on inconsistent autoscaling windows
        config = ServeDeploySchema.model_validate(raw)
    assert unknown_keys(ServeDeploySchema, raw) == []
    assert config.http_options.port == 8000
    [app] = config.applications
    assert app.import_path == "service.app:build_app"
    assert app.route_prefix == "/"
    # as python -m service: Serve's access lines off, the gateway's own access log is the one
    assert config.logging_config is not None
    assert config.logging_config.enable_access_log == LOGGING_CONFIG["enable_access_log"] is False
    # One config shape: everything is in args (no Serve-side deployment overrides), in the default layout.
    assert not app.deployments
    args = AppArgs.model_validate(app.args)
    assert "ingress" not in app.args and args.ingress == AppArgs.model_fields["ingress"].default == "translator"
    opts = deployment_options(args)
    assert list(opts) == ["Gateway"]            # the ingress replicas hold the translator
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for o in opts.values():                 # what build_app passes to serve.deployment passes Serve's checks
            DeploymentSchema.model_validate(o)
    holder = opts["Gateway"]
    assert 0 < holder["ray_actor_options"]["num_cpus"]
    engine = EngineConfig.from_dict(args.engine)     # raises on a misspelt engine option
    # Serve must never cap the engine's batch: a replica may hold more requests than engine slots.
    assert holder["max_ongoing_requests"] >= engine.max_num_seqs and holder["max_queued_requests"] >= 1
    assert holder["user_config"]["engine"] == args.engine
    auto = AutoscalingConfig.model_validate(holder["autoscaling_config"])
    assert 1 <= auto.min_replicas < auto.max_replicas
    assert auto.target_ongoing_requests <= holder["max_ongoing_requests"]
    assert 0 < auto.upscale_delay_s and 0 < auto.downscale_delay_s


@pytest.mark.parametrize("path", [*SERVE_CONFIGS, DEPLOY / "serve_config.pool.yaml", RAYSERVICE], ids=lambda p: p.name)
def test_serve_configs_bind_the_replicas_grpc_to_the_node_address(path):
    """Every Serve config runs REPLICA_GRPC_HOOK in the app's workers: Ray applies a ``runtime_env``'s
    setup hook through the variable it reads at a worker's start (for a driver's ray.init it sets it
    from the field), so the configs set both."""
    from ray._private.ray_constants import WORKER_PROCESS_SETUP_HOOK_ENV_VAR
    doc = load_yaml(path)
    [app] = (yaml.safe_load(doc["spec"]["serveConfigV2"]) if path == RAYSERVICE else doc)["applications"]
    env = ServeApplicationSchema.model_validate(app).runtime_env
    assert SETUP_HOOK_VAR == WORKER_PROCESS_SETUP_HOOK_ENV_VAR
    assert env == {"worker_process_setup_hook": REPLICA_GRPC_HOOK, "env_vars": {SETUP_HOOK_VAR: REPLICA_GRPC_HOOK}}


@pytest.mark.parametrize("path", [*SERVE_CONFIGS, DEPLOY / "two_replicas.yaml", DEPLOY / "serve_config.pool.yaml"],
                         ids=lambda p: p.name)
def test_one_config_shape(path, tmp_path):
    """A serve config's args, the same keys as a python -m service --config file (YAML or JSON, or the
    serve config itself) and as build_app's argument: one parsed AppArgs, the same deployments."""
    raw = load_yaml(path)
    args = raw["applications"][0]["args"] if "applications" in raw else raw
    (tmp_path / "app.yaml").write_text(yaml.safe_dump(args))
    (tmp_path / "app.json").write_text(json.dumps(args))
    parsed = AppArgs.model_validate(args)
    for f in (path, tmp_path / "app.yaml", tmp_path / "app.json"):
        assert AppArgs.model_validate(load_config(str(f))) == parsed, f
    assert deployment_options(AppArgs(**args)) == deployment_options(parsed)
    from model.checkpoint import DEFAULT_CHECKPOINT
    if (DEFAULT_CHECKPOINT / "config.json").exists():
        from ray import serve
        assert isinstance(build_app(args), serve.Application) and isinstance(build_app(parsed), serve.Application)


def test_the_other_layout_is_one_field():
    """``ingress: separate``: a Gateway in front of one translator deployment per model, from the same
    keys; options that only one layout has are refused in the other, never ignored."""
    models = [{"name": "de-en"}, {"name": "other", "deployment": {"num_replicas": 3}}]
    opts = deployment_options(AppArgs(models=models, ingress="separate", num_gpus=0, translator={"num_replicas": 2},
                                      gateway={"num_replicas": 2}))
    assert list(opts) == ["Gateway", "Translator-de-en", "Translator-other"]
    assert opts["Gateway"]["num_replicas"] == 2 and "user_config" not in opts["Gateway"]
    assert (opts["Translator-de-en"]["num_replicas"], opts["Translator-other"]["num_replicas"]) == (2, 3)
    assert opts["Translator-de-en"]["user_config"] == {}
    for bad, words in (({"gateway": {"num_replicas": 2}}, "gateway: options of the separate layout"),
                       ({"models": models}, "per-model replicas need ingress: separate"),
                       ({"translator": {"num_replica": 2}}, "unknown Serve deployment option 'num_replica'"),
                       ({"translator": {"user_config": {}}}, "unknown Serve deployment option 'user_config'"),
                       ({"translator": {"num_replicas": "x"}}, "num_replicas"),
                       ({"engine": {"max_num_seq": 8}}, "max_num_seq: unknown engine option"),
                       ({"models": [{"name": "a"}, {"name": "a"}]}, "unique names")):
        with pytest.raises(ValueError, match=re.escape(words)):
            AppArgs.model_validate(bad)
    # each engine carries its own compute switches: the models of one process may differ
    mixed = AppArgs.model_validate({"models": [{"name": "a"}, {"name": "b", "engine": {"fused_step": False}}]})
    assert [m.engine for m in mixed.models] == [{}, {"fused_step": False}]
    with pytest.raises(FileNotFoundError):
        build_app({"models": [{"name": "x", "checkpoint": "/nonexistent"}]})


def test_cpu_serve_config_fits_two_cpus():
    args = AppArgs.model_validate(app_args(SERVE_CONFIGS[0]))
    total = 0.0
    for name, opts in deployment_options(args).items():
        resources = opts["ray_actor_options"]
        assert resources.get("num_gpus", 0) == 0, name
        total += max_replicas(opts) * resources["num_cpus"]
        assert resources["num_cpus"] < 1, f"{name}: fractional CPUs so that replicas share 2 cores"
    assert total <= 2.0, f"at max scale the app needs {total} CPUs"


def test_two_replica_app_config_fills_two_cpus():
    """deploy/two_replicas.yaml (``python -m service --config ...``): the separate layout, whose
    translator deployment gets two replicas, and gateway + replicas fit on 2 cores."""
    args = AppArgs.model_validate(load_config(str(DEPLOY / "two_replicas.yaml")))
    assert args.ingress == "separate"
    opts = deployment_options(args)
    tr, gw = opts[f"Translator-{args.models[0].name}"], opts["Gateway"]
    assert tr["num_replicas"] == 2 and "autoscaling_config" not in tr
    assert 2 * tr["ray_actor_options"]["num_cpus"] + gw["ray_actor_options"]["num_cpus"] <= 2.0


def test_gpu_serve_config_shares_gpus():
    args = AppArgs.model_validate(app_args(SERVE_CONFIGS[1]))
    num_gpus = deployment_options(args)["Gateway"]["ray_actor_options"]["num_gpus"]
    assert num_gpus == args.num_gpus
    assert 0 < num_gpus < 1 and (1 / num_gpus) == int(1 / num_gpus), "several replicas share one card"
    cpu = AppArgs.model_validate(app_args(SERVE_CONFIGS[0]))
    assert args.engine["max_num_seqs"] > cpu.engine["max_num_seqs"]


def test_serve_config_typo_is_caught():
    """The strict key check can fail: a misspelt option is reported."""
    raw = load_yaml(SERVE_CONFIGS[0])
    raw["applications"][0]["args"]["translator"]["autoscaling_config"]["max_replica"] = 3
    assert unknown_keys(ServeDeploySchema, raw) == [".applications[0].args.translator.autoscaling_config.max_replica"]


# ---- KubeRay --------------------------------------------------------------------------------------
def test_rayservice_embeds_the_gpu_serve_config():
    doc = load_yaml(RAYSERVICE)
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayService"
    assert yaml.safe_load(doc["spec"]["serveConfigV2"]) == load_yaml(SERVE_CONFIGS[1])
    cluster = doc["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["template"]["spec"]["containers"][0]["image"]
    [gpu_group] = cluster["workerGroupSpecs"]
    container = gpu_group["template"]["spec"]["containers"][0]
    for kind in ("requests", "limits"):
        assert int(container["resources"][kind]["nvidia.com/gpu"]) >= 1
    assert gpu_group["minReplicas"] <= gpu_group["replicas"] <= gpu_group["maxReplicas"]
    # The serve port the config uses is a declared container port of the head.
    ports = {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert load_yaml(SERVE_CONFIGS[1])["http_options"]["port"] in ports
    assert int(head["rayStartParams"]["metrics-export-port"]) in ports
    # A worker pod being stopped drains first (deploy/drain_node.sh), within its grace period, which
    # outlasts the replicas' own drain.
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["/app/deploy/drain_node.sh"]
    script = (DEPLOY / "drain_node.sh").read_text()
    wait_s = int(re.search(r"DRAIN_WAIT_S:-(\d+)", script).group(1))
    drains = [o["graceful_shutdown_timeout_s"]
              for o in deployment_options(AppArgs.model_validate(app_args(SERVE_CONFIGS[1]))).values()]
    assert drains and max(drains) < wait_s < gpu_group["template"]["spec"]["terminationGracePeriodSeconds"]


def test_drain_node_script_drains_then_waits_for_the_replicas_bounded(tmp_path):
    fake_ray = tmp_path / "ray"
    fake_ray.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/ray-args\n")
    fake_ray.chmod(0o755)
    title = f"fake-replica-{os.getpid()}"
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "REPLICA_TITLE": title}
    # a "replica" that ends after 1 s: the script returns after it, long before its 30 s bound
    replica = subprocess.Popen(["bash", "-c", f"exec -a {title} sleep 1"])
    subprocess.run([str(DEPLOY / "drain_node.sh")], env={**env, "DRAIN_WAIT_S": "30"}, check=True, timeout=25)
    assert replica.poll() is not None
    args = (tmp_path / "ray-args").read_text().split()
    assert args[:3] == ["drain-node", "--reason", "DRAIN_NODE_REASON_PREEMPTION"] and "--deadline-remaining-seconds" in args
    # one that never ends: the script gives up after DRAIN_WAIT_S
    replica = subprocess.Popen(["bash", "-c", f"exec -a {title} sleep 60"])
    try:
        subprocess.run([str(DEPLOY / "drain_node.sh")], env={**env, "DRAIN_WAIT_S": "2"}, check=True, timeout=20)
        assert replica.poll() is None
    finally:
        replica.kill()
        replica.wait()


# ---- docker-compose -------------------------------------------------------------------------------
def compose_schema() -> dict:
    """The Compose specification schema as vendored by check-jsonschema, checked against its SHA-256."""
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    raw = (vendor / "compose-spec.json").read_bytes()
    recorded = (vendor / "sha256" / "compose-spec.sha256").read_text().split()[0]
    assert hashlib.sha256(raw).hexdigest() == recorded
    return json.loads(raw)


def compose_errors(doc: dict) -> list[str]:
    schema = compose_schema()
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in cls(schema).iter_errors(doc)]


def test_compose_file_validates_against_compose_spec():
    doc = load_yaml(COMPOSE)
    assert compose_errors(doc) == []
    assert set(doc["services"]) == {"translator", "prometheus", "grafana"}
    for name, svc in doc["services"].items():
        assert svc.get("healthcheck", {}).get("test"), f"{name} declares no health check"
    # The validator does reject what the spec does not allow.
    bad = load_yaml(COMPOSE)
    bad["services"]["translator"]["shm_sise"] = "2gb"
    bad["services"]["grafana"]["depends_on"] = {"prometheus": {"condition": "service_ready"}}
    errors = compose_errors(bad)
    assert any("shm_sise" in e for e in errors) and any(e.startswith("services/grafana") for e in errors)


def _container_port(spec) -> int:
    if isinstance(spec, dict):
        return int(spec["target"])
    return int(str(spec).rsplit(":", 1)[-1].split("/")[0])


def test_compose_ports_and_volumes_agree_with_configs():
    doc = load_yaml(COMPOSE)
    tr = doc["services"]["translator"]
    serve_config_path = tr["environment"]["SERVE_CONFIG"]
    serve_cfg = load_yaml(ROOT / serve_config_path)
    http_port = serve_cfg["http_options"]["port"]
    assert serve_cfg["http_options"]["host"] == "0.0.0.0", "the proxy must listen beyond the container's loopback"
    assert http_port in {_container_port(p) for p in tr["ports"]}
    assert f":{http_port}/healthz" in " ".join(tr["healthcheck"]["test"])
    # Prometheus scrapes the translator's Ray metrics agent on the port the container starts it with.
    metrics_port = int(tr["environment"]["RAY_METRICS_EXPORT_PORT"])
    assert str(metrics_port) in [str(p) for p in tr.get("expose", [])]
    prom = doc["services"]["prometheus"]
    prom_mounts = dict(v.split(":")[:2][::-1] for v in prom["volumes"] if v.startswith("./"))
    config_file = next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config.file="))
    scrape = load_yaml(ROOT / prom_mounts[config_file])
    targets = [t for job in scrape["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"translator:{metrics_port}"]
    # Grafana: the provisioned dashboard folder is where the dashboard provider reads from.
    graf = doc["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in graf["volumes"] if v.startswith("./")}
    provider = load_yaml(ROOT / mounts["/etc/grafana/provisioning/dashboards"] / "translator.yml")
    dash_dir = provider["providers"][0]["options"]["path"]
    assert (ROOT / mounts[dash_dir] / DASHBOARD.name).is_file()
    assert graf["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == f"{dash_dir}/{DASHBOARD.name}"
    datasources = load_yaml(ROOT / mounts["/etc/grafana/provisioning/datasources"] / "prometheus.yml")
    [ds] = datasources["datasources"]
    prom_port = _container_port(prom["ports"][0])
    assert ds["url"] == f"http://prometheus:{prom_port}"
    dashboard = json.loads(DASHBOARD.read_text())
    ds_var = next(v for v in dashboard["templating"]["list"] if v["type"] == "datasource")
    assert ds_var["current"]["value"] == ds["uid"]


def test_compose_referenced_files_exist():
    doc = load_yaml(COMPOSE)
    build = doc["services"]["translator"]["build"]
    assert (ROOT / build["context"] / build["dockerfile"]).is_file()
    assert (ROOT / doc["services"]["translator"]["environment"]["SERVE_CONFIG"]).is_file()
    for name, svc in doc["services"].items():
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name}: {source} does not exist"
            else:
                assert source in doc["volumes"], f"{name}: undeclared named volume {source}"


# ---- Dockerfile -----------------------------------------------------------------------------------
def dockerfile_instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_image_and_cluster_carry_the_data_plane_settings(tmp_path):
    """What ``python -m service`` sets for Ray Serve (service/ray_env.py), minus per-instance paths and
    ports, is in the image's environment and in both pod templates of the RayService."""
    wanted = {**THROUGHPUT, **GRPC_MESSAGE, **LEAN, **RETRY, HEADER_CHECK_VAR: HEADER_CHECK}
    assert {k: serve_env("haproxy", workdir=str(tmp_path))[k] for k in wanted} == wanted
    # HAProxy without splicing (the image's wrapper at a fixed path; python -m service writes its own)
    assert serve_env("haproxy", workdir=str(tmp_path))[HAPROXY_BINARY_VAR] == str(tmp_path / "haproxy")
    wanted[HAPROXY_BINARY_VAR] = "/opt/venv/bin/haproxy"
    image = dict(kv.split("=", 1) for op, a in dockerfile_instructions() if op == "ENV" for kv in shlex.split(a))
    assert {k: image.get(k) for k in wanted} == wanted
    # the engine's choices (linear_dtype, kernels) are in the serve config's args, not in the image
    assert not [k for k in image if k.startswith("MT_")]
    cluster = load_yaml(RAYSERVICE)["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        env = {e["name"]: e["value"] for e in group["template"]["spec"]["containers"][0]["env"]}
        assert {k: env.get(k) for k in wanted} == wanted


def test_dockerfile_references_existing_files_and_is_hardened():
    ins = dockerfile_instructions()
    args = dict(a.split("=", 1) for op, a in ins if op == "ARG" and "=" in a)
    assert args["BASE_IMAGE"].startswith("python:") and "slim" in args["BASE_IMAGE"]
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu"), "the CPU image installs torch's CPU wheels"
    assert "CUDA" in DOCKERFILE.read_text() and "nvidia/cuda" in DOCKERFILE.read_text()
    assert (ROOT / args["SERVE_CONFIG"]).is_file()
    copies = [a for op, a in ins if op == "COPY"]
    assert copies
    for a in copies:
        parts = [p for p in a.split() if not p.startswith("--")]
        for src in parts[:-1]:
            assert (ROOT / src).exists(), f"COPY source {src} does not exist"
    # The shipped model is in the image: it is package data of `model`, and the build loads it.
    assert any(a.split()[0] == "model" for a in copies)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'model\s*=\s*\[[^\]]*"checkpoints/\*/\*"', pyproject)
    # ... as the non-root user the container runs as, so an unreadable checkpoint fails the build.
    load_at = max(i for i, (op, a) in enumerate(ins) if op == "RUN" and "load_model()" in a)
    assert load_at > max(i for i, (op, _) in enumerate(ins) if op == "USER")
    # The compiled decode attention can be built in the image: a C++ compiler, its source as package
    # data (ninja is a pip dependency), built once at image build time.
    assert re.search(r'model\s*=\s*\[[^\]]*"inference/csrc/\*\.cpp"', pyproject)
    assert re.search(r'model\s*=\s*\[[^\]]*"inference/csrc/\*\.h"', pyproject)    # the sources' shared header
    assert (ROOT / "model" / "inference" / "csrc" / "decode_attention.cpp").is_file()
    assert any(op == "RUN" and "g++" in a for op, a in ins)
    assert any(op == "RUN" and "kernels.decode_attention()" in a for op, a in ins)
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert not any(p.startswith("model") for p in ignore)
    from model.checkpoint import DEFAULT_CHECKPOINT
    assert DEFAULT_CHECKPOINT.is_dir() and any(DEFAULT_CHECKPOINT.iterdir()), \
        "the image ships model/checkpoints/de-en, which is missing"
    # Non-root, health check on /healthz of the serve port, entry point that exists.
    users = [a for op, a in ins if op == "USER"]
    assert users and users[-1] not in ("root", "0")
    [health] = [a for op, a in ins if op == "HEALTHCHECK"]
    port = load_yaml(SERVE_CONFIGS[0])["http_options"]["port"]
    assert f"127.0.0.1:{port}/healthz" in health
    assert str(port) in next(a for op, a in ins if op == "EXPOSE").split()
    [cmd] = [json.loads(a) for op, a in ins if op == "CMD"]
    assert cmd == ["/app/deploy/entrypoint.sh"]
    assert any(op == "COPY" and "deploy/entrypoint.sh" in a and "/app/deploy/" in a for op, a in ins)
    assert any(op == "COPY" and "deploy/drain_node.sh" in a and "/app/deploy/" in a for op, a in ins)


def test_shell_scripts_parse():
    for script, shell in ((DEPLOY / "entrypoint.sh", "sh"), (DEPLOY / "install_prometheus.sh", "bash"),
                          (DEPLOY / "install_browser.sh", "bash"), (DEPLOY / "gpu_check.sh", "bash"),
                          (DEPLOY / "drain_node.sh", "bash"), (DEPLOY / "apt_install.sh", "bash")):
        assert script.stat().st_mode & 0o111, f"{script.name} is not executable"
        subprocess.run([shell, "-n", str(script)], check=True)
    entry = (DEPLOY / "entrypoint.sh").read_text()
    assert "--metrics-export-port" in entry and "serve run" in entry


# ---- Grafana dashboard (offline part; tests/test_prometheus.py runs every query) -----------------
REQUIRED_PANELS = {
    "request rate by status": ["ray_mt_requests_total"],
    "error ratio": ["ray_mt_requests_total"],
    "latency": ["ray_mt_request_duration_seconds_bucket"],
    "time to first token": ["ray_mt_time_to_first_token_seconds_bucket"],
    "time per output token": ["ray_mt_time_per_output_token_seconds_bucket"],
    "prefill batch size": ["ray_mt_prefill_batch_size_"],
    "decode batch size": ["ray_mt_decode_batch_size_"],
    "tokens per second": ["ray_mt_generated_tokens_total"],
    "waiting and running": ["ray_mt_waiting_requests", "ray_mt_running_sequences"],
    "kv-cache usage": ["ray_mt_kv_cache_usage_ratio"],
    "replicas": ["ray_mt_replicas_ready"],
}


def dashboard_exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_has_the_required_panels_and_known_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    by_title = {p["title"].lower(): " ".join(t["expr"] for t in p["targets"]) for p in dashboard["panels"]}
    for title, metrics in REQUIRED_PANELS.items():
        panel = next((exprs for t, exprs in by_title.items() if title in t), None)
        assert panel is not None, f"no panel for {title!r}"
        for m in metrics:
            assert m in panel, f"panel {title!r} does not use {m}"
    latency = next(e for t, e in by_title.items() if "latency" in t)
    assert all(f"histogram_quantile({q}," in latency for q in ("0.5", "0.95", "0.99"))
    exported = set(exported_names())
    for expr in dashboard_exprs(dashboard):
        assert "vector(" not in expr, f"padded expression: {expr}"
        for name in re.findall(r"\bray_[a-z0-9_]+", expr):
            assert name in exported, f"{name} is not exported by service/metrics.py ({expr})"
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


# ---- autoscaling demo (deploy/autoscaling_demo.py; the script itself is run by hand) -------------
def test_autoscaling_demo_config_is_a_valid_short_delay_variant():
    import importlib.util
    spec = importlib.util.spec_from_file_location("autoscaling_demo", DEPLOY / "autoscaling_demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    cfg = demo.demo_config(18000, None, target=4, up_s=5, down_s=10)
    config = ServeDeploySchema.model_validate(cfg)
    assert config.http_options.host == "127.0.0.1"
    name, auto = demo.scaled_deployment(cfg["applications"][0]["args"])
    assert name == "Gateway"                    # the default layout: the ingress replicas scale
    auto = AutoscalingConfig.model_validate(auto)
    assert (auto.min_replicas, auto.max_replicas) == (1, 2)
    assert auto.upscale_delay_s <= 10 and auto.downscale_delay_s <= 10
    # Everything else is the shipped CPU config.
    args, base = cfg["applications"][0]["args"], app_args(SERVE_CONFIGS[0])
    for a in (args, base):
        a["translator"].pop("autoscaling_config")
    assert args == base
