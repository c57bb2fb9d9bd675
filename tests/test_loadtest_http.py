"""service/loadtest/targets.py HttpTarget (the aiohttp client of the load generator) against a small
aiohttp server started by the test on 127.0.0.1, without Ray: what each kind of answer becomes in
a Reply or an error kind of the run (JSON, Server-Sent Events, 503, a broken body, a dropped
connection, a time-out), the URL it posts to, and that it sends one request per call.
The same target against the real service: tests/test_loadtest.py."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import web

from service.loadtest import HttpTarget, LoadConfig, RequestSpec, run_load
from service.loadtest.generator import _one


SEEN = web.AppKey("seen", list)


def _final(texts: list[str], tokens: int) -> dict:
    return {"model": "de-en", "translations": [{"text": t.upper()} for t in texts],
            "usage": {"source_tokens": 3, "generated_tokens": tokens}}


async def _handler(request: web.Request) -> web.StreamResponse:
    """POST /v1/translate and /prefix/v1/translate; the first text says how to answer."""
    body = await request.json()
    request.app[SEEN].append((request.path, body, request.headers.get("X-Request-ID")))
    texts = body["text"] if isinstance(body["text"], list) else [body["text"]]
    mode = texts[0]
    if mode == "overload":
        return web.json_response({"error": {"message": "busy"}}, status=503, headers={"Retry-After": "1"})
    if mode == "wrong-count":
        return web.json_response(_final(texts[:1] * (len(texts) + 1), 2))
    if mode == "not-json":
        return web.Response(text="<html>oops</html>", content_type="application/json")
    if mode == "hang-up":
        request.transport.close()
        return web.Response()
    if mode == "slow":
        await asyncio.sleep(2)
    if not body.get("stream"):
        return web.json_response(_final(texts, 7))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if mode == "stream-error":
        await resp.write(b'event: error\ndata: {"error": {"message": "failed"}}\n\n')
        return resp
    for tok in ("\u2581Zwei", "\u2581Hunde"):     # token events, then the whole response, then [DONE]
        await resp.write(f"data: {json.dumps({'index': 0, 'token': tok})}\n\n".encode())
    if mode != "no-final":
        await resp.write(f"event: final\ndata: {json.dumps(_final(texts, 2))}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    return resp


@pytest.fixture
def server():
    """(base URL, the list of (path, body, request id) the server saw), on a free loopback port from
    20000-32767 (spare_port: not the OS's ephemeral range, where Ray's processes pick theirs)."""
    from service.ray_env import spare_port
    loop = asyncio.new_event_loop()
    app = web.Application()
    app[SEEN] = []
    app.router.add_post("/v1/translate", _handler)
    app.router.add_post("/prefix/v1/translate", _handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)   # a "slow" answer left sleeping is cancelled, not awaited
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", spare_port())
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    yield loop, f"http://127.0.0.1:{port}", app[SEEN]
    loop.run_until_complete(runner.cleanup())
    loop.close()


def _send(loop, cfg: LoadConfig, specs: list[RequestSpec], timeout: float = 30.0):
    async def go():
        target = HttpTarget(cfg, 4)
        try:
            out = []
            for s in specs:
                t = time.perf_counter()
                out.append(await _one(target, s, timeout, t, t))
            return out
        finally:
            await target.aclose()
    return loop.run_until_complete(go())


def spec(*texts: str, stream: bool = False) -> RequestSpec:
    return RequestSpec(list(texts), beam_size=1, return_attention=False, stream=stream)


def test_json_answers_count_tokens_and_keep_statuses(server):
    loop, url, seen = server
    cfg = LoadConfig(url=url, concurrency=1, requests=1)
    ok, two, busy, wrong, broken = _send(loop, cfg, [spec("Ein Hund."), spec("a", "b"), spec("overload"),
                                                     spec("wrong-count", "x"), spec("not-json")])
    assert (ok.status, ok.error, ok.generated_tokens, ok.texts) == (200, None, 7, 1)
    assert ok.response_bytes == len(json.dumps(_final(["Ein Hund."], 7)).encode())
    assert (two.status, two.error, two.generated_tokens, two.texts) == (200, None, 7, 2)
    assert (busy.status, busy.error, busy.generated_tokens) == (503, "503", 0)
    assert (wrong.status, wrong.error) == (200, "invalid_response")
    assert (broken.status, broken.error) == (None, "invalid_response")     # undecodable JSON
    assert [p for p, _, _ in seen] == ["/v1/translate"] * 5                # one request per call
    assert seen[1][1]["text"] == ["a", "b"] and seen[0][1]["text"] == "Ein Hund."
    ids = [rid for _, _, rid in seen]
    assert len(set(ids)) == 5 and all(rid.startswith("loadtest-") for rid in ids)


def test_server_sent_events_give_time_to_first_token(server):
    loop, url, _ = server
    cfg = LoadConfig(url=url, concurrency=1, requests=1)
    ok, failed, cut = _send(loop, cfg, [spec("Zwei Hunde.", stream=True), spec("stream-error", stream=True),
                                        spec("no-final", stream=True)])
    assert (ok.status, ok.error, ok.generated_tokens) == (200, None, 2)
    assert ok.ttft is not None and 0 <= ok.ttft <= ok.latency and ok.response_bytes > 0
    assert (failed.error, failed.ttft) == ("stream_error", None)
    assert cut.error == "incomplete_stream"


def test_connection_loss_and_time_out_are_error_kinds(server):
    loop, url, _ = server
    cfg = LoadConfig(url=url, concurrency=1, requests=1)
    hung_up, slow = _send(loop, cfg, [spec("hang-up"), spec("slow")], timeout=0.5)
    assert (hung_up.status, hung_up.error) == (None, "connection")
    assert (slow.status, slow.error) == (None, "timeout")
    refused = _send(loop, LoadConfig(url="http://127.0.0.1:9", concurrency=1, requests=1), [spec("x")])[0]
    assert refused.error == "connection"


def test_a_url_with_a_path_is_kept_and_remote_hosts_refused(server):
    loop, url, seen = server
    _send(loop, LoadConfig(url=url + "/prefix/", concurrency=1, requests=1), [spec("Ein Hund.")])
    assert seen[-1][0] == "/prefix/v1/translate"
    with pytest.raises(ValueError, match="not a loopback"):
        HttpTarget(LoadConfig(url="http://192.0.2.1:8000", concurrency=1, requests=1), 1)


def test_closed_loop_through_the_target(server):
    loop, url, seen = server
    cfg = LoadConfig(url=url, concurrency=3, requests=9, seed=2)
    res = loop.run_until_complete(run_load(cfg))
    s = res.summary()
    assert (s["requests"], s["ok"], s["failed"], s["stopped_by"]) == (9, 9, 0, "requests")
    assert s["generated_tokens"] == 7 * 9 and len(seen) == 9
