"""Shared test fixtures: the real service (Ray + Serve app) started once per test session.

- ``service_url``: base URL (http://127.0.0.1:PORT) of the running app. It serves the shipped model
  (``model/checkpoints/de-en``) as ``de-en`` when it exists, else a tiny random de->en model, plus a
  tiny random en->de model ``tiny-en-de`` with small engine limits (routing and overload tests), in
  the layout ``python -m service --num-cpus 2`` runs (the default: two ingress replicas holding both
  translators); ``MT_TEST_INGRESS=separate`` runs the separate layout instead.
- ``service_info``: what that service runs (model names, whether de-en is the shipped model, the Ray
  metrics export port).
- ``stop_shared_service()``: shuts the shared service and its Ray instance down (only what this
  conftest started; never ``ray stop``). Tests that start their own Ray cluster call it first, or use
  the ``no_shared_service`` fixture. Tests marked ``cluster`` run after all others.
- The quick loop, ``pytest -m "not slow"``: a test that uses these fixtures, or starts Ray, a browser,
  Prometheus, HAProxy or ``python -m service`` while it sets up or runs, must carry the ``slow`` mark;
  one without it fails, naming what it started (``_no_server_unless_slow``). A few heavy end-to-end
  tests without a server carry the mark too, each where a cheaper quick test covers what it checks
  (the comment above it says which).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx
import pytest

from service.loadtest.serve_app import free_port
from service.ray_env import HAPROXY_DEFAULT_PORTS, apply_serve_env, remove_workdir

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "model" / "data" / "multi30k"
SECOND_MODEL = "tiny-en-de"
# Small engine limits of the second model, so that overload is cheap to provoke.
SECOND_ENGINE = {"max_num_seqs": 8, "max_waiting": 8}
# The shared service's layout (AppArgs.ingress): the default, "translator", unless MT_TEST_INGRESS=separate.
LAYOUT = os.environ.get("MT_TEST_INGRESS") or "translator"
IN_INGRESS = LAYOUT == "translator"
# Serve's limits in front of the second model's own replica (separate layout only; in the default
# layout its engine's max_waiting bounds it)
SECOND_DEPLOYMENT = {"max_ongoing_requests": 4, "max_queued_requests": 4}


def shipped_model_available() -> bool:
    from model.checkpoint import DEFAULT_CHECKPOINT
    return all((DEFAULT_CHECKPOINT / f).exists() for f in ("config.json", "model.safetensors", "tokenizer.model"))


def is_ready(url: str) -> bool:
    """True when ``url``'s ``GET /readyz`` answers 200 (False on any connection error)."""
    try:
        return httpx.get(url + "/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until_ready(url: str, timeout_s: float = 300, what: str = "the service", interval_s: float = 0.5,
                     alive=None) -> None:
    """Poll ``url``'s ``/readyz`` until it answers 200; RuntimeError naming ``what`` after
    ``timeout_s`` seconds. ``alive``: called each round; it may raise (a process that exited)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if alive is not None:
            alive()
        if is_ready(url):
            return
        time.sleep(interval_s)
    raise RuntimeError(f"{what} did not become ready within {timeout_s:.0f} s")


def build_tiny_checkpoint(directory: Path, source_lang: str, target_lang: str, seed: int = 0,
                          max_len: int = 256, data_langs: Optional[tuple[str, str]] = None,
                          words_only: bool = False) -> Path:
    """A random tiny model with a tokenizer trained on a few hundred Multi30k val lines (~2 s).
    ``data_langs``: the (source, target) files the tokenizer reads, for a language the repository has
    no text of (a "fr" model for the pivot tests reads en/de lines); default the model's languages.
    ``words_only``: a logits bias keeps the model from writing byte-fallback pieces and <unk>, so its
    random output is words (text with letters, which a next model translates) rather than bytes."""
    import torch
    from model.checkpoint import save_checkpoint
    from model.config import ModelConfig
    from model.tokenizer import Tokenizer, read_lines
    from model.transformer import Transformer
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    src_data, tgt_data = data_langs or (source_lang, target_lang)
    lines = read_lines(DATA / f"val.{src_data}.gz")[:300] + read_lines(DATA / f"val.{tgt_data}.gz")[:300]
    tok = Tokenizer.train(lines, directory / "spm", vocab_size=500)
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.from_name("tiny", vocab_size=tok.vocab_size, max_len=max_len,
                                              final_logits_bias=words_only))
    if words_only:
        with torch.no_grad():
            for i in range(tok.vocab_size):
                if tok.sp.is_byte(i) or tok.sp.is_unknown(i):
                    model.logits_bias[i] = -100.0
    return save_checkpoint(directory / "ckpt", model, directory / "spm.model",
                           {"source_lang": source_lang, "target_lang": target_lang,
                            "note": "random weights, for tests"}, dtype="float32")


@dataclass
class SharedService:
    """The one Ray instance + Serve app of the test session (started lazily, stopped once)."""
    url: Optional[str] = None
    metrics_port: Optional[int] = None
    models: dict = field(default_factory=dict)
    shipped: bool = False
    stopped: bool = False
    args: dict = field(default_factory=dict)     # the build_app arguments it runs with
    ray_started: bool = False

    def start(self, workdir: Path) -> "SharedService":
        import ray
        from ray import serve

        from model.checkpoint import DEFAULT_CHECKPOINT
        from service.__main__ import local_layout
        from service.app import LOGGING_CONFIG, build_app
        self.shipped = shipped_model_available()
        first = str(DEFAULT_CHECKPOINT) if self.shipped else str(build_tiny_checkpoint(workdir / "de-en", "de", "en"))
        second = str(build_tiny_checkpoint(workdir / "en-de", "en", "de", seed=1, max_len=64))
        self.models = {"de-en": first, SECOND_MODEL: second}
        self.metrics_port, http_port = free_port(), free_port()
        # The default data plane of `python -m service` (HAProxy ingress, throughput mode) unless
        # MT_TEST_PROXY=ray; it also raises Serve's proxy start-up timeout for a loaded 2-core machine.
        apply_serve_env(os.environ.get("MT_TEST_PROXY", "haproxy"),
                        **{arg: free_port() for arg in HAPROXY_DEFAULT_PORTS})
        ray.init(address="local", num_cpus=2, include_dashboard=False, _metrics_export_port=self.metrics_port,
                 object_store_memory=100 * 1024 ** 2, log_to_driver=bool(os.environ.get("MT_TEST_RAY_LOGS")),
                 _system_config={"metrics_report_interval_ms": 1000}, namespace="mt-tests")
        self.ray_started = True
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        second_model = {"name": SECOND_MODEL, "checkpoint": second, "engine": SECOND_ENGINE}
        if not IN_INGRESS:
            second_model["deployment"] = SECOND_DEPLOYMENT
        # what `python -m service --num-cpus 2` deploys (two ingress replicas in the default layout)
        args = local_layout({"models": [{"name": "de-en", "checkpoint": first}, second_model],
                             "num_cpus": 0.8, "ingress": LAYOUT,
                             "memory_file": str(workdir / "memory.sqlite3")},   # not the user's own memory
                            cpus=2, gpu=False)
        self.args = args
        serve.run(build_app(args), name="mt", route_prefix="/", blocking=False, logging_config=LOGGING_CONFIG)
        self.url = f"http://127.0.0.1:{http_port}"
        wait_until_ready(self.url)
        return self

    def stop(self) -> None:
        if not self.ray_started or self.stopped:
            return
        import ray
        from ray import serve
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            remove_workdir(dict(os.environ))    # HAProxy's files (Ray makes the directory again if needed)
            self.stopped = True


_SHARED = SharedService()


def stop_shared_service() -> None:
    """Shut down the shared service and its Ray instance, if this session started them (idempotent)."""
    _SHARED.stop()


@pytest.fixture(scope="session")
def service_info(tmp_path_factory) -> SharedService:
    if _SHARED.stopped:
        pytest.fail("the shared service was already shut down (a cluster test ran before this test)")
    if _SHARED.url is None:
        try:
            _SHARED.start(tmp_path_factory.mktemp("service"))
        except BaseException:
            _SHARED.stop()      # leave no half-started Ray behind; later tests see the stop
            raise
    return _SHARED


@pytest.fixture(scope="session")
def service_url(service_info) -> str:
    """Base URL of the running service (see module docstring)."""
    return service_info.url


PIVOT_APP = "pivot"    # the second application of pivot_service_url, under /pivot


@pytest.fixture(scope="module")
def pivot_service_url(service_info, tmp_path_factory):
    """Base URL (``.../pivot``) of a second Serve application in the shared service's Ray instance,
    for a module's tests of pivoting: ``pivot-de-en`` (the shared service's de-en checkpoint) and
    tiny random ``pivot-en-fr`` and ``pivot-fr-en`` models ("fr" is a label: their tokenizers read
    en/de text), so de->fr goes through en. It holds one 0.1-CPU replica and is deleted after the
    module (the shared application is left as it was)."""
    from ray import serve
    from service.app import LOGGING_CONFIG, build_app
    root = tmp_path_factory.mktemp("pivot-service")
    tiny = {name: str(build_tiny_checkpoint(root / name, s, t, seed=seed, data_langs=data, words_only=True))
            for name, s, t, seed, data in (("en-fr", "en", "fr", 3, ("en", "de")), ("fr-en", "fr", "en", 4, ("de", "en")))}
    models = [{"name": "pivot-de-en", "checkpoint": service_info.models["de-en"]},
              {"name": "pivot-en-fr", "checkpoint": tiny["en-fr"], "engine": {"max_tgt_len": 24}},
              {"name": "pivot-fr-en", "checkpoint": tiny["fr-en"], "engine": {"max_tgt_len": 24}}]
    args = {"models": models, "num_cpus": 0.1, "translator": {"num_replicas": 1}}
    serve.run(build_app(args), name=PIVOT_APP, route_prefix="/" + PIVOT_APP, blocking=False,
              logging_config=LOGGING_CONFIG)
    url = f"{service_info.url}/{PIVOT_APP}"
    try:
        wait_until_ready(url, what=f"the {PIVOT_APP} application")
        yield url
    finally:
        serve.delete(PIVOT_APP)


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Every test runs with one torch intra-op thread (the models here are small, as tiny_model's
    one_thread says): on a 2-core machine shared with other work, two OpenMP threads made the shipped
    model's 100 val sentences take 28 s instead of 0.5 s. Before this, the tests after
    tests/test_config.py already ran with one, set by the gateway's in-process translators
    (IngressConfig.num_threads 1) and never put back, so a test's speed depended on the tests before
    it. Ray's replicas (slow tests) are other processes and set their own."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def grad_mode_restored():
    """A command's main() run in-process (benchmarks, evaluate) may turn autograd off for its
    process; the next test gets the mode it had before."""
    import torch
    enabled = torch.is_grad_enabled()
    yield
    torch.set_grad_enabled(enabled)


@pytest.fixture
def no_shared_service():
    """For tests that start their own Ray cluster: the shared one is shut down first."""
    stop_shared_service()
    yield


# ---- the quick loop starts no server -----------------------------------------------------------------
SERVICE_FIXTURES = {"service_info", "service_url", "no_shared_service", "pivot_service_url"}
# Programs that only tests marked slow may start: Ray's daemons (ray.init, serve.start), a browser and
# its driver, Prometheus, HAProxy, the ray CLI.
SERVER_PROGRAMS = {"gcs_server", "raylet", "ray", "chromium", "chromium-browser", "chrome", "google-chrome",
                   "chromedriver", "prometheus", "haproxy"}


def _server_started_by(args) -> Optional[str]:
    """What server the argument list of a new process starts (None: none of SERVER_PROGRAMS and no
    `python -m service`)."""
    argv = [os.fsdecode(args)] if isinstance(args, (str, bytes, os.PathLike)) else [os.fsdecode(a) for a in args]
    if not argv:
        return None
    if len(argv) == 1:
        argv = argv[0].split()
    name = os.path.basename(argv[0])
    if name in SERVER_PROGRAMS:
        return name
    if name.startswith("python") and any(argv[i:i + 2] == ["-m", "service"] for i in range(len(argv))):
        return "python -m service"
    return None


@contextlib.contextmanager
def _no_server_unless_slow(item):
    """While a test without the slow mark sets up (its fixtures of any scope) and runs, starting Ray,
    a browser, Prometheus, HAProxy or `python -m service` from its own thread fails, naming it: mark
    it slow, so that pytest -m "not slow" stays the quick loop. Every process starts through
    Popen._execute_child."""
    if item.get_closest_marker("slow") is not None:
        yield
        return
    real = subprocess.Popen._execute_child
    test_thread = threading.current_thread()

    def guarded(self, args, *rest, **kwargs):
        started = _server_started_by(args) if threading.current_thread() is test_thread else None
        if started is not None:
            raise AssertionError(f"{item.nodeid} starts {started} but is not marked slow "
                                 "(@pytest.mark.slow): the quick loop (pytest -m 'not slow') starts no server")
        return real(self, args, *rest, **kwargs)
    subprocess.Popen._execute_child = guarded
    try:
        yield
    finally:
        subprocess.Popen._execute_child = real


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    if item.get_closest_marker("slow") is None and SERVICE_FIXTURES & set(getattr(item, "fixturenames", ())):
        pytest.fail(f"{item.nodeid} uses the shared Ray service ({', '.join(sorted(SERVICE_FIXTURES))}, "
                    "directly or through a fixture) but is not marked slow (@pytest.mark.slow)", pytrace=False)
    with _no_server_unless_slow(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _no_server_unless_slow(item):
        return (yield)


_EXIT_STATUS = pytest.StashKey[int]()


def pytest_configure(config):
    config.addinivalue_line("markers", "cluster: starts its own Ray cluster; runs after every other test")


def pytest_collection_modifyitems(session, config, items):
    # Cluster tests last, so the shared service is not needed again after they shut it down.
    items.sort(key=lambda item: item.get_closest_marker("cluster") is not None)


def pytest_sessionfinish(session, exitstatus):
    stop_shared_service()
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave with the tests' own exit status once pytest has reported and cleaned up.

    This process starts and stops Ray several times (the shared service, the cluster tests), and
    Ray's core worker can then crash in interpreter teardown (ray-project/ray#31145): seen once
    here as a segfault after "244 passed", which would fail CI for no test. ``MT_TEST_HARD_EXIT=0``
    keeps the normal teardown (e.g. to debug it)."""
    status = config.stash.get(_EXIT_STATUS, None)
    if status is not None and os.environ.get("MT_TEST_HARD_EXIT", "1") != "0":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


