"""The share of translatable words that come back translated, per format, in real files (by default
``tests/fixtures/real/``: files from the format libraries' own test suites, see its PROVENANCE.md).
Each file goes through its format's ``documents.load`` and ``rebuild`` with every segment wrapped
in markers (as the round-trip tests' marking translator answers), then its text is read back by the
format's own library (python-docx paragraphs of body, tables, headers and footers; python-pptx text
frames of slides, groups, tables and notes; odfpy paragraphs and headings of body and page styles;
srt and webvtt-py cue texts less their tags; markdown-it's inline text; lxml's HTML text outside
``script`` and ``style``) and each word (a run of word characters with a letter) is counted inside
or outside the markers. A word outside came back untranslated: kept by design (a field's result,
code, a ``translate="no"`` element) or lost.

    python -m service.bench.fidelity                 # a row per format
    python -m service.bench.fidelity -v              # a row per file, and the words left outside
    python -m service.bench.fidelity --dir DIR       # DIR/<format>/* instead
"""
from __future__ import annotations

import argparse
import io
import re
import sys
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from service import documents

OPEN, CLOSE = "\u27e6", "\u27e7"      # the markers each segment's "translation" is wrapped in
REAL = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "real"
_TOKEN = re.compile(rf"[{OPEN}{CLOSE}]|\w+")
_TAG = re.compile(r"<[^>\n]*>|\{\\[^}\n]*\}")      # subtitle tags and SubRip override blocks


def marked_file(data: bytes, name: str) -> bytes:
    """``data`` (a file called ``name``) rebuilt with each segment wrapped in OPEN .. CLOSE (a
    segment of whitespace stays as it is, as the document routes leave it). Raises DocumentError."""
    doc = documents.load(data, name)
    try:
        return doc.rebuild([OPEN + s + CLOSE if s.strip() else s for s in doc.segments])
    finally:
        documents.release(doc)


@dataclass
class Count:
    words: int = 0          # words of the text the format's library reads
    inside: int = 0         # of them, inside markers (translated)
    outside: list[str] = field(default_factory=list)    # the others

    def add(self, other: "Count") -> None:
        self.words, self.inside = self.words + other.words, self.inside + other.inside
        self.outside += other.outside

    @property
    def share(self) -> float:
        return self.inside / self.words if self.words else 1.0


def counted(text: str) -> Count:
    """The words of ``text`` (markers included), each inside or outside OPEN .. CLOSE."""
    c, depth = Count(), 0
    for m in _TOKEN.finditer(text):
        tok = m.group()
        if tok in (OPEN, CLOSE):
            depth = max(0, depth + (1 if tok == OPEN else -1))
        elif any(ch.isalpha() for ch in tok):
            c.words += 1
            if depth:
                c.inside += 1
            else:
                c.outside.append(tok)
    return c


def docx_text(data: bytes) -> str:
    import docx
    from docx.oxml.ns import qn
    from docx.text.paragraph import Paragraph
    d = docx.Document(io.BytesIO(data))
    parts = [d.element.body] + [part.part.element for s in d.sections for part in
                                (s.header, s.footer, s.first_page_header, s.first_page_footer,
                                 s.even_page_header, s.even_page_footer) if not part.is_linked_to_previous]
    return "\n".join(Paragraph(p, None).text for root in parts for p in root.iter(qn("w:p")))


def pptx_text(data: bytes) -> str:
    import pptx
    from pptx.enum.shapes import MSO_SHAPE_TYPE

    def frames(shapes):
        for sh in shapes:
            if sh.shape_type == MSO_SHAPE_TYPE.GROUP:
                yield from frames(sh.shapes)
            elif sh.has_text_frame:
                yield sh.text_frame
            elif getattr(sh, "has_table", False) and sh.has_table:
                yield from (cell.text_frame for row in sh.table.rows for cell in row.cells)
    prs = pptx.Presentation(io.BytesIO(data))
    texts = []
    for slide in prs.slides:
        texts += [f.text for f in frames(slide.shapes)]
        if slide.has_notes_slide:
            texts.append(slide.notes_slide.notes_text_frame.text if slide.notes_slide.notes_text_frame else "")
    return "\n".join(texts)


