"""service.bench.stages: py-spy raw stacks folded into the request path's stages (the
``python -m service.bench.request_path`` profile)."""
from __future__ import annotations

import pytest

from service.bench.stages import (
    ENCODING,
    EVENT_LOOP,
    NATIVE,
    OTHER,
    PARSING,
    ROOT,
    WAITING,
    fold,
    fold_threads,
    module_path,
    stack_stage,
    weigh,
)

SITE = "/opt/venv/lib/python3.11/site-packages"
STD = "/usr/lib/python3.11"


def stack(*frames: str, count: int = 1) -> str:
    return ";".join(frames) + f" {count}"


LOOP = f"_run_once ({STD}/asyncio/base_events.py:1900)"
UVICORN = f"run_asgi ({SITE}/uvicorn/protocols/http/httptools_impl.py:401)"


def test_module_paths_of_the_project_site_packages_and_stdlib():
    assert module_path(f"{ROOT}/service/api/gateway.py") == "service/api/gateway.py"
    assert module_path(f"{SITE}/h11/_connection.py") == "h11/_connection.py"
    assert module_path(f"{STD}/json/encoder.py") == "json/encoder.py"
    assert module_path("/elsewhere/wt/service/pipeline/pipeline.py") == "service/pipeline/pipeline.py"


def test_the_frame_nearest_the_leaf_that_names_a_stage_wins():
    lines = [
        # re called by the splitter, under the pipeline: splitting
        stack(LOOP, UVICORN, "run (/r/service/pipeline/pipeline.py:10)",
              f"split ({ROOT}/service/translator/text.py:40)", f"sub ({STD}/re/__init__.py:185)", count=7),
        # asyncio called by the pipeline: the pipeline's
        stack(LOOP, f"run ({ROOT}/service/pipeline/pipeline.py:10)", f"gather ({STD}/asyncio/tasks.py:700)", count=3),
        # pydantic under FastAPI's serialize_response: encoding, not validation
        stack(LOOP, UVICORN, f"serialize_response ({SITE}/fastapi/routing.py:155)",
              f"to_json ({SITE}/pydantic/main.py:300)", count=2),
        # pydantic validating the body
        stack(LOOP, UVICORN, f"solve_dependencies ({SITE}/fastapi/dependencies/utils.py:500)",
              f"validate ({SITE}/pydantic/main.py:200)", count=5),
        # the engine's worker thread
        stack(f"_bootstrap ({STD}/threading.py:1000)", f"step ({ROOT}/service/engine/runner.py:80)",
              f"forward ({ROOT}/model/transformer.py:50)", count=11),
        # the event loop alone
        stack(f"run_forever ({STD}/asyncio/base_events.py:600)", LOOP, count=4),
        stack("<module> (<string>:1)", count=1),
        stack(LOOP, UVICORN, f"dispatch ({ROOT}/service/api/middleware/access_log.py:100)",
              f"info ({STD}/logging/__init__.py:1500)", count=6),
        "not a stack line",
    ]
    got = fold(lines)
    assert got == {"text: sentence splitting": 7, "pipeline (service/pipeline)": 3, ENCODING: 2, PARSING: 5,
                   "engine: model step": 11, EVENT_LOOP: 4, OTHER: 1, "logging": 6}


def test_json_loads_is_parsing_and_dumps_is_encoding():
    assert stack_stage([("loads", "json/__init__.py")]) == PARSING
    assert stack_stage([("dumps", "json/__init__.py")]) == ENCODING
    assert stack_stage([("dispatch", "service/api/middleware/cors.py")]) == "middleware"
    assert stack_stage([("receive", "service/api/middleware/body.py")]) == PARSING
    # --native: a C wait at the leaf is a wait, C work under a Python frame is that frame's
    assert stack_stage([("run", "service/pipeline/pipeline.py"), ("epoll_wait", "libc.so.6")]) == WAITING
    assert stack_stage([("run", "service/pipeline/pipeline.py"), ("PyDict_GetItem", "libpython3.11.so")]) \
        == "pipeline (service/pipeline)"


def test_each_threads_cpu_time_is_shared_among_the_stages_of_its_samples():
    lines = [
        f"thread (101): asyncio_0;{LOOP};split ({ROOT}/service/translator/text.py:40) 3",
        f"thread (101): asyncio_0;{LOOP};{UVICORN} 1",
        # a thread parked in C that py-spy counted as active: its /proc time bounds it
        f"thread (102): main;Worker.main_loop ({SITE}/ray/_private/worker.py:900) 50",
        f"thread (103): engine-runner_0;step ({ROOT}/service/engine/runner.py:80) 10",
        # a runnable thread seen at its pool's queue: none of its CPU time
        f"thread (103): engine-runner_0;_worker ({STD}/concurrent/futures/thread.py:81) 30",
    ]
    samples = fold_threads(lines)
    assert samples[101] == {"text: sentence splitting": 3, "ASGI server (uvicorn, h11, httptools)": 1}
    got = weigh(samples, {101: 0.4, 102: 0.01, 103: 1.0, 104: 0.2})   # 104: never sampled (a C++ thread)
    assert got == pytest.approx({"text: sentence splitting": 0.3, "ASGI server (uvicorn, h11, httptools)": 0.1,
                   EVENT_LOOP: 0.01, "engine: model step": 1.0, NATIVE: 0.2})
    assert samples[102] == {WAITING: 50}


def test_request_path_report_gives_shares_ratios_and_added_p50(capsys):
    from service.bench.request_path import main, report, stage_table

    prof = {"stage_cpu_ms_per_request": {"engine: model step": 3.0, PARSING: 1.0}, "native_threads_ms": {"worker.io": 0.1},
            "samples": 100, "rate_hz": 200, "summary": {"ok": 50, "requests_per_s": 40.0, "latency_s": {"p50": 0.031}},
            "cpu_ms_per_request": {"replica Gateway": 4.0, "haproxy": 0.2, "total": 4.2},
            "access_latency_ms_p50": 28.0, "access_lines": 50}
    assert stage_table(prof) == [("engine: model step", 0.75, 3.0), (PARSING, 0.25, 1.0)]
    http = {"requests_per_s": 45.0, "latency_s": {"p50": 0.030}}
    eng = {"requests_per_s": 50.0, "latency_s": {"p50": 0.020}, "cpu_ms_per_request": 2.1}
    text = report({"clients": {1: {"profiled": prof, "http": http, "engine": eng}}})
    assert "| engine: model step | 75.0% | 3.000 |" in text
    assert "ratio HTTP/engine **0.90**, added p50 **+10.00 ms**" in text
    assert "engine alone 2.100 (ratio 2.00)" in text
    assert "replica latency_ms p50 28.00 against the client's p50 31.00 ms" in text
    with pytest.raises(SystemExit):
        main(["--clients", "one"])
    assert "comma-separated integers" in capsys.readouterr().err
