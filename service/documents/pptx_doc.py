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

from .common import DocumentError, RichText, Run, Segments
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
        if not any(it.style is not None and it.text.strip() for it in items):
            return
        rich = RichText(items)

        def put(tr: list[str]) -> None:
            at = list(p).index(inline[0])
            for child in inline:
                p.remove(child)
            k = at
            for it in rich.rebuild(tr):
                tpl = templates[it.key]
                if it.style is None and not it.text:
                    el = tpl
                elif it.text:
                    el = copy.deepcopy(tpl)
                    t = el.find(qn("a:t"))
                    if t is None:
                        t = etree.SubElement(el, qn("a:t"))
                    t.text = it.text
                else:
                    continue
                p.insert(k, el)
                k += 1
        self._seg.add(rich.segments, put)

    def rebuild(self, translations: list[str]) -> bytes:
        self._seg.apply(translations)
        out = io.BytesIO()
        self.prs.save(out)
        return out.getvalue()


def load(data: bytes) -> PptxDocument:
    return PptxDocument(data)
