"""The model pool (service/pool.py): Serve's own model multiplexer (``serve.multiplexed``, its LRU
cache and eviction) around tiny random models, in this process (its replica context faked, no Ray
cluster), then the whole app on Ray Serve (slow): routing to the replica that holds a model, the pool
next to a pinned deployment, eviction under load over HTTP."""
from __future__ import annotations

import asyncio
import shutil
import threading
import time
import types
import weakref
from pathlib import Path

import httpx
import pytest

from service.protocol import TranslateJob, TranslateResponse
from service.translator import Translator, model_card
from conftest import build_tiny_checkpoint, metric_sum, sse_events, wait_for_metric, wait_until_ready

ENGINE = {"max_num_seqs": 8, "max_waiting": 64, "linear_dtype": "float32"}
DE = ["Zwei Hunde spielen im Schnee.", "Ein Mann fährt mit dem Fahrrad.", "Eine Frau liest ein Buch im Park."]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Three tiny random de->en checkpoints (different seeds: different outputs)."""
    root = tmp_path_factory.mktemp("pool")
    return {f"m{i}": build_tiny_checkpoint(root / f"m{i}", "de", "en", seed=i, max_len=64) for i in range(3)}


@pytest.fixture(scope="module")
def reference(checkpoints) -> dict[str, list[str]]:
    """Each model's translations of DE by a Translator of its own (what the pool must answer)."""
    async def run():
        out = {}
        for name, ckpt in checkpoints.items():
            t = Translator(model_card(name, ckpt), device="cpu")
            await t.reconfigure(ENGINE)
            r = await t.translate(job(DE))
            out[name] = [x.text for x in r.translations]
            await t.stop()
        return out
    return asyncio.run(run())


def job(texts, max_new_tokens: int = 40) -> TranslateJob:
    from service.api.schemas import TranslateRequest
    j = TranslateRequest(text=list(texts), max_new_tokens=max_new_tokens).job()
    j.deadline, j.timeout_s = time.time() + 120, 120
    return j


@pytest.fixture
def replica_context(monkeypatch):
    """Serve's multiplexer asks for its replica's context; give it one (as inside a replica)."""
    import ray.serve.multiplex as multiplex
    ctx = types.SimpleNamespace(app_name="test", deployment="Pool", replica_id="replica-test")
    monkeypatch.setattr(multiplex, "_get_internal_replica_context", lambda: ctx)
    # and it tells Serve's controller what it holds: no controller here (none is started)
    controller = types.SimpleNamespace(record_request_routing_info=lambda info: None)
    monkeypatch.setattr(multiplex, "_get_global_client", lambda: controller)


async def new_pool(checkpoints, max_models, **kw):
    from service.pool import Pool
    extra = kw.pop("extra", ())
    pool = Pool([model_card(n, p) for n, p in checkpoints.items()] + list(extra), max_models, **kw)
    await pool.reconfigure(ENGINE)
    return pool


def texts_of(answer) -> list[str]:
    assert isinstance(answer, TranslateResponse), answer
    return [t.text for t in answer.translations]


