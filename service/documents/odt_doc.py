"""OpenDocument text (.odt, odfpy). Every paragraph and heading (``text:p``, ``text:h``) of the body
(tables, lists, frames included) and of the page styles (headers, footers) is one ``RichText`` unit:
spans (``text:span``, their character style: bold, italic, ...) and links (``text:a``) are carried to
the translated words; paragraph styles (headings, list levels) are never touched. Tabs, line breaks,
frames, notes, bookmarks, fields and any other element inside a paragraph stay as they are, at their
place, untranslated. odfpy parses XML with defusedxml (no entities, no network).
"""
from __future__ import annotations

import io
import re

from odf.element import Element, Node, Text
from odf.namespaces import TEXTNS
from odf.opendocument import load as odf_load
from odf.text import S as SpaceElement

from .common import DocumentError, Group, Item, Run, Segments, build, not_valid, saved
from .safety import open_archive

TEXT = "text"
MIMETYPE = "application/vnd.oasis.opendocument.text"
_GROUPS = {(TEXTNS, "span"), (TEXTNS, "a")}
_SPACES = {(TEXTNS, "tab"), (TEXTNS, "line-break")}
_PARAGRAPHS = {(TEXTNS, "p"), (TEXTNS, "h")}


class OdtDocument:
    def __init__(self, data: bytes):
        zf, self.parsed_bytes = open_archive(data, "OpenDocument text (.odt)", "content.xml")
        if "mimetype" in zf.namelist() and zf.read("mimetype").strip() != MIMETYPE.encode():
            raise DocumentError(415, f"the content is an OpenDocument file of type {zf.read('mimetype')[:80]!r}, "
                                     f"not text ({MIMETYPE}), whatever its name says")
        try:
            self.doc = odf_load(io.BytesIO(data))
        except Exception as e:  # noqa: BLE001 - any failure of the library on an untrusted file is the file's
            raise not_valid("OpenDocument text (.odt)", e) from None
        self._seg = Segments.of_paragraphs((p for root in (self.doc.body, self.doc.masterstyles)
                                            for p in _paragraphs(root)), _paragraph)
        self.segments = self._seg.segments

    def rebuild(self, translations: list[str]) -> bytes:
        self._seg.apply(translations)
        for node in list(self.doc.meta.childNodes):    # odfpy's save reads each as an element (its generator)
            if node.nodeType != Node.ELEMENT_NODE:
                self.doc.meta.childNodes.remove(node)
        return saved(self.doc.write)


def _paragraph(p):
    """A ``text:p`` or ``text:h``'s nodes as items, and the ``put`` that replaces its children by the
    rebuilt items' nodes (``Segments.add_runs``)."""
    templates: dict[int, object] = {}

    def put(rebuilt: list[Item]) -> None:
        for child in list(p.childNodes):
            _detach(child)
        for node in build(rebuilt, templates, lambda tpl, text: Text(text), _group):
            _detach(node)
            p.appendChild(node)
        _spaces(p)
    return _items(p, templates), put


def _detach(node) -> None:
    """``node`` out of its parent, if it has one. odfpy's ``removeChild`` takes elements only, and
    raises after taking one out when the document's caches lack it (an element of a frame's paragraph
    that its parent paragraph's rebuild put back); the node is out then all the same."""
    parent = node.parentNode
    if parent is None:
        return
    if node.nodeType != Node.ELEMENT_NODE:
        parent.childNodes.remove(node)
    else:
        try:
            parent.removeChild(node)
        except ValueError:
            pass
    node.parentNode = None


def _spaces(el) -> None:
    """Runs of spaces in the text under ``el`` (its spans and links) as ODF writes them: one space,
    then ``text:s`` for the others (plain, ODF shows several as one)."""
    for child in list(el.childNodes):
        if child.nodeType == Node.ELEMENT_NODE:
            if child.qname in _GROUPS:
                _spaces(child)
            continue
        if "  " not in child.data:
            continue
        pieces = []
        for k, part in enumerate(re.split(r"( {2,})", child.data)):
            if k % 2 == 0:
                pieces += [Text(part)] if part else []
            else:
                pieces += [Text(" "), SpaceElement(c=len(part) - 1)]
        for piece in pieces:
            el.insertBefore(piece, child)
        el.childNodes.remove(child)
        child.parentNode = None


def _paragraphs(root):
    """Every text:p and text:h under root, outermost first (a paragraph inside a frame inside a
    paragraph is a unit of its own: the frame is atomic in its parent)."""
    for child in root.childNodes:          # document order; depth is bounded by MAX_XML_DEPTH
        if child.nodeType == Node.ELEMENT_NODE:
            if child.qname in _PARAGRAPHS:
                yield child
            yield from _paragraphs(child)


def _items(el, templates: dict) -> list[Item]:
    """An element's children as items. Spaces that indent a line (``text:s`` right after a tab or
    line break, with the plain spaces between) are kept as they are, with the break."""
    out: list[Item] = []
    indent = False          # right after a tab or line break, only spaces since
    for child in el.childNodes:
        key = len(templates)
        templates[key] = child
        text = child.nodeType == Node.TEXT_NODE
        spacing = (text and not child.data.strip(" ")) or (not text and child.qname == (TEXTNS, "s"))
        if indent and spacing:
            out.append(Run(key, "", None))
            continue
        indent = not text and child.qname in _SPACES
        if text:
            out.append(Run(key, child.data, TEXT))
        elif child.qname in _GROUPS:
            out.append(Group(key, _items(child, templates)))
        elif child.qname == (TEXTNS, "s"):
            out.append(Run(key, " " * int(child.attributes.get((TEXTNS, "c"), "1") or 1), TEXT))
        else:
            out.append(Run(key, "", None, space=child.qname in _SPACES))
    return out


def _group(tpl, nodes: list):
    """A copy of a span or link element without its children, holding ``nodes``."""
    el = Element(qname=tpl.qname, qattributes=dict(tpl.attributes), check_grammar=False)
    for node in nodes:
        _detach(node)
        el.appendChild(node)
    return el


def load(data: bytes) -> OdtDocument:
    return OdtDocument(data)
