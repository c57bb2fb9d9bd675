"""service/loadtest/targets.py: the engine alone as a load target (EngineTarget), on a tiny random
checkpoint, through the same closed and open loops as the HTTP service (no Ray)."""
from __future__ import annotations

import asyncio

import pytest

from conftest import DATA, build_tiny_checkpoint
from service.loadtest import EngineTarget, LoadConfig, RequestSpec, run_load


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "de", "en")


def test_engine_target_closed_and_open_loop(checkpoint):
    sentences = str(DATA / "test_2016_flickr.de.gz")
    cfg = LoadConfig(concurrency=2, requests=4, sentences=sentences, texts="1:1,2:1", beam_size="1:1,2:1",
                     max_new_tokens=6, seed=1)
    res = asyncio.run(run_load(cfg, EngineTarget(cfg, checkpoint, {"max_num_seqs": 8}, threads=1)))
    s = res.summary()
    assert (s["requests"], s["ok"], s["failed"], s["stopped_by"]) == (4, 4, 0, "requests")
    assert 0 < s["generated_tokens"] <= 6 * s["texts"] and s["ttft_s"] is None
    stream = LoadConfig(rate=50.0, requests=3, sentences=sentences, beam_size="1", max_new_tokens=6, stream=True)
    res = asyncio.run(run_load(stream, EngineTarget(stream, checkpoint, {}, threads=1)))
    assert res.summary()["ok"] == 3 and all(0 < o.ttft <= o.latency for o in res.outcomes)


def test_engine_target_maps_engine_errors_like_the_service(checkpoint):
    cfg = LoadConfig(concurrency=1, requests=1, max_new_tokens=4)

    async def send(spec: RequestSpec):
        target = EngineTarget(cfg, checkpoint, {"max_num_seqs": 2}, threads=1)
        try:
            return await target.send(spec)
        finally:
            await target.aclose()
    # beam 4 needs 4 slots of the 2 the engine has: refused by the engine's own guard (422).
    reply = asyncio.run(send(RequestSpec(["Ein Hund."], beam_size=4, return_attention=False, stream=False)))
    assert (reply.status, reply.error) == (422, "422")