def test_evicted_only_when_idle_and_every_request_in_flight_answered(checkpoints, reference, replica_context):
    """max 2 models: m0 has a stream held open mid-way and 12 requests running when m1 and m2 load.
    Serve's LRU evicts m0 (least recently requested): it leaves the routing at once, finishes every
    request with the translations it gives alone, then stops and frees its weights."""
    async def run():
        pool = await new_pool(checkpoints, 2)
        assert texts_of(await pool.translate_with("m0", job(DE))) == reference["m0"]
        m0 = pool.resident["m0"]
        model_ref = weakref.ref(m0.translator.model)
        held = pool.stream_with("m0", job(DE))
        assert type(await anext(held)).__name__ == "StreamStart"     # in flight until read to its end
        busy = [asyncio.create_task(pool.translate_with("m0", job(DE))) for _ in range(12)]
        await asyncio.sleep(0)                      # every call has counted itself in flight
        assert m0.in_flight == 13
        assert texts_of(await pool.translate_with("m1", job(DE))) == reference["m1"]
        assert texts_of(await pool.translate_with("m2", job(DE))) == reference["m2"]   # evicts m0 (LRU)
        assert "m0" not in pool.resident and pool.draining.get("m0") is m0
        assert m0.state == "draining" and m0.in_flight >= 1 and m0.translator.engine is not None
        answers = await asyncio.gather(*busy)
        assert [texts_of(a) for a in answers] == [reference["m0"]] * 12
        rest = [item async for item in held]
        assert texts_of(rest[-1]) == reference["m0"]
        for _ in range(200):
            if m0.state == "stopped":
                break
            await asyncio.sleep(0.05)
        assert m0.state == "stopped" and "m0" not in pool.draining
        assert model_ref() is None, "the evicted model's weights are still referenced (a cycle or a leak)"
        assert sorted(pool.resident) == ["m1", "m2"]
        await pool.__del__()
    asyncio.run(run())


def test_a_request_for_a_draining_model_takes_it_back_without_a_reload(checkpoints, reference, replica_context):
    async def run():
        pool = await new_pool(checkpoints, 1)
        await pool.translate_with("m0", job(DE))
        m0 = pool.resident["m0"]
        held = pool.stream_with("m0", job(DE))
        await anext(held)                                     # m0 in flight
        assert texts_of(await pool.translate_with("m1", job(DE))) == reference["m1"]   # evicts m0, busy
        assert m0.state == "draining" and pool.draining["m0"] is m0
        again = await pool.translate_with("m0", job(DE))     # evicts m1; m0 comes back from draining
        assert pool.resident.get("m0") is m0 and m0.state == "resident"
        assert texts_of(again) == reference["m0"]
        assert texts_of([item async for item in held][-1]) == reference["m0"]
        assert pool.loads == {"m0": 1, "m1": 1} and pool.evictions == {"m0": 1, "m1": 1}   # no reload of m0
        assert texts_of(await pool.translate_with("m2", job(DE))) == reference["m2"]   # evicts m0 again
        assert pool.evictions["m0"] == 2 and m0.state in ("draining", "stopping", "stopped")
        await asyncio.gather(*list(pool._teardowns.values()))
        assert m0.state == "stopped" and list(pool.resident) == ["m2"]
        await pool.__del__()
    asyncio.run(run())


def test_failed_loads_name_the_model_and_cause_and_the_replica_keeps_serving(checkpoints, reference,
                                                                             replica_context, tmp_path, monkeypatch):
    gone = build_tiny_checkpoint(tmp_path / "gone", "de", "en", seed=5, max_len=64)
    card_gone = model_card("gone", gone)
    oom = model_card("oom", checkpoints["m2"])
    from service.pool import Pool
    real = Pool._construct

    def construct(self, card):
        if card.id == "oom":
            raise MemoryError()
        return real(self, card)
    monkeypatch.setattr(Pool, "_construct", construct)

    async def run():
        pool = await new_pool({"m0": checkpoints["m0"]}, 2, extra=[card_gone, oom])
        assert texts_of(await pool.translate_with("m0", job(DE))) == reference["m0"]
        unknown = await pool.translate_with("nope", job(DE))
        assert unknown.status == 404 and "nope" in unknown.message and unknown.field == "model"
        shutil.rmtree(gone)                                   # the folder vanished after start
        vanished = await pool.translate_with("gone", job(DE))
        assert vanished.status == 503 and "gone" in vanished.message and "FileNotFoundError" in vanished.message
        out = await pool.translate_with("oom", job(DE))
        assert out.status == 503 and "oom" in out.message and "out of memory" in out.message
        streamed = [x async for x in pool.stream_with("oom", job(DE))]
        assert len(streamed) == 1 and streamed[0].status == 503
        # the replica still serves: the resident model, and a model that loads fine
        assert texts_of(await pool.translate_with("m0", job(DE))) == reference["m0"]
        assert sorted(pool.resident) == ["m0"]
        await pool.__del__()
    asyncio.run(run())