# ---- helpers for tests that call the HTTP API --------------------------------------------------------
@pytest.fixture(scope="session")
def tok():
    """The shipped model's SentencePiece tokenizer."""
    from model.checkpoint import DEFAULT_CHECKPOINT
    from model.tokenizer import Tokenizer
    return Tokenizer(DEFAULT_CHECKPOINT / "tokenizer.model")


def sse_events(text: str) -> list[tuple[str, dict]]:
    """(event, data) of each Server-Sent Event in a response body."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def post(url: str, body, path: str = "/v1/translate", **kw) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120, **kw)


def translate(url: str, text, **fields) -> dict:
    """POST /v1/translate, asserting a 200; the JSON body."""
    r = post(url, {"text": text, **fields})
    assert r.status_code == 200, r.text
    return r.json()


# ---- helpers for tests that read the Prometheus text of GET /metrics ----------------------------------
@functools.lru_cache(maxsize=8)
def family_samples(text: str, family: str) -> tuple:
    """The samples of the metric families in ``text`` whose names start with ``family``, parsed once per
    scrape and prefix: after a run of every route the cluster's text is megabytes of Ray's own series,
    a second to parse whole, and the tests ask it several questions per poll."""
    from prometheus_client.parser import text_string_to_metric_families
    lines = [line for line in text.splitlines()
             if line.startswith(family) or line.startswith(("# HELP " + family, "# TYPE " + family))]
    return tuple(sample for fam in text_string_to_metric_families("\n".join(lines) + "\n") for sample in fam.samples)


def metric_samples(text: str, name: str) -> list:
    """The samples of series `name` in a scrape (prometheus_client's Sample: name, labels, value)."""
    return [s for s in family_samples(text, "_".join(name.split("_")[:2]) + "_") if s.name == name]


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of series `name` whose labels include `labels` (0 when none)."""
    return sum(s.value for s in metric_samples(text, name) if all(s.labels.get(k) == v for k, v in labels.items()))


def exported_names() -> list[str]:
    """The exact series names a scrape of /metrics shows for ``service.metrics.METRICS`` (the prefix
    Ray's agent adds; a histogram's _bucket, _count and _sum)."""
    from service.metrics import METRICS, PREFIX
    out = []
    for name, (kind, _, _) in METRICS.items():
        out += [f"{PREFIX}{name}{s}" for s in ("_bucket", "_count", "_sum")] if kind == "histogram" else [PREFIX + name]
    return out


def scrape(url: str) -> str:
    r = httpx.get(url + "/metrics", timeout=10)
    r.raise_for_status()
    return r.text


def wait_for_metric(url: str, predicate, timeout_s: float = 30.0, interval_s: float = 0.5):
    """Poll GET /metrics until predicate(text) is true (Ray exports every ~1 s); returns the last text."""
    deadline = time.time() + timeout_s
    text = scrape(url)
    while not predicate(text) and time.time() < deadline:
        time.sleep(interval_s)
        text = scrape(url)
    return text
