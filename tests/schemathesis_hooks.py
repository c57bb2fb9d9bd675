"""Schemathesis hooks for tests/test_api_openapi.py (SCHEMATHESIS_HOOKS=schemathesis_hooks).

One hook, and it filters nothing: it writes the content of file formats, which no JSON Schema states.
A document upload's ``file`` part: the document states the part's name (``encoding``:
``document.txt``) and the ``filename`` field's supported extensions, and the extension picks the
format; a format's bytes (a .docx is a zip of XML parts) are no JSON Schema. A TMX import (PUT
/v1/memory as ``application/x-tmx+xml``): an XML format. So in schema-valid (positive) cases the part,
or the body, holds a small real document of that format; negative cases keep what schemathesis
generated.
"""
from __future__ import annotations

import functools
import io

import schemathesis

UPLOAD_ROUTES = ("/v1/documents", "/translate_file", "/v2/document")
UPLOAD_NAME = "document.txt"        # service/api/openapi.py UPLOAD_NAME
TEXTS = {"de": "Ein Mann geht über die Straße.", "en": "A man walks across the street.",
         "fr": "Un homme traverse la rue."}
TMX_MEDIA = "application/x-tmx+xml"
# one unit in every served language: whichever model the query picks finds its two
TMX = ('<?xml version="1.0" encoding="UTF-8"?>\n<tmx version="1.4"><header srclang="de" datatype="plaintext" '
       'segtype="sentence" adminlang="en" creationtool="tests" creationtoolversion="1" o-tmf="none"/><body><tu>'
       + "".join(f'<tuv xml:lang="{lang}"><seg>{text}</seg></tuv>' for lang, text in TEXTS.items())
       + "</tu></body></tmx>")   # a str: schemathesis sends a format: binary body's str as it is, and
#                                   still counts the case schema-valid (bytes would make it a negative case)
SAMPLES = {"txt": "{}\n", "md": "# {}\n", "markdown": "# {}\n", "html": "<p>{}</p>", "htm": "<p>{}</p>",
           "srt": "1\n00:00:01,000 --> 00:00:02,000\n{}\n", "vtt": "WEBVTT\n\n00:00:01.000 --> 00:00:02.000\n{}\n"}


@functools.cache
def sample(ext: str, lang: str = "de") -> bytes:
    """A small document of format ``ext`` (lower case, no dot) holding one sentence in ``lang`` (de, en)."""
    TEXT = TEXTS[lang]
    if ext in SAMPLES:
        return SAMPLES[ext].format(TEXT).encode("utf-8")
    out = io.BytesIO()
    if ext == "docx":
        import docx
        d = docx.Document()
        d.add_paragraph(TEXT)
        d.save(out)
    elif ext == "pptx":
        import pptx
        from pptx.util import Inches
        prs = pptx.Presentation()
        slide = prs.slides.add_slide(prs.slide_layouts[6])
        slide.shapes.add_textbox(Inches(1), Inches(1), Inches(4), Inches(1)).text_frame.text = TEXT
        prs.save(out)
    elif ext == "odt":
        from odf.opendocument import OpenDocumentText
        from odf.text import P
        doc = OpenDocumentText()
        doc.text.addElement(P(text=TEXT))
        doc.write(out)
    else:
        raise ValueError(f"no sample document for .{ext}")
    return out.getvalue()


@schemathesis.hook
def map_case(context, case):
    meta = getattr(case, "meta", None)
    if meta is None or not meta.generation.mode.is_positive:
        return case
    if case.operation.path == "/v1/memory" and case.operation.method.upper() == "PUT" and case.media_type == TMX_MEDIA:
        case.body = TMX
        return case
    if case.operation.path not in UPLOAD_ROUTES or not isinstance(case.body, dict) or "file" not in case.body:
        return case
    name = case.body.get("filename") or UPLOAD_NAME
    case.body["file"] = sample(name.rsplit(".", 1)[-1].lower(), language(case.body))
    return case


def language(body: dict) -> str:
    """The text's language: the source field's when it names one, else one other than the target."""
    source = str(body.get("source_lang") or body.get("source") or "").lower()
    if source[:2] in TEXTS:
        return source[:2]
    target = str(body.get("target_lang") or body.get("target") or "").lower()
    return "en" if target.startswith("de") else "de"