def test_a_load_does_not_stall_the_other_models(checkpoints, reference, replica_context, monkeypatch):
    """While m1 loads (held 2 s in its worker thread), m0's requests are answered."""
    from service.pool import Pool
    real, release = Pool._construct, threading.Event()

    def slow(self, card):
        if card.id == "m1":
            release.wait(300)
        return real(self, card)
    monkeypatch.setattr(Pool, "_construct", slow)

    async def run():
        pool = await new_pool(checkpoints, 3)
        await pool.translate_with("m0", job(DE))
        loading = asyncio.create_task(pool.translate_with("m1", job(DE)))
        await asyncio.sleep(0.2)
        t0 = time.perf_counter()
        for _ in range(3):
            assert texts_of(await pool.translate_with("m0", job(DE))) == reference["m0"]
        assert not loading.done(), "m1's load ended before m0's requests: the test proves nothing"
        release.set()
        assert texts_of(await loading) == reference["m1"]
        await pool.__del__()
        return time.perf_counter() - t0
    asyncio.run(run())


def test_memory_budget_evicts_until_the_models_fit(checkpoints, reference, replica_context):
    async def run():
        pool = await new_pool(checkpoints, 3)
        await pool.translate_with("m0", job(DE))
        one = pool.resident["m0"].bytes
        await pool.__del__()
        pool = await new_pool(checkpoints, 3, memory_budget_bytes=int(1.5 * one))
        for m in ("m0", "m1", "m2"):
            assert texts_of(await pool.translate_with(m, job(DE))) == reference[m]
            assert list(pool.resident) == [m], pool.residency()
        await pool.__del__()
    asyncio.run(run())


def test_models_dir_lists_checkpoints_and_marian_folders_named_by_folder(checkpoints, tmp_path):
    from service.app import AppArgs, deployment_options
    from service.pool import discover_models
    root = tmp_path / "models"
    root.mkdir()
    shutil.copytree(checkpoints["m0"], root / "de-en-tiny")
    from tiny_marian import make_marian_dir
    make_marian_dir(root / "opus-mt-tiny")
    (root / "notes").mkdir()                          # not a model: skipped
    assert sorted(discover_models(root)) == ["de-en-tiny", "opus-mt-tiny"]
    args = AppArgs.model_validate({"models": [], "ingress": "separate",
                                   "pool": {"models_dir": str(root), "max_models_per_replica": 2,
                                            "deployment": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2,
                                                                                  "target_ongoing_requests": 8}}}})
    opts = deployment_options(args)
    assert opts["Pool"]["autoscaling_config"]["target_ongoing_requests"] == 8 and "num_replicas" not in opts["Pool"]
    with pytest.raises(ValueError, match="ingress: separate"):
        AppArgs.model_validate({"pool": {"models_dir": str(root)}})
    with pytest.raises(ValueError, match="holds no model"):
        AppArgs.model_validate({"ingress": "separate", "pool": {"models_dir": str(root / "notes")}})
    # a pinned model found in models_dir too: served pinned, not by the pool
    pinned = AppArgs.model_validate({"ingress": "separate", "models": [{"name": "opus-mt-tiny",
                                                                        "checkpoint": str(root / "opus-mt-tiny")}],
                                     "pool": {"models_dir": str(root)}})
    assert [m.name for m in pinned.pool.specs(pinned.pinned())] == ["de-en-tiny"]
    with pytest.raises(ValueError, match="unique names"):     # listed in both: which one is meant?
        AppArgs.model_validate({"ingress": "separate", "models": [{"name": "x", "checkpoint": str(checkpoints["m1"])}],
                                "pool": {"models": [{"name": "x", "checkpoint": str(checkpoints["m2"])}]}})
    # a folder with a config.json that is not a model: the build names it
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text("{}")
    from service.app import build_app
    with pytest.raises(Exception, match="broken"):
        build_app({"models": [], "ingress": "separate", "pool": {"models_dir": str(root)}})


