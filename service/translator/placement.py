"""Placing spans: where each inner span of a sentence goes in its translation's tokens.

Placement answers with target positions (``Placement``); ``assemble.py`` writes the text. The
invariant both keep (``protect.py``): every protected span comes back verbatim, once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from torch import Tensor

from .align import continues, mean_attention, word_attention, wordlike, words


@dataclass
class Placement:
    """Where the inner spans of one sentence go among a hypothesis's tokens (``place_spans``)."""
    at_copy: dict[int, int]         # target position of a copied placeholder -> the span that replaces it
    before: dict[int, list[int]]    # target position -> the spans inserted before it (len(tokens): at the end)
    copies: list[int]               # target positions of copied placeholders, repeats included (spare words not)


def place_spans(allowed: Sequence[frozenset[int]], tok, src_ids: list[int], tokens: list[int],
                cross: Optional[Tensor]) -> Placement:
    """Where the spans of a sentence go in one hypothesis (``tokens``; ``cross`` its [L, H, T, S]
    cross-attention, or None); span j's placeholder is one of the piece ids ``allowed[j]``.

    Alignment (``align.py``): A = cross averaged over layers and heads, [T, S]. (1) Target positions holding a
    sentence's placeholder piece (the model copied it) are copies: each goes to the span whose
    source placeholder it attends to most (among the spans with its word), the copies with the
    highest weight first; a copy takes one span and is replaced by it, and pieces glued to a
    copy ("▁5" "0" "8" for a "5") go with it. A copy whose span another copy took is a repeat
    and is dropped. A placeholder word the sentence does not use as one ("Seattle" in a
    sentence whose placeholder is "Miami") is an ordinary word. (2) A span no copy took (the
    model left its placeholder out) goes where the alignment puts its source position
    (``_aligned``). (3) Without attention, or when the source does not hold exactly one
    placeholder per span (the text had every candidate word itself), copies are taken in
    order, as many unmatched copies as the source had extra placeholder words stay as words,
    and the other spans go at the end, before the final punctuation. Spans never go inside a
    word or after the final punctuation.
    """
    used = frozenset().union(*allowed)   # a placeholder word the sentence does not use is a word
    src_pos = [i for i, t in enumerate(src_ids) if t in used]
    copies = [t for t, tid in enumerate(tokens) if tid in used]
    usable = cross is not None and cross.dim() == 4 and cross.shape[2] >= len(tokens) > 0 \
        and cross.shape[3] >= len(src_ids) and len(src_pos) == len(allowed) \
        and all(src_ids[i] in a for i, a in zip(src_pos, allowed))
    att = mean_attention(cross, len(tokens)) if usable else None    # [T, S] (align.py)
    at_copy: dict[int, int] = {}      # target position of a copy -> span index
    if att is not None:               # each copy bids for the span it attends to most
        bids = []
        for t in copies:
            j = max((j for j in range(len(allowed)) if tokens[t] in allowed[j]),
                    key=lambda j: float(att[t, src_pos[j]]))
            bids.append((float(att[t, src_pos[j]]), -t, j))
        for _, t, j in sorted(bids, reverse=True):
            if j not in at_copy.values():
                at_copy[-t] = j
    else:                             # in order
        for t in copies:
            j = next((j for j in range(len(allowed)) if tokens[t] in allowed[j] and j not in at_copy.values()),
                     None)
            if j is not None:
                at_copy[t] = j
    # The source's own words spelled like a placeholder (src_pos beyond the spans): as many
    # unmatched copies, first first, are those words and stay; the others are repeats, dropped.
    spare = set([t for t in copies if t not in at_copy][:max(0, len(src_pos) - len(allowed))])
    copies = [t for t in copies if t not in spare]
    final = len(tokens)               # the final punctuation's position, spans go before it
    if tokens and not any(c.isalnum() for c in tok.pieces(tokens[-1:])[0]):
        final -= 1
    before: dict[int, list[int]] = {}  # target position -> spans inserted before it
    for j in range(len(allowed)):
        if j in at_copy.values():
            continue
        t = _aligned(att, tok, src_ids, src_pos, src_pos[j], tokens, copies) if att is not None else None
        before.setdefault(final if t is None else min(t, final), []).append(j)
    return Placement(at_copy, before, copies)


