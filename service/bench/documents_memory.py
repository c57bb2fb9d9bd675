"""A document's memory: the process's resident size (``VmRSS``) before a document, at its peak
(``VmHWM``, reset first), once parsed, and once released (``documents.release``: the trees collected,
the heap handed back with glibc's ``malloc_trim``), for Word files built here near the caps of
``service/documents/safety.py`` and past them, and for the text formats' worst cases at the upload
limit (docs/documents.md#limits):

    python -m service.bench.documents_memory              # every case
    python -m service.bench.documents_memory --cases bomb,md-items
    python -m service.bench.documents_memory --cases text-formats   # TEXT_CASES

Word cases: ``formatted`` (paragraphs of formatted runs: XML and elements near MAX_XML_ELEMENTS,
segments and characters under their caps), ``text`` (long plain runs: XML near
MAX_XML_BYTES, refused at MAX_DOCUMENT_CHARS once parsed), ``bomb`` (XML past MAX_XML_BYTES whose
header says 1,000 bytes: refused as it inflates).

Text cases, each file MAX_DOCUMENT_BYTES of one small unit repeated (``TEXT_CASES``): the densest
units, refused as MAX_PARSED_NODES is passed while parsing, and ``-under`` ones padded with text to
parse into just under it (the whole tree built, then refused at a segment or character cap);
subtitles and plain text, whose size bounds them, at their smallest cues and blocks.
Linux only (``/proc/self``). Figures, not a test.
"""
from __future__ import annotations

import argparse
import io
import random
import struct
import sys
import time
import zipfile

W = 'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'
_RPR = ('<w:rPr><w:rFonts w:ascii="{f}" w:hAnsi="{f}" w:cs="{f}"/><w:b/><w:color w:val="{c}"/>'
        '<w:sz w:val="{s}"/><w:szCs w:val="{s}"/><w:lang w:val="de-DE"/></w:rPr>')


VOCABULARY = [f"w{i}ort" for i in range(60)]


def words(rnd: random.Random, n: int, vocab: int = 60) -> str:
    return " ".join(rnd.choices(VOCABULARY[:vocab], k=n))


def paragraphs(n_bytes: int, runs: int, words_per_run: int, formatted: bool, seed: int = 0) -> bytes:
    """About ``n_bytes`` of ``w:p`` elements of ``runs`` runs each (all of one paragraph alike: one
    segment a paragraph), varied enough to compress about as Word's XML does (10-40 times)."""
    rnd, out, size = random.Random(seed), [], 0
    while size < n_bytes:
        rpr = _RPR.format(f=rnd.choice(("Arial", "Calibri", "Cambria")), c=f"{rnd.randrange(4096):06X}",
                          s=rnd.randrange(16, 30)) if formatted else ""
        p = (f'<w:p w:rsidR="00{rnd.randrange(1 << 16):04X}"><w:pPr><w:pStyle w:val="Normal"/></w:pPr>'
             + "".join(f'<w:r>{rpr}<w:t xml:space="preserve">{words(rnd, words_per_run, 60 if formatted else 6)} </w:t></w:r>'
                       for _ in range(runs)) + "</w:p>")
        out.append(p)
        size += len(p)
    return "".join(out).encode()