def test_pool_serve_config_validates():
    """deploy/serve_config.pool.yaml: Serve's schema, AppArgs (every key known), a Pool deployment
    that autoscales on its queue next to the pinned de-en."""
    import warnings
    from ray.serve.schema import ServeDeploySchema
    from service.app import AppArgs, deployment_options
    from test_deploy import NESTED, load_yaml, unknown_keys
    raw = load_yaml(Path(__file__).resolve().parents[1] / "deploy" / "serve_config.pool.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = ServeDeploySchema.model_validate(raw)
    assert (AppArgs, "pool") in NESTED and unknown_keys(ServeDeploySchema, raw) == []
    [app] = config.applications
    args = AppArgs.model_validate(app.args)
    opts = deployment_options(args)
    assert list(opts) == ["Gateway", "Translator-de-en", "Pool"]
    assert opts["Pool"]["autoscaling_config"]["max_replicas"] == 2
    assert opts["Pool"]["user_config"]["max_num_seqs"] == 32
    names = [s.name for s in args.pool.specs(args.pinned())]
    assert "en-de" in names and "de-en" not in names     # the pinned model is not in the pool too


# ---- the whole app on Ray Serve ------------------------------------------------------------------
APP, PREFIX = "pool", "/pool"


@pytest.fixture(scope="module")
def pool_app(service_info, checkpoints, tmp_path_factory):
    """The separate layout with a pinned model and a pool of 2 replicas x 2 models over 5 models
    (4 checkpoints listed, 1 MarianMT folder found in models_dir), deployed next to the shared service."""
    from ray import serve
    from service.app import build_app
    from tiny_marian import make_marian_dir
    root = tmp_path_factory.mktemp("pool-app")
    extra = build_tiny_checkpoint(root / "p3", "de", "en", seed=3, max_len=64)
    gone = build_tiny_checkpoint(root / "gone", "de", "en", seed=4, max_len=64)
    make_marian_dir(root / "dir" / "marian")
    pinned = build_tiny_checkpoint(root / "pinned", "de", "en", seed=7, max_len=64)
    ckpts = {"p0": checkpoints["m0"], "p1": checkpoints["m1"], "p2": checkpoints["m2"], "p3": extra}
    args = {"models": [{"name": "pinned", "checkpoint": str(pinned)}], "ingress": "separate", "num_cpus": 0.02,
            "translator": {"num_replicas": 1}, "gateway": {"ray_actor_options": {"num_cpus": 0.02}},
            "engine": ENGINE,
            "pool": {"models": [{"name": n, "checkpoint": str(p)} for n, p in ckpts.items()]
                     + [{"name": "gone", "checkpoint": str(gone)}],
                     "models_dir": str(root / "dir"), "max_models_per_replica": 2,
                     "deployment": {"num_replicas": 2}}}
    serve.run(build_app(args), name=APP, route_prefix=PREFIX, blocking=False)
    url = service_info.url + PREFIX
    wait_until_ready(url, what="the pool app", interval_s=1)
    refs = {}

    async def reference():
        for name, ckpt in {**ckpts, "pinned": pinned, "marian": root / "dir" / "marian"}.items():
            t = Translator(model_card(name, ckpt), device="cpu")
            await t.reconfigure(ENGINE)
            refs[name] = [x.text for x in (await t.translate(job(DE))).translations]
            await t.stop()
    asyncio.run(reference())
    yield types.SimpleNamespace(url=url, refs=refs, gone=gone, metrics_url=service_info.url)
    serve.delete(APP, _blocking=False)
    deadline = time.time() + 300       # a loaded 2-core machine can take more than serve.delete's 60 s
    while APP in serve.status().applications and time.time() < deadline:
        time.sleep(1)


def post_pool(url: str, model: str, **fields) -> httpx.Response:
    return httpx.post(url + "/v1/translate", json={"text": DE, "model": model, "max_new_tokens": 40, **fields},
                      timeout=120)


@pytest.mark.slow
def test_pool_routes_to_the_replica_that_holds_the_model_beside_a_pinned_model(pool_app):
    url, refs = pool_app.url, pool_app.refs
    r = post_pool(url, "p0")
    assert r.status_code == 200, r.text
    assert [t["text"] for t in r.json()["translations"]] == refs["p0"]
    deadline = time.time() + 30
    while True:      # the directory hears of the load within a moment
        models = {m["id"]: m for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]}
        if models["p0"]["loaded_on"]:
            break
        assert time.time() < deadline, models["p0"]
        time.sleep(0.5)
    holder = models["p0"]["loaded_on"]
    assert len(holder) == 1 and models["p0"]["pool"] is True
    assert models["pinned"]["pool"] is False and models["pinned"]["loaded_on"] is None
    assert models["marian"]["pool"] is True                      # found in models_dir, named by its folder
    for _ in range(8):            # Serve routes each to the replica holding p0: no second load anywhere
        r = post_pool(url, "p0")
        assert [t["text"] for t in r.json()["translations"]] == refs["p0"]
        p = post_pool(url, "pinned")
        assert [t["text"] for t in p.json()["translations"]] == refs["pinned"]
    models = {m["id"]: m for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]}
    assert models["p0"]["loaded_on"] == holder
    text = wait_for_metric(pool_app.metrics_url, lambda t: metric_sum(t, "ray_mt_pool_model_loads_total", model="p0") >= 1)
    assert metric_sum(text, "ray_mt_pool_model_loads_total", model="p0", outcome="ok") == 1
    assert metric_sum(text, "ray_mt_pool_models_resident") >= 1
    assert metric_sum(text, "ray_mt_pool_model_load_seconds_count", model="p0") == 1
    assert metric_sum(text, "ray_mt_pool_resident_bytes") > 0