def _aligned(att: Tensor, tok, src_ids: list[int], placeholders: list[int], pos: int, tokens: list[int],
             copies: list[int]) -> Optional[int]:
    """Where the span of a placeholder the model left out (at source position ``pos``) goes: the
    target position to insert it before (a word's start, or the end), or None when nothing aligns.

    Words, not pieces, are aligned: a source word is a piece starting with "▁" and the pieces
    after it (placeholders, EOS, a ``>>xx<<`` token and words without a letter or digit left out);
    a target word likewise (copies, the pieces glued to them and punctuation left out). W[t, s] =
    A summed over the pieces of source word s, averaged over those of target word t. A source
    word is anchored to a target word when each is the other's best match in W (an article that
    attends to its noun is not an anchor; the noun is). The span goes after the translation of
    the nearest anchored source word before the placeholder, or before that of the nearest one
    after it, whichever is nearer in the source: "eine weiße 5 Kappe" -> "a white [5] cap". At
    the same distance, the one before wins, unless the two cross (the one before is translated
    after the one after: one of them is wrong); then the side with fewer target words on the
    wrong side of it (a word whose best source word follows the placeholder written before the
    span, or one whose best source word precedes it written after). The placeholder's own column
    is not used: a placeholder the model left out draws attention from many target words.
    """
    src, tgt = tok.pieces(src_ids), tok.pieces(tokens)
    ph = set(placeholders)
    skip_src = {i for i, piece in enumerate(src) if i in ph or i == len(src) - 1 or not wordlike(piece)
                or (piece.startswith(">>") and piece.endswith("<<"))}
    skip_tgt = set()
    for c in copies:                  # a copy and the pieces glued to it
        skip_tgt.add(c)
        k = c + 1
        while k < len(tokens) and continues(tgt[k]):
            skip_tgt.add(k)
            k += 1
    skip_tgt |= {t for t, piece in enumerate(tgt) if not wordlike(piece)}
    src_words, tgt_words = words(src), words(tgt)
    s_keep = [w for w in src_words if any(i not in skip_src for i in w)]
    t_keep = [w for w in tgt_words if any(t not in skip_tgt for t in w) and not any(t in copies for t in w)]
    if not s_keep or not t_keep:
        return None
    W = word_attention(att, s_keep, t_keep, skip_src, skip_tgt)   # [Tw, Sw] (align.py)
    best_src, best_tgt = W.argmax(1).tolist(), W.argmax(0).tolist()
    here = next(k for k, w in enumerate(src_words) if pos in w)      # the placeholder's word
    index = {w[0]: k for k, w in enumerate(src_words)}
    left = right = None               # (distance in source words, target word)
    for k, w in enumerate(s_keep):
        t = best_tgt[k]
        if best_src[t] != k:
            continue
        d = index[w[0]] - here
        if d < 0 and (left is None or -d < left[0]):
            left = (-d, t)
        elif d > 0 and (right is None or d < right[0]):
            right = (d, t)
    after = before = None
    if left is not None:              # after the last piece of that word that has a letter or digit
        after = max(t for t in t_keep[left[1]] if wordlike(tgt[t])) + 1
    if right is not None:
        before = t_keep[right[1]][0]
    if after is not None and before is not None and after > before and left[0] == right[0]:
        follows = [index[s_keep[k][0]] > here for k in best_src]     # each target word's best source word
        starts = [w[0] for w in t_keep]
        return min((before, after), key=lambda g: sum((a < g) == f for a, f in zip(starts, follows)))
    if after is not None and (before is None or left[0] <= right[0]):
        return after
    return before

