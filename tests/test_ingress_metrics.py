"""The ingress replica's document and language-detection counters (``mt_documents_total``,
``mt_language_detections_total``): what each route hands to them, recorded in this process (no Ray;
tests/test_prometheus.py reads them through a real Prometheus)."""
from __future__ import annotations

import asyncio
import time

import pytest
from fastapi.testclient import TestClient

from local_services import local_services, upper_cased
from model.config import ModelConfig
from service.api.http import build_app
from service.pipeline import autodetect
from service.protocol import ServiceError
from service.translator import ModelCard
from service.translator.langid import LanguageDetector

GERMAN = "Ein Mann fährt mit dem Fahrrad die Straße entlang. Zwei Hunde spielen im Schnee."


class Recorder:
    """Stands in for DocumentMetrics / DetectionMetrics: keeps each record call's arguments."""

    def __init__(self):
        self.calls: list[tuple] = []

    def record(self, *args) -> None:
        self.calls.append(args)


def card(name: str = "de-en", source: str = "de", target: str = "en") -> ModelCard:
    return ModelCard(name, "", source, target, ModelConfig.from_name("tiny", vocab_size=500, max_len=64))


@pytest.fixture
def client_and_metrics(tmp_path):
    fail = {"on": False}
    upper = upper_cased([])

    async def run(model, job):
        if fail["on"]:
            raise ServiceError(500, "engine: failed on purpose")
        return await upper(model, job)
    svc = local_services([card()], run, store_dir=str(tmp_path), detector=LanguageDetector(["de", "en"]))
    docs, detections = Recorder(), Recorder()
    svc.doc_metrics = docs
    svc.detector.on_detect = detections.record
    with TestClient(build_app(svc)) as client:
        yield client, docs, detections, fail


def post_doc(client: TestClient, name: str, data: bytes, **fields):
    return client.post("/v1/documents", files={"file": (name, data)}, data={"target_lang": "en", **fields})


def test_documents_are_counted_by_format_and_outcome(client_and_metrics):
    client, docs, _, fail = client_and_metrics
    ok = post_doc(client, "a.txt", b"Ein Hund.\n")
    assert ok.status_code == 200 and ok.content == b"EIN HUND.\n", ok.text
    html = post_doc(client, "a.html", b"<p>Ein Hund.</p>", source_lang="de")
    assert html.status_code == 200 and html.text == "<p>EIN HUND.</p>", html.text
    assert post_doc(client, "a.pdf", b"%PDF-1.4").status_code == 415
    assert post_doc(client, "a.txt", b"").status_code == 422
    assert post_doc(client, "a.txt", b"Ein Hund.", source_lang="fr").status_code == 404     # no fr model
    fail["on"] = True
    assert post_doc(client, "a.md", b"Ein Hund.\n").status_code == 500
    assert docs.calls == [("txt", "ok"), ("html", "ok"), ("other", "refused"), ("txt", "refused"),
                          ("txt", "refused"), ("md", "failed")]


def test_libretranslate_documents_are_counted_too(client_and_metrics):
    client, docs, _, _ = client_and_metrics
    r = client.post("/translate_file", files={"file": ("a.srt", b"1\n00:00:01,000 --> 00:00:02,000\nEin Hund.\n")},
                    data={"source": "de", "target": "en"})
    assert r.status_code == 200 and "translatedFileUrl" in r.json(), r.text
    r = client.post("/translate_file", files={"file": ("a.exe", b"MZ")}, data={"source": "de", "target": "en"})
    assert r.status_code == 415 and ".exe is not a supported format" in r.json()["error"], r.text
    assert docs.calls == [("srt", "ok"), ("other", "refused")]


def test_each_detected_text_is_counted_once_with_its_best_language(client_and_metrics):
    client, _, detections, _ = client_and_metrics
    r = client.post("/v1/translate", json={"text": [GERMAN, "12345"], "source_lang": "auto"})
    assert r.status_code == 200, r.text
    assert [t["text"] for t in r.json()["translations"]] == [GERMAN.upper(), "12345"]
    r = client.post("/detect", json={"q": "Two dogs play in the snow and a man rides his bicycle."})
    assert r.status_code == 200 and r.json()[0]["language"] == "en", r.text
    r = post_doc(client, "a.txt", GERMAN.encode(), source_lang="auto")
    assert r.status_code == 200, r.text
    assert detections.calls == [("de", True), ("und", False), ("en", True), ("de", True)]


def test_a_text_read_with_its_context_is_counted_once():
    detector, seen = LanguageDetector(["de", "en"]), Recorder()
    detector.on_detect = seen.record
    found, read = asyncio.run(autodetect.detect_in_context(detector, ["Gift", "12345"], GERMAN, top=0))
    assert read == [True, False] and found[0][0][0] == "de"
    assert seen.calls == [("de", found[0][0][1] >= autodetect.UNSURE), ("und", False)]


def test_a_deepl_job_cancelled_by_its_owner_is_counted_cancelled(tmp_path):
    from service.api import deepl_documents
    gate = asyncio.Event()
    upper = upper_cased([])

    async def held(model, job):
        for _ in range(3000):          # at most 30 s
            if gate.is_set():
                break
            await asyncio.sleep(0.01)
        return await upper(model, job)
    svc = local_services([card()], held, store_dir=str(tmp_path))
    svc.doc_metrics = docs = Recorder()
    with TestClient(build_app(svc)) as client:
        def upload():
            r = client.post("/v2/document", files={"file": ("a.txt", b"Ein Hund.\n")},
                            data={"target_lang": "EN-GB", "source_lang": "DE"})
            assert r.status_code == 200, r.text
            return r.json()
        first = upload()
        r = client.request("DELETE", f"/v2/document/{first['document_id']}", json={"document_key": first["document_key"]})
        assert r.status_code == 204, r.text
        client.portal.call(gate.set)
        second = upload()
        for _ in range(400):
            if not deepl_documents._jobs.running and len(docs.calls) == 2:
                break
            time.sleep(0.05)
    assert sorted(docs.calls) == [("txt", "cancelled"), ("txt", "ok")], docs.calls
    assert second["document_id"] != first["document_id"]