@pytest.mark.slow
def test_pool_eviction_under_load_answers_every_request(pool_app):
    """5 models on 2 replicas x 2: concurrent requests (some streamed) over all of them force
    evictions while others are in flight; every one is answered with its model's translation."""
    url, refs = pool_app.url, pool_app.refs
    names = ["p0", "p1", "p2", "p3", "marian"] * 5

    async def run():
        async with httpx.AsyncClient(timeout=180) as client:
            async def one(i, model):
                body = {"text": DE, "model": model, "max_new_tokens": 40, "stream": i % 4 == 0}
                r = await client.post(url + "/v1/translate", json=body)
                return model, r
            return await asyncio.gather(*(one(i, m) for i, m in enumerate(names)))
    for model, r in asyncio.run(run()):
        assert r.status_code == 200, (model, r.text)
        if r.headers["content-type"].startswith("text/event-stream"):
            final = [d for e, d in sse_events(r.text) if e == "response"][0]
        else:
            final = r.json()
        assert [t["text"] for t in final["translations"]] == refs[model], model
    wait_for_metric(pool_app.metrics_url, lambda t: metric_sum(t, "ray_mt_pool_model_evictions_total") >= 1)


@pytest.mark.slow
def test_pool_load_failures_name_the_model_and_the_replica_stays_healthy(pool_app):
    url, refs = pool_app.url, pool_app.refs
    r = post_pool(url, "nope")
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    shutil.rmtree(pool_app.gone)
    r = post_pool(url, "gone")
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert "gone" in message and "FileNotFoundError" in message and r.headers.get("retry-after")
    for model in ("p1", "pinned"):
        r = post_pool(url, model)
        assert r.status_code == 200 and [t["text"] for t in r.json()["translations"]] == refs[model]
