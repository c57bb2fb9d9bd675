"""Assembling a sentence's translation: the hypothesis's tokens decoded, in the source's case style
(``truecase.apply_style``), its inner spans where ``placement.py`` put them and its edge spans
around it. A sentence still being decoded is assembled from its tokens so far (``partial``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .align import continues
from .placement import Placement
from .truecase import apply_style

if TYPE_CHECKING:
    from .protect import Protected


def assemble(p: Protected, tok, tokens: list[int], placement: Optional[Placement]) -> str:
    """The translation text of one hypothesis (``tokens``) of sentence ``p``: the case style, the
    edge spans and (``placement``: where they go; None when the sentence has none) the inner spans
    put back, every span once."""
    if not p.spans:
        return partial(p, tok, tokens) + p.suffix
    return p.prefix + _with_spans(p, tok, tokens, placement) + p.suffix


def partial(p: Protected, tok, tokens: list[int]) -> Optional[str]:
    """The text of a sentence still being decoded (its tokens so far), or None when it has inner
    spans (their places are known only from the finished hypothesis's attention)."""
    return None if p.spans else p.prefix + apply_style(p.style, tok.decode(tokens))


def _with_spans(p: Protected, tok, tokens: list[int], placement: Placement) -> str:
    """Decode ``tokens`` in chunks between span positions; spans verbatim, chunks in the case style.
    A chunk or copied placeholder whose first piece starts a word ("▁") keeps the space before it,
    except next to a span that was glued to a word on that side in the source ("<schnell>")."""
    pieces = tok.pieces(tokens)
    at_copy, before, copies = placement.at_copy, placement.before, placement.copies
    out: list[str] = []
    chunk: list[int] = []
    glue = [False]                    # whether the last span was glued to the word after it

    def flush():
        if chunk:
            text = apply_style(p.style, tok.decode(chunk))
            text = text.lstrip() if glue[0] else text
            spaced = out and text and not text[0].isspace() and tok.pieces(chunk[:1])[0].startswith("▁")
            out.append((" " if spaced and not glue[0] else "") + text)
            chunk.clear()
            glue[0] = False

    def span(j: int, spaced: bool):
        flush()
        glued = p.glued[j] if j < len(p.glued) else (False, False)
        spaced = spaced and out and not (glued[0] or glue[0] or out[-1][-1:].isspace())   # one space, not two
        out.append((" " if spaced else "") + p.spans[j])
        glue[0] = glued[1]

    after_copy = False                # inside the word a copied placeholder starts
    for t in range(len(tokens) + 1):
        for j in before.get(t, []):
            span(j, True)
        if t == len(tokens):
            break
        if t in at_copy:
            span(at_copy[t], pieces[t].startswith("▁"))
        elif not (t in copies or (after_copy and continues(pieces[t]))):
            chunk.append(tokens[t])     # (extra copies of a placeholder, and the pieces glued to a
            after_copy = False          # copy, "▁5" "0" "8" after a "5", are dropped)
            continue
        after_copy = True
    flush()
    return "".join(out)
