"""Issue #20 through the running service (the ``service`` fixture): a text the sentence splitter
fails on is translated (and counted), texts and lines without letters come back verbatim in JSON
and SSE, gzip/deflate bodies are decoded on both routes, and body problems are 413/415."""
from __future__ import annotations

import gzip
import json
import zlib

import httpx
import pytest

from conftest import metric_sum, scrape, sse_events, wait_for_metric
from service.api.middleware.body import MAX_BODY_BYTES

BREAKS_PYSBD = "Sie hat einen B.A. in Sport. Dazu eine Trainer B(asic) Lizenz."


pytestmark = pytest.mark.slow      # every test runs against the shared Ray Serve app (service_url)


def test_splitter_failure_is_translated_and_counted(service_url):
    def fallbacks(text: str) -> float:
        return metric_sum(text, "ray_mt_sentence_split_fallbacks_total", model="de-en", reason="error")
    before = fallbacks(scrape(service_url))
    r = httpx.post(service_url + "/v1/translate", json={"text": BREAKS_PYSBD, "beam_size": 1}, timeout=120)
    assert r.status_code == 200, r.text        # was a 500: pysbd raises re.error on this text
    tr = r.json()["translations"][0]
    assert tr["source_tokens"].count("</s>") == 2        # cut into its two sentences by the fallback
    assert tr["text"] and tr["finish_reason"] in ("eos", "length")
    assert fallbacks(wait_for_metric(service_url, lambda text: fallbacks(text) >= before + 1)) >= before + 1


def test_no_letter_texts_and_lines_pass_through(service_url):
    texts = ["1.", "12345", "-", "...", "€ 5,00 – 3 %", "Ein Hund rennt.\n2.\nZwei Katzen schlafen.",
             "Ein Hund rennt."]
    r = httpx.post(service_url + "/v1/translate", json={"text": texts, "beam_size": 1}, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()["translations"]
    for text, tr in zip(texts[:5], out[:5]):
        assert (tr["text"], tr["tokens"], tr["source_tokens"], tr["score"], tr["finish_reason"]) == \
            (text, [], [], 0.0, "eos")
    assert out[5]["text"].startswith(out[6]["text"] + "\n2.\n")
    assert out[5]["source_tokens"].count("</s>") == 2
    # streamed: the concatenated deltas of each index are its final text
    r = httpx.post(service_url + "/v1/translate", json={"text": texts, "beam_size": 1, "stream": True}, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    final = [t["text"] for t in events[-1][1]["translations"]]
    got: dict[int, str] = {}
    for name, data in events[:-1]:
        assert name == "token"
        got[data["index"]] = got.get(data["index"], "") + data["text"]
    assert [got.get(i, "") for i in range(len(texts))] == final
    assert final[:5] == texts[:5]


def test_compressed_bodies_on_both_routes(service_url):
    body = json.dumps({"text": "Ein Hund rennt.", "beam_size": 1}).encode()
    plain = httpx.post(service_url + "/v1/translate", content=body, headers={"Content-Type": "application/json"},
                       timeout=120)
    assert plain.status_code == 200
    for coding, encode in (("gzip", gzip.compress), ("deflate", zlib.compress)):
        r = httpx.post(service_url + "/v1/translate", content=encode(body), timeout=120,
                       headers={"Content-Type": "application/json", "Content-Encoding": coding})
        assert r.status_code == 200, r.text
        assert r.json()["translations"] == plain.json()["translations"]
        form = encode("q=Ein Hund rennt.&source=de&target=en".encode())
        r = httpx.post(service_url + "/translate", content=form, timeout=120,
                       headers={"Content-Type": "application/x-www-form-urlencoded", "Content-Encoding": coding})
        assert r.status_code == 200 and r.json()["translatedText"], r.text


def test_body_limits_and_refusals(service_url):
    bomb = gzip.compress(b" " * (MAX_BODY_BYTES + 1))
    r = httpx.post(service_url + "/v1/translate", content=bomb, timeout=60,
                   headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert r.status_code == 413 and str(MAX_BODY_BYTES) in r.json()["error"]["message"]
    r = httpx.post(service_url + "/translate", content=bomb, timeout=60,
                   headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert r.status_code == 413 and str(MAX_BODY_BYTES) in r.json()["error"]
    r = httpx.post(service_url + "/v1/translate", content=b"{}", timeout=60,
                   headers={"Content-Type": "application/json", "Content-Encoding": "br"})
    assert r.status_code == 415 and "gzip, deflate, identity" in r.json()["error"]["message"]
    r = httpx.post(service_url + "/v1/translate", content=b"text=x", timeout=60,
                   headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    body = json.dumps({"text": "Grüße aus München.", "beam_size": 1}, ensure_ascii=False)
    a = httpx.post(service_url + "/v1/translate", content=body.encode("latin-1"), timeout=120,
                   headers={"Content-Type": "application/json; charset=latin-1"})
    b = httpx.post(service_url + "/v1/translate", content=body.encode("utf-8"), timeout=120,
                   headers={"Content-Type": "application/json"})
    assert a.status_code == b.status_code == 200
    assert a.json()["translations"][0]["source_tokens"] == b.json()["translations"][0]["source_tokens"]
