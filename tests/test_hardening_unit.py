"""Issue 16 without Ray: the open-stream count of the guard, the SSE response that releases it, the
gateway's retry of a call whose translator replica died (fake handles), and the translator's drain."""
from __future__ import annotations

import asyncio
import time

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError
from starlette.requests import ClientDisconnect

from conftest import build_tiny_checkpoint
from service.api.backends import RemoteBackend, replica_lost
from service.api.middleware.guard import Guard, GuardSettings
from service.api.sse import ClosingStreamingResponse
from service.engine import EngineStats, GenerationOptions
from service.protocol import (
    ErrorRecord,
    ServiceError,
    StreamStart,
    StreamToken,
    TranslateJob,
    TranslateResponse,
    Usage,
)
from service.translator import Translator, model_card


class Recorder:
    def __init__(self):
        self.calls = []

    def record(self, key, decision):
        self.calls.append((key, decision))


def test_open_streams_limited_per_client_and_released_once():
    g = Guard(GuardSettings(max_streams_per_key=2), env="")
    g.metrics = Recorder()
    d = g.admit(None, "10.0.0.7")
    r1, r2 = g.open_stream(d.who, d.key), g.open_stream(d.who, d.key)
    with pytest.raises(ServiceError) as e:
        g.open_stream(d.who, d.key)
    assert e.value.status == 429 and e.value.field == "stream" and e.value.type == "too_many_streams"
    assert "at most 2 concurrent streams per client" in e.value.message and e.value.retry_after == 1
    assert ("anonymous", "too_many_streams") in g.metrics.calls          # never the address
    other = g.admit(None, "10.0.0.8")
    g.open_stream(other.who, other.key)                                 # another client: its own count
    r1()
    r1()                                                                # idempotent: one release only
    r3 = g.open_stream(d.who, d.key)
    with pytest.raises(ServiceError):
        g.open_stream(d.who, d.key)
    r2(), r3()
    assert d.who not in g.streams


def test_open_streams_per_key_and_split_over_gateway_replicas():
    g = Guard(GuardSettings(max_streams_per_key=3, gateway_replicas=2), env="k-one,k-two")
    a, b = g.admit("k-one", "c"), g.admit("k-two", "c")
    assert a.who != b.who and "k-one" not in a.who                     # a key id, not the key
    g.open_stream(a.who), g.open_stream(a.who)                          # ceil(3 / 2) = 2 per replica
    with pytest.raises(ServiceError) as e:
        g.open_stream(a.who)
    assert "per key (2 on this gateway replica)" in e.value.message
    g.open_stream(b.who)
    assert Guard(GuardSettings(), env="").open_stream("c:x") is not None   # off: no limit


@pytest.mark.parametrize("client_leaves", [False, True])
def test_sse_response_releases_when_sent_or_when_the_client_leaves(client_leaves):
    released = []

    async def body():
        for i in range(3):
            yield f"event: token\ndata: {i}\n\n"

    async def main():
        resp = ClosingStreamingResponse(body(), lambda: released.append(1), media_type="text/event-stream")
        sent = []

        async def send(message):
            if client_leaves and message["type"] == "http.response.body" and sent:
                raise OSError("client went away")
            sent.append(message)

        async def receive():
            await asyncio.sleep(10)
            return {"type": "http.disconnect"}
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "headers": []}
        if client_leaves:
            with pytest.raises(ClientDisconnect):     # what Starlette makes of the failed send
                await resp(scope, receive, send)
        else:
            await resp(scope, receive, send)
    asyncio.run(main())
    assert released == [1]


# ---- retry on another replica --------------------------------------------------------------------------
RESPONSE = TranslateResponse(model="m", translations=[], usage=Usage(source_tokens=1, generated_tokens=1))


class FakeMethod:
    def __init__(self, outcomes):
        self.outcomes, self.calls = list(outcomes), 0

    def remote(self, job):
        self.calls += 1
        out = self.outcomes.pop(0)

        async def answer():
            if isinstance(out, BaseException):
                raise out
            return out

        async def items():
            for x in out:
                if isinstance(x, BaseException):
                    raise x
                yield x
        return items() if isinstance(out, list) else answer()


class FakeHandle:
    def __init__(self, translate=(), stream=()):
        self.translate, self.stream = FakeMethod(translate), FakeMethod(stream)

    def options(self, stream=False, _by_reference=None):   # the options the gateway sets (ray_env.handle_transport)
        return self


def job(deadline_in: float = 30.0) -> TranslateJob:
    return TranslateJob(["Hallo."], GenerationOptions(), deadline=time.time() + deadline_in, timeout_s=deadline_in)


def died():
    return ActorDiedError()


def test_replica_lost_matches_ray_actor_errors_only():
    assert replica_lost(died()) and replica_lost(ActorUnavailableError("gone", None))
    assert replica_lost(RayTaskError("f", "tb", died(), ActorDiedError))
    assert not replica_lost(ValueError("x")) and not replica_lost(ServiceError(503, "busy"))


