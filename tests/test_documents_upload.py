"""What an upload names and what a download hands over: RFC 5987's ``filename*`` (alone or beside
``filename``), a part whose headers pass the parser's limit, DeepL's result downloaded once, and the
file name readable by a page on another origin."""
from __future__ import annotations

import time

import pytest
from test_documents import keyed_client

A = {"Authorization": "Bearer key-a"}


def multipart(disposition: bytes, content: bytes = "Ein Hund.\n".encode(), target: bytes = b"en") -> bytes:
    return (b'--b\r\nContent-Disposition: form-data; name="file"; ' + disposition + b'\r\n'
            b'Content-Type: application/octet-stream\r\n\r\n' + content +
            b'\r\n--b\r\nContent-Disposition: form-data; name="source_lang"\r\n\r\nde'
            b'\r\n--b\r\nContent-Disposition: form-data; name="target_lang"\r\n\r\n' + target + b'\r\n--b--\r\n')


@pytest.mark.parametrize("disposition, named", [
    (b"filename*=UTF-8''Br%C3%BCcke%20%22neu%22.txt", 'Brücke "neu".txt'),
    (b"filename*=iso-8859-1'de'Stra%DFe.txt", "Straße.txt"),
    (b'filename="fallback.txt"; filename*=UTF-8\'\'%C3%A4rger.md', "ärger.md"),     # RFC 6266: filename* wins
    (b"FILENAME*=utf-8''plain.txt", "plain.txt")])
def test_a_file_named_by_filename_star_is_a_file_with_that_name(tmp_path, disposition, named):
    client = keyed_client(tmp_path)
    r = client.post("/v1/documents", content=multipart(disposition),
                    headers={**A, "Content-Type": "multipart/form-data; boundary=b"})
    assert r.status_code == 200, r.text
    assert r.content == "EIN HUND.\n".encode()       # .md too: one paragraph
    from urllib.parse import quote
    assert r.headers["content-disposition"].endswith("filename*=UTF-8''" + quote(named))


def test_a_part_whose_headers_are_too_long_is_a_400_naming_it_and_the_length(tmp_path):
    client = keyed_client(tmp_path)
    body = multipart(b'filename="' + b"a" * 5000 + b'.txt"')
    for path, read in (("/v1/documents", lambda j: j["error"]["message"]), ("/v2/document", lambda j: j["message"]),
                       ("/translate_file", lambda j: j["error"])):
        r = client.post(path, content=body, headers={**A, "Content-Type": "multipart/form-data; boundary=b"})
        assert r.status_code == 400 and "a file name of 5004 characters" in read(r.json()), (path, r.text)
        assert "4096" in read(r.json())


def test_a_deepl_result_is_handed_over_once(tmp_path):
    with keyed_client(tmp_path) as client:      # one event loop for the requests and the background job
        result_once(client)


def result_once(client) -> None:
    r = client.post("/v2/document", files={"file": ("a.txt", "Ein Hund.\n".encode())},
                    data={"target_lang": "EN", "source_lang": "DE"}, headers=A)
    job, key = r.json()["document_id"], r.json()["document_key"]
    deadline = time.monotonic() + 30
    while client.post(f"/v2/document/{job}", data={"document_key": key}, headers=A).json()["status"] != "done":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    first = client.post(f"/v2/document/{job}/result", data={"document_key": key}, headers=A)
    assert first.status_code == 200 and first.content == "EIN HUND.\n".encode()
    again = client.post(f"/v2/document/{job}/result", data={"document_key": key}, headers=A)
    assert again.status_code == 404 and "already downloaded" in again.json()["message"]
    assert client.post(f"/v2/document/{job}", data={"document_key": key}, headers=A).status_code == 404


def test_a_page_on_another_origin_can_read_the_downloads_file_name(tmp_path):
    client = keyed_client(tmp_path)
    r = client.post("/v1/documents", files={"file": ("brief.txt", "Ein Hund.\n".encode())},
                    data={"source_lang": "de", "target_lang": "en"}, headers={**A, "Origin": "https://editor.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    exposed = {h.strip().lower() for h in r.headers["access-control-expose-headers"].split(",")}
    assert "content-disposition" in exposed and 'filename="brief.txt"' in r.headers["content-disposition"]


def test_a_file_name_over_the_limit_is_a_400_naming_the_field_and_the_download_header_stays_small(tmp_path):
    from service.api.documents import file_response
    from service.protocol import MAX_FILENAME_CHARS
    client = keyed_client(tmp_path)
    long = "z" * (MAX_FILENAME_CHARS + 1) + ".txt"
    r = client.post("/v1/documents", files={"file": ("a.txt", "Ein Hund.\n".encode())},
                    data={"source_lang": "de", "target_lang": "en", "filename": long}, headers=A)
    assert r.status_code == 400 and r.json()["error"]["field"] == "filename", r.text
    assert f"at most {MAX_FILENAME_CHARS} characters, got {len(long)}" in r.json()["error"]["message"]
    r = client.post("/v2/document", files={"file": (long, "Ein Hund.\n".encode())}, data={"target_lang": "EN"},
                    headers=A)
    assert r.status_code == 400 and "file:" in r.json()["message"], r.text
    ok = "😀" * MAX_FILENAME_CHARS
    r = client.post("/v1/documents", files={"file": ("a.txt", "Ein Hund.\n".encode())},
                    data={"source_lang": "de", "target_lang": "en", "filename": ok[:-4] + ".txt"}, headers=A)
    assert r.status_code == 200 and len(r.headers["content-disposition"]) < 4096, r.text
    header = file_response(b"x", "%" * 5000 + ".txt", "text/plain").headers["content-disposition"]
    assert len(header) < 4096 and header.endswith(".txt")      # a stored long name: cut, its extension kept


@pytest.mark.parametrize("encoding, named", [("utf-16", "UTF-16"), ("utf-16-be", "UTF-16"), ("utf-32", "UTF-32")])
def test_a_text_file_in_utf16_or_utf32_is_a_422_naming_its_encoding_not_binary(encoding, named):
    from service.documents import load
    from service.documents.common import DocumentError
    data = ("\ufeff" if encoding == "utf-16-be" else "").encode(encoding) + "Ein Hund.\n".encode(encoding)
    with pytest.raises(DocumentError) as e:
        load(data, "brief.txt")
    assert e.value.status == 422 and f"the text is {named}" in e.value.message and "UTF-8" in e.value.message
