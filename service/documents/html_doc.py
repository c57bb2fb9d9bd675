"""HTML pages (.html, .htm): the whole file through the HTML route's ``HtmlText`` (text nodes and
runs of inline elements translated, each inline element put back around its words; markup, scripts,
styles, code and entities byte for byte). UTF-8 only. Its tags, text nodes and comments are counted
as the parser reads them (MAX_PARSED_NODES)."""
from __future__ import annotations

from service.pipeline.markup import HtmlText
from service.protocol import ServiceError

from .common import DocumentError, Nodes, check_size, decode_text


class HtmlDocument:
    def __init__(self, data: bytes):
        try:
            self.html = HtmlText(decode_text(data, "HTML"), "file", count=Nodes().add)
        except DocumentError:           # MAX_PARSED_NODES
            raise
        except ServiceError as e:       # inline elements nested too deep
            raise DocumentError(e.status, e.message.removeprefix("file: ")) from None
        self.segments = self.html.segments
        check_size(len(self.segments), sum(len(t) for t in self.segments))

    def rebuild(self, translations: list[str]) -> bytes:
        return self.html.rebuild(translations).encode("utf-8")


def load(data: bytes) -> HtmlDocument:
    return HtmlDocument(data)
