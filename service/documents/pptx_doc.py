"""PowerPoint presentations (.pptx, python-pptx). Every paragraph (``a:p``) of every slide, slide
layout-independent text (shapes, groups, tables, notes) is one ``RichText`` unit: its runs (``a:r``,
formatting and hyperlinks in ``a:rPr``) are carried to the translated words; paragraph properties
(levels, bullets) and the end-of-paragraph properties stay. Line breaks (``a:br``) and fields
(``a:fld``: slide numbers, dates) stay as they are, at their place, untranslated.
"""
from __future__ import annotations

import copy
import io

import pptx
from lxml import etree
from pptx.oxml.ns import qn

from .common import DocumentError, Run, Segments, build, replace_children, saved
from .safety import open_archive


class PptxDocument:
    def __init__(self, data: bytes):
        open_archive(data, "PowerPoint (.pptx)", "ppt/presentation.xml")
        try:
            self.prs = pptx.Presentation(io.BytesIO(data))
            roots = []
            for slide in self.prs.slides:
                roots.append(slide.element)
                if slide.has_notes_slide:
                    roots.append(slide.notes_slide.element)
        except Exception as e:  # noqa: BLE001 - any failure of the library on an untrusted file is the file's
            raise DocumentError(422, f"not a valid PowerPoint (.pptx) file: {type(e).__name__}: {str(e)[:200]}") from None
        self._seg = Segments()
        for root in roots:
            for p in root.iter(qn("a:p")):
                self._paragraph(p)
        self.segments = self._seg.segments

    def _paragraph(self, p) -> None:
        templates: dict[int, object] = {}
        items, inline = [], []
        for child in p:
            if child.tag in (qn("a:pPr"), qn("a:endParaRPr")):
                continue
            inline.append(child)
            key = len(templates)
            templates[key] = child
            if child.tag == qn("a:r"):
                rpr = child.find(qn("a:rPr"))
                t = child.find(qn("a:t"))
                items.append(Run(key, t.text or "" if t is not None else "",
                                 b"" if rpr is None else etree.tostring(rpr)))
            else:
                items.append(Run(key, "", None, space=child.tag == qn("a:br")))
        self._seg.add_runs(items, lambda rebuilt: replace_children(p, inline, lambda: build(rebuilt, templates, _text_run)))

    def rebuild(self, translations: list[str]) -> bytes:
        self._seg.apply(translations)
        return saved(self.prs.save)


def _text_run(tpl, text: str):
    """A copy of the ``a:r`` with ``text``."""
    r = copy.deepcopy(tpl)
    t = r.find(qn("a:t"))
    if t is None:
        t = etree.SubElement(r, qn("a:t"))
    t.text = text
    return r


def load(data: bytes) -> PptxDocument:
    return PptxDocument(data)
