"""The attention explorer without a browser: its files, the <base href> under a route prefix, and
``protect_explorer`` (API key by header or the page's cookie; the key form as the 401 answer).
The page itself is driven in a real browser by tests/test_explorer.py."""
from __future__ import annotations

import re
from urllib.parse import quote

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from service.api import explorer
from service.api.errors import add_exception_handlers
from service.api.middleware.guard import Guard, GuardMiddleware, GuardSettings
from service.app import AppArgs, guard_settings

KEY = "s3cret;key=1"     # characters a cookie value must escape


def make_client(guard: Guard) -> TestClient:
    app = FastAPI()
    app.add_middleware(GuardMiddleware, get_guard=lambda: guard)
    add_exception_handlers(app)

    @app.get("/")
    async def root(request: Request):
        return explorer.page(request)

    @app.get("/explorer/{name}")
    async def files(name: str):
        return explorer.static_file(name)

    @app.post("/v1/translate")
    async def translate():
        return {"ok": True}
    return TestClient(app)


def test_page_and_its_files_are_served_and_reference_only_local_files():
    c = make_client(Guard(GuardSettings(), env=""))
    page = c.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<base href="/">' in page.text
    refs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert "explorer/explorer.js" in refs and "explorer/explorer.css" in refs
    assert not [r for r in refs if r.startswith(("http:", "https:", "//"))], refs     # no CDN
    for name, media in explorer.STATIC_FILES.items():
        r = c.get(f"/explorer/{name}")
        assert r.status_code == 200 and r.headers["content-type"] == media
        assert r.text == (explorer.STATIC / name).read_text(encoding="utf-8")
        urls = set(re.findall(r"https?://[^\s\"')]+", r.text))
        assert urls <= {"http://www.w3.org/2000/svg"}, urls    # only the SVG namespace name, never fetched
    r = c.get("/explorer/missing.js")
    assert r.status_code == 404 and r.json()["error"]["field"] == "path" and "explorer.js" in r.json()["error"]["message"]
    assert c.get("/explorer/..%2Fexplorer.py").status_code == 404
    assert c.get("/explorer/key.html").status_code == 404


def test_the_script_calls_the_api_by_relative_urls():
    js = (explorer.STATIC / "explorer.js").read_text(encoding="utf-8")
    assert 'call("v1/translate"' in js and 'call("v1/models"' in js
    assert "return_attention: true" in js
    for kind in ("cross", "encoder", "decoder"):
        assert f"{kind}: {{rows:" in js


def test_base_href_follows_the_route_prefix():
    app = FastAPI()

    @app.get("/")
    async def root(request: Request):
        return explorer.page(request)
    assert '<base href="/mt/">' in TestClient(app, root_path="/mt").get("/").text


def test_explorer_is_open_and_unlimited_unless_protected():
    g = Guard(GuardSettings(), env=KEY)
    assert not g.needs_key("/") and not g.needs_key("/explorer/explorer.js")
    assert not g.limited("/") and not g.limited("/explorer/explorer.css")
    c = make_client(g)
    assert c.get("/").status_code == 200
    assert c.post("/v1/translate").status_code == 401       # the API itself stays keyed
    assert c.post("/v1/translate", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_protect_explorer_needs_a_key_by_header_or_cookie_and_answers_a_key_form():
    g = Guard(GuardSettings(protect_explorer=True), env=KEY)
    assert g.needs_key("/") and g.needs_key("/explorer/explorer.js") and not g.needs_key("/docs")
    c = make_client(g)
    r = c.get("/")
    assert r.status_code == 401 and r.headers["content-type"].startswith("text/html")
    assert r.headers["www-authenticate"] == "Bearer"
    assert 'id="api-key"' in r.text and "no API key" in r.text and "{message}" not in r.text
    assert c.get("/explorer/explorer.js").status_code == 401
    assert c.get("/", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    c.cookies.set(explorer.KEY_COOKIE, quote(KEY, safe=""))
    assert c.get("/").status_code == 200 and c.get("/explorer/explorer.css").status_code == 200
    assert c.post("/v1/translate").status_code == 401       # the cookie opens the page's files only
    c.cookies.set(explorer.KEY_COOKIE, "wrong")
    r = c.get("/")
    assert r.status_code == 401 and "not valid" in r.text
    # keys off: protect_explorer changes nothing
    assert make_client(Guard(GuardSettings(protect_explorer=True), env="")).get("/").status_code == 200


@pytest.mark.parametrize("header, key", [("a=1; mt_api_key=abc%3Bd; b=2", "abc;d"), ("mt_api_key=", None),
                                         ("other=1", None), ("", None)])
def test_cookie_key(header, key):
    assert explorer.cookie_key({"cookie": header}) == key


def test_app_args_pass_protect_explorer_to_the_guard():
    assert guard_settings(AppArgs(protect_explorer=True), {}).protect_explorer is True
    assert guard_settings(AppArgs(), {}).protect_explorer is False


@pytest.mark.parametrize("root_path", ["", "/mt"])
def test_docs_pages_load_every_file_from_this_app(root_path):
    """/docs and /redoc reference only this app's files (an air-gapped machine has no CDN), under
    the proxy's prefix, and each of them is served; a path out of the assets folder is not."""
    from service.api.docs_pages import add_docs_pages
    app = FastAPI(docs_url=None, redoc_url=None, root_path=root_path)
    add_docs_pages(app)
    c = TestClient(app)
    for page, needed in (("/docs", {"swagger-ui-bundle.js", "swagger-ui.css"}), ("/redoc", {"redoc.standalone.js"})):
        r = c.get(page)
        urls = re.findall(r'(?:src|href)="([^"]+)"|url: ?\'([^\']+)\'', r.text)
        urls = [a or b for a, b in urls]
        assert r.status_code == 200 and urls and all(u.startswith(root_path + "/") for u in urls), urls
        assert needed <= {u.rsplit("/", 1)[-1] for u in urls}
        for u in urls:
            got = c.get(u)             # as a browser asks: the path with the prefix
            assert got.status_code == 200 and len(got.content) > (50 if u.endswith(".json") else 1000), u
    assert c.get("/docs/assets/../../pyproject.toml").status_code == 404


def test_docs_files_are_open_like_the_docs_and_keyed_with_protect_docs():
    g, keyed = Guard(GuardSettings(), env=KEY), Guard(GuardSettings(protect_docs=True), env=KEY)
    for path in ("/docs", "/redoc", "/docs/assets/swagger-ui-bundle.js"):
        assert not g.needs_key(path) and not g.limited(path) and keyed.needs_key(path)