def odt_text(data: bytes) -> str:
    from odf import teletype
    from odf.namespaces import TEXTNS
    from odf.opendocument import load
    from odf.text import H, P
    doc = load(io.BytesIO(data))
    out, paragraphs = [], ((TEXTNS, "p"), (TEXTNS, "h"))
    for root in (doc.body, doc.masterstyles):
        for el in root.getElementsByType(P) + root.getElementsByType(H):
            parent = el.parentNode      # a paragraph inside another (a frame's, a note's) is read with it
            while parent is not None and getattr(parent, "qname", None) not in paragraphs:
                parent = parent.parentNode
            if parent is None:
                out.append(teletype.extractText(el))
    return "\n".join(out)


def srt_text(data: bytes) -> str:
    import srt
    return "\n".join(_TAG.sub(" ", s.content) for s in srt.parse(data.decode("utf-8-sig")))


def vtt_text(data: bytes) -> str:
    import webvtt
    return "\n".join(_TAG.sub(" ", c.raw_text) for c in webvtt.from_buffer(io.StringIO(data.decode("utf-8-sig"))))


def md_text(data: bytes) -> str:
    from markdown_it import MarkdownIt
    from mdit_py_plugins.front_matter import front_matter_plugin
    md = MarkdownIt("commonmark").use(front_matter_plugin).enable(["table", "strikethrough"])
    return "\n".join(" ".join(c.content for c in tok.children or () if c.type == "text")
                     for tok in md.parse(data.decode("utf-8-sig")) if tok.type == "inline")


def html_text(data: bytes) -> str:
    import lxml.html
    root = lxml.html.document_fromstring(data.decode("utf-8-sig"))
    out = []
    for el in root.iter():
        if isinstance(el.tag, str) and el.tag not in ("script", "style"):
            out.append(el.text or "")
        out.append(el.tail or "")       # an element's tail is its parent's text
    return " ".join(out)


TEXTS: dict[str, Callable[[bytes], str]] = {"docx": docx_text, "pptx": pptx_text, "odt": odt_text, "srt": srt_text,
                                            "vtt": vtt_text, "md": md_text, "html": html_text}


def measure(path: Path) -> Count:
    """The words of ``path``'s marked rebuild (``marked_file``), read by its format's library."""
    ext = path.suffix.lstrip(".").lower()
    ext = {"htm": "html", "markdown": "md"}.get(ext, ext)
    return counted(TEXTS[ext](marked_file(path.read_bytes(), path.name)))


def files(root: Path) -> list[Path]:
    """The files under ``root``'s format folders (``docx/``, ``md/``, ...), sorted."""
    return sorted(p for p in root.glob("*/*") if p.is_file() and p.parent.name in TEXTS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=REAL, help="a folder of format folders (default: %(default)s)")
    ap.add_argument("-v", "--verbose", action="store_true", help="a row per file and the words left outside")
    args = ap.parse_args(argv)
    per_format: dict[str, Count] = {}
    n: Counter = Counter()
    print(f"{'format':<8} {'files':>5} {'words':>7} {'translated':>10} {'share':>7}")
    for path in files(args.dir):
        try:
            c = measure(path)
        except (documents.DocumentError, zipfile.BadZipFile) as e:
            print(f"  {path.parent.name}/{path.name}: refused: {e}", file=sys.stderr)
            continue
        per_format.setdefault(path.parent.name, Count()).add(c)
        n[path.parent.name] += 1
        if args.verbose:
            left = Counter(c.outside).most_common(12)
            print(f"  {path.parent.name + '/' + path.name:<40} {c.words:>6} {c.inside:>6} {c.share:>7.1%}  "
                  f"{' '.join(f'{w}x{k}' if k > 1 else w for w, k in left)}")
    total = Count()
    for fmt, c in sorted(per_format.items()):
        total.add(c)
        print(f"{fmt:<8} {n[fmt]:>5} {c.words:>7} {c.inside:>10} {c.share:>7.1%}")
    print(f"{'all':<8} {sum(n.values()):>5} {total.words:>7} {total.inside:>10} {total.share:>7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
