"""Schemathesis hooks for tests/test_api_openapi.py (SCHEMATHESIS_HOOKS=schemathesis_hooks).

One hook, and it filters nothing: it generates the content of a document upload's ``file`` part. The
document states the part's name (``encoding``: ``document.txt``) and the ``filename`` field's
supported extensions, and the extension picks the format; a format's bytes (a .docx is a zip of
XML parts) are no JSON Schema. So in schema-valid (positive) cases of the upload routes the part
holds a small real document of that format; negative cases keep what schemathesis generated.
"""
from __future__ import annotations

import functools
import io

import schemathesis

UPLOAD_ROUTES = ("/v1/documents", "/translate_file", "/v2/document")
UPLOAD_NAME = "document.txt"        # service/api/openapi.py UPLOAD_NAME
TEXT = "Ein Mann geht über die Straße."
SAMPLES = {"txt": TEXT + "\n", "md": f"# {TEXT}\n", "markdown": f"# {TEXT}\n", "html": f"<p>{TEXT}</p>",
           "htm": f"<p>{TEXT}</p>", "srt": f"1\n00:00:01,000 --> 00:00:02,000\n{TEXT}\n",
           "vtt": f"WEBVTT\n\n00:00:01.000 --> 00:00:02.000\n{TEXT}\n"}


@functools.cache
def sample(ext: str) -> bytes:
    """A small document of format ``ext`` (lower case, no dot) holding one German sentence."""
    if ext in SAMPLES:
        return SAMPLES[ext].encode("utf-8")
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
    if (meta is None or not meta.generation.mode.is_positive or case.operation.path not in UPLOAD_ROUTES
            or not isinstance(case.body, dict) or "file" not in case.body):
        return case
    name = case.body.get("filename") or UPLOAD_NAME
    case.body["file"] = sample(name.rsplit(".", 1)[-1].lower())
    return case