def docx_of(body: bytes) -> bytes:
    """python-docx's empty document with ``body`` (``w:p`` elements) as its body."""
    import docx
    buf = io.BytesIO()
    docx.Document().save(buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    members = {i.filename: src.read(i) for i in src.infolist()}
    members["word/document.xml"] = (f'<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n<w:document {W}>'
                                    f"<w:body>").encode() + body + b"</w:body></w:document>"
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return out.getvalue()


def declaring(data: bytes, member: str, size: int) -> bytes:
    """A copy of the zip ``data`` whose headers (local and central) say ``member`` unpacks to ``size`` bytes."""
    out, name = bytearray(data), member.encode()
    at = out.find(b"PK\x03\x04" + b"")
    while at >= 0:                 # local headers: name length at 26, name at 30, size at 22
        if out[at + 30:at + 30 + len(name)] == name and struct.unpack_from("<H", out, at + 26)[0] == len(name):
            struct.pack_into("<I", out, at + 22, size)
        at = out.find(b"PK\x03\x04", at + 4)
    at = out.find(b"PK\x01\x02")
    while at >= 0:                 # central directory: name length at 28, name at 46, size at 24
        if out[at + 46:at + 46 + len(name)] == name and struct.unpack_from("<H", out, at + 28)[0] == len(name):
            struct.pack_into("<I", out, at + 24, size)
        at = out.find(b"PK\x01\x02", at + 4)
    return bytes(out)


def repeated(unit: str, head: str = "", tail: str = "", units: int = 0, pad: str = "a") -> bytes:
    """MAX_DOCUMENT_BYTES of ``unit`` repeated between ``head`` and ``tail``; with ``units``, that many
    units, each with ``pad`` repeated where its ``{}`` is to fill the file."""
    from service.protocol import MAX_DOCUMENT_BYTES
    room = MAX_DOCUMENT_BYTES - len(head.encode()) - len(tail.encode())
    if units:
        bare = len(unit.format("").encode())
        unit = unit.format(pad * ((room // units - bare) // len(pad.encode())))
    else:
        units = room // len(unit.encode())
    return (head + unit * units + tail).encode()


def under(nodes_per_unit: int) -> int:
    """Units of ``nodes_per_unit`` nodes (tags, text, lines, tokens, cues) that parse into just under
    MAX_PARSED_NODES."""
    from service.protocol import MAX_PARSED_NODES
    return int(MAX_PARSED_NODES * 0.98) // nodes_per_unit


CUE = "00:00:00{0}000 --> 00:00:01{0}000\n{1}\n\n"
# name -> (file name, the file); the nodes a unit parses into in the comments (docs/documents.md#limits)
TEXT_CASES = {
    # list items: 1 line, 6 tokens, 1 HTML part each (the file that peaked near 2.2 GiB before the cap)
    "md-items": ("a.md", lambda: repeated("- a\n")),
    "md-items-under": ("a.md", lambda: repeated("- {}\n", units=under(8), pad="a ")),
    # emphasis in paragraphs of 0.8 MB: 4 tokens and 4 HTML parts a unit
    "md-emphasis": ("a.md", lambda: repeated(("*a* " * 200_000 + "\n\n"))),
    "md-paragraphs-under": ("a.md", lambda: repeated("{}\n\n", units=under(7), pad="wort ")),
    # link reference definitions: a line each, no token (markdown-it keeps each in a dictionary)
    "md-references-under": ("a.md", lambda: "".join(f"[{i:x}]:b\n" for i in range(under(1))).encode()),
    # a run of inline elements: 3 parts a unit, all one sentence
    "html-inline": ("a.html", lambda: repeated("<b>a</b>")),
    "html-inline-under": ("a.html", lambda: repeated("<b>{}</b>", units=under(3))),
    "html-blocks-under": ("a.html", lambda: repeated("<p>{}", units=under(2))),
    "html-entities-under": ("a.html", lambda: repeated("<p>&amp;{}", units=under(2))),   # text kept beside its source
    "txt-blocks": ("a.txt", lambda: repeated("a\n\n")),
    "txt-lines": ("a.txt", lambda: repeated("a\n")),
    "srt-cues": ("a.srt", lambda: repeated("1\n" + CUE.format(",", "a"))),
    "srt-tags": ("a.srt", lambda: repeated("<b>a</b>", "1\n" + CUE.format(",", "")[:-2], "\n")),
    "vtt-cues": ("a.vtt", lambda: repeated(CUE.format(".", "a"), "WEBVTT\n\n")),
}


TEXT_CASES_WARM = {"md": b"# Ein *Titel*\n", "html": b"<p>Ein <b>Hund</b>", "srt": ("1\n" + CUE.format(",", "a")).encode(),
                   "vtt": ("WEBVTT\n\n" + CUE.format(".", "a")).encode(), "txt": b"Ein Hund.\n"}


def cases() -> dict:
    """name -> (file name, a function making the file)."""
    from service.documents.common import MAX_XML_BYTES
    return {
        "formatted": ("bench.docx", lambda: docx_of(paragraphs(int(MAX_XML_BYTES * 0.6), 10, 1, True))),
        "text": ("bench.docx", lambda: docx_of(paragraphs(int(MAX_XML_BYTES * 0.95), 4, 40, False))),
        "bomb": ("bench.docx", lambda: declaring(docx_of(paragraphs(MAX_XML_BYTES + (1 << 20), 4, 40, False)),
                                                 "word/document.xml", 1000)),
        **TEXT_CASES,
    }


def kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measure(name: str, data: bytes, filename: str = "bench.docx") -> str:
    from service import documents
    documents.release_memory()
    before = kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")            # VmHWM from here
    t = time.perf_counter()
    try:
        doc = documents.load(data, filename)
        outcome = f"{len(doc.segments)} segments"
    except documents.DocumentError as e:
        doc, outcome = None, f"{e.status}: {e.message[:110]}"
    seconds = time.perf_counter() - t
    parsed = kib("VmRSS")
    if doc is not None:
        doc.rebuild(list(doc.segments))
        documents.release(doc)
    else:
        documents.release_memory()
    peak, after = kib("VmHWM"), kib("VmRSS")
    return (f"{name:19s} {len(data) / 2**20:5.1f} MiB file, {seconds:5.1f} s: {outcome}\n"
            f"{'':19s} VmRSS before {before / 1024:6.0f} MiB, parsed +{(parsed - before) / 1024:5.0f}, "
            f"peak +{(peak - before) / 1024:5.0f}, released +{(after - before) / 1024:4.0f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    table = cases()
    ap.add_argument("--cases", default=",".join(table),
                    help=f"comma-separated, of: {', '.join(table)}; text-formats: every text format's case")
    args = ap.parse_args(argv)
    names = [n for name in args.cases.split(",") for n in (TEXT_CASES if name == "text-formats" else [name])]
    for name in names:
        if name not in table:
            ap.error(f"--cases: unknown case {name!r}; known: {', '.join(table)}, text-formats")
    from service import documents
    documents.load(docx_of(paragraphs(10_000, 2, 3, True)), "warm.docx")     # imports and caches first
    for warm in ("a.md", "a.html", "a.srt", "a.vtt", "a.txt"):
        documents.release(documents.load(TEXT_CASES_WARM[warm.split(".")[1]], warm))
    for name in names:
        filename, make = table[name]
        print(measure(name, make(), filename), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