def test_translate_retried_once_when_the_replica_died():
    retries = []
    h = FakeHandle(translate=[died(), RESPONSE])
    backend = RemoteBackend({"m": h}, lambda *a: retries.append(a))
    assert asyncio.run(backend.translate("m", job())) == RESPONSE and h.translate.calls == 2
    backend.handles["m"] = h = FakeHandle(translate=[died(), died(), RESPONSE])
    with pytest.raises(ServiceError) as e:                  # once only: then 503
        asyncio.run(backend.translate("m", job()))
    assert e.value.status == 503 and h.translate.calls == 2
    assert retries == [("m", "translate", True), ("m", "translate", False)]


def test_answers_and_passed_deadlines_are_not_retried():
    h = FakeHandle(translate=[ErrorRecord(503, "engine queue is full", None, 1.0, "overloaded"), RESPONSE])
    with pytest.raises(ServiceError):
        asyncio.run(RemoteBackend({"m": h}).translate("m", job()))
    assert h.translate.calls == 1
    h = FakeHandle(translate=[died(), RESPONSE])
    with pytest.raises(ServiceError) as e:   # lost replica, deadline passed: the deadline's answer
        asyncio.run(RemoteBackend({"m": h}).translate("m", job(deadline_in=-1)))
    assert h.translate.calls == 1 and e.value.status == 504 and e.value.field == "timeout_s"


async def collect(items):
    return [x async for x in items]


def test_stream_retried_once_and_resumed_after_the_tokens_already_sent():
    a, b, c = (StreamToken(index=0, text=t, token=t) for t in ("Hello", " dear", " world"))
    d = StreamToken(index=1, text="Hi", token="Hi")
    retries = []
    h = FakeHandle(stream=[[StreamStart(), died()], [StreamStart(), a, RESPONSE]])
    out = asyncio.run(collect(RemoteBackend({"m": h}, lambda *a: retries.append(a)).stream("m", job())))
    assert out == [StreamStart(), a, RESPONSE] and h.stream.calls == 2     # one StreamStart
    # lost after two tokens of text 0 and one of text 1: the retry repeats them, only the rest is passed on
    h = FakeHandle(stream=[[StreamStart(), a, d, b, died()], [StreamStart(), a, d, b, c, RESPONSE]])
    out = asyncio.run(collect(RemoteBackend({"m": h}, lambda *a: retries.append(a)).stream("m", job())))
    assert out == [StreamStart(), a, d, b, c, RESPONSE] and h.stream.calls == 2
    assert retries == [("m", "stream", True), ("m", "stream_resumed", True)]
    # the retry's pieces split differently: the sent part is dropped, the rest cut to its new text
    h = FakeHandle(stream=[[StreamStart(), a, b, died()],
                           [StreamStart(), StreamToken(index=0, text="Hello de"), StreamToken(index=0, text="ar wor"),
                            StreamToken(index=0, text="ld"), RESPONSE]])
    out = asyncio.run(collect(RemoteBackend({"m": h}).stream("m", job())))
    assert "".join(x.text for x in out if isinstance(x, StreamToken)) == "Hello dear world"
    assert out[3] == StreamToken(index=0, text=" wor") and out[-1] == RESPONSE


def test_stream_not_resumed_when_the_retry_differs_or_dies_too():
    a, b = StreamToken(index=0, text="Hello"), StreamToken(index=0, text=" world")
    for retry in ([StreamStart(), StreamToken(index=0, text="Howdy"), b, RESPONSE],   # decoded differently
                  [StreamStart(), a, died()]):                                           # lost again
        h = FakeHandle(stream=[[StreamStart(), a, died()], retry])
        seen, retries = [], []

        async def consume():
            async for x in RemoteBackend({"m": h}, lambda *a: retries.append(a)).stream("m", job()):
                seen.append(x)
        with pytest.raises(ServiceError) as e:
            asyncio.run(consume())
        assert e.value.status == 503 and seen == [StreamStart(), a] and h.stream.calls == 2
        assert retries == [("m", "stream_resumed", False)]
    h = FakeHandle(stream=[[StreamStart(), a, died()], [StreamStart(), a, b, RESPONSE]])
    with pytest.raises(ServiceError):                        # the deadline passed: no retry
        asyncio.run(collect(RemoteBackend({"m": h}).stream("m", job(deadline_in=-1))))
    assert h.stream.calls == 1


# ---- the translator's drain -----------------------------------------------------------------------------
class FakeEngine:
    def __init__(self, running, waiting):
        self.running, self.waiting = running, waiting

    def stats(self) -> EngineStats:
        return EngineStats(running_requests=self.running, running_sequences=self.running,
                           waiting_requests=self.waiting, free_slots=0, num_slots=4, kv_cache_usage=0.0,
                           slot_usage=0.0, steps=0, preemptions=0)


def test_translator_drain_waits_for_running_and_waiting_to_reach_zero(tmp_path):
    t = Translator(model_card("tiny", build_tiny_checkpoint(tmp_path, "de", "en", max_len=64)))
    t.engine = FakeEngine(2, 1)

    async def main():
        async def finish():
            await asyncio.sleep(0.2)
            t.engine.waiting = 0
            await asyncio.sleep(0.2)
            t.engine.running = 0
        task = asyncio.create_task(finish())
        t0 = time.monotonic()
        left = await t.drain(5.0)
        await task
        return left, time.monotonic() - t0
    left, took = asyncio.run(main())
    assert left == 0 and 0.35 < took < 3
    t.engine = FakeEngine(1, 0)
    assert asyncio.run(t.drain(0.2)) == 1        # gives up after its timeout, says how many are left
