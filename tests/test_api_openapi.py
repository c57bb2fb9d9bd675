"""The OpenAPI document tells the truth: property-based fuzzing (schemathesis) from GET /openapi.json
against the running service, with every default check of schemathesis (server errors, status codes,
content types, response headers and schemas, positive and negative data, unsupported methods and
their Allow header, ...); plus the declarations themselves."""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig

MAX_EXAMPLES = 12     # per operation and phase: the whole fuzz run stays well under a minute

# positive_data_acceptance: a request valid by the schema may still be refused, for limits a JSON
# schema cannot state (documented in docs/api.md#errors):
#   413  sentences per request and tokens per sentence (known after splitting and tokenizing), and
#        the 5,000 characters per text / 64 texts (413, not 422: a size, not a type)
#   422  n_best <= beam_size, beam_size <= the engine's max_num_seqs, attention layer/head indices
#        below the model's, max_new_tokens below its max_len: they depend on each other or the model
#   400  LibreTranslate's texts over the limits above (LibreTranslate answers them with 400)
POSITIVE_ALSO = ["400", "413", "422"]


pytestmark = pytest.mark.slow      # every test runs against the shared Ray Serve app (service_url)


def load_schema() -> schemathesis.schemas.BaseSchema:
    """The service's OpenAPI document (the gateway's FastAPI app; test_openapi_json_is_that_document
    checks the running service serves the same), with the checks' configuration."""
    from service.api.gateway import api
    config = SchemathesisConfig.from_dict({
        "checks": {"positive_data_acceptance": {"expected-statuses": [
            "2xx", "3xx", "401", "403", "404", "409", "429", "5xx", *POSITIVE_ALSO]}},
        "generation": {"max-examples": MAX_EXAMPLES},
    })
    return schemathesis.openapi.from_dict(api.openapi(), config=config)


# Loaded at import (schemathesis 4.32's lazy fixture loader fails under pytest 9: Node._nodeid is gone).
schema = load_schema()


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
def test_api_conforms_to_its_openapi_document(case, service_url):
    positive = case.meta is not None and case.meta.generation.mode.is_positive
    if case.operation.path == "/v1/translate" and isinstance(case.body, dict):
        # Keep generated work small (the fuzz run has a time budget, not a load test): short answers.
        case.body.setdefault("max_new_tokens", 8)
    if case.operation.path == "/translate" and positive and isinstance(case.body, dict):
        # The served pairs are the deployment's (GET /languages), not the schema's: valid cases use one
        # so that they reach translation (a random code is a documented 400).
        case.body.update(source="de", target="en")
    case.call_and_validate(base_url=service_url, timeout=60)


def test_openapi_json_is_that_document(service_url):
    from service.api.gateway import api
    assert httpx.get(service_url + "/openapi.json", timeout=30).json() == api.openapi()


def test_declared_statuses_and_content(service_url):
    doc = httpx.get(service_url + "/openapi.json", timeout=30).json()
    native = doc["paths"]["/v1/translate"]["post"]["responses"]
    assert {"200", "404", "413", "415", "422", "503"} <= set(native)
    assert set(native["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "Retry-After" in native["503"]["headers"]
    libre = doc["paths"]["/translate"]["post"]
    assert set(libre["requestBody"]["content"]) == {"application/json", "application/x-www-form-urlencoded",
                                                     "multipart/form-data"}
    assert {"200", "400", "413", "415", "503"} <= set(libre["responses"])
    assert "422" not in libre["responses"]      # LibreTranslate answers invalid input with 400


def test_405_carries_allow(service_url):
    for method, path, allow in (("GET", "/v1/translate", "POST"), ("DELETE", "/translate", "POST"),
                                ("POST", "/healthz", "GET, HEAD")):
        r = httpx.request(method, service_url + path, timeout=30)
        assert r.status_code == 405 and r.headers["allow"] == allow, (path, r.status_code, r.headers)


def test_head_answers_every_get_route_like_get_without_a_body(service_url):
    """Load balancers probe with HEAD: the status and headers of GET, no body (body.HeadMiddleware)."""
    from service.api.gateway import api
    paths = [p for p, ops in api.openapi()["paths"].items()
             if "get" in ops and "{" not in p] + ["/docs", "/openapi.json"]    # templated paths: no fixed 200
    assert {"/healthz", "/readyz", "/metrics", "/v1/models", "/languages"} <= set(paths)
    for path in paths:
        get, head = (httpx.request(m, service_url + path, timeout=30) for m in ("GET", "HEAD"))
        assert head.status_code == get.status_code == 200 and head.content == b"", (path, head.status_code)
        assert head.headers["content-type"] == get.headers["content-type"], path
        if path not in ("/metrics", "/readyz", "/v1/models"):    # their bodies change between two calls
            assert head.headers["content-length"] == get.headers["content-length"], path
