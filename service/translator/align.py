"""Word alignment from the decoder's cross-attention: the one alignment the service uses, both to
place protected spans the model left out (``protect.Protector.restore``) and to answer
``return_alignment`` (``alignment_pairs``).

Method (after Garg et al., 2019, "Jointly Learning to Align and Translate with Transformer Models",
who extract alignments from averaged cross-attention heads): A = the hypothesis's cross-attention
averaged over every decoder layer and head, [T, S] (target pieces x source pieces). Pieces are
grouped into words (a word starts at a piece with SentencePiece's "▁" mark and takes the pieces
after it that lack it), and W[t, s] = A summed over the pieces of source word s, averaged over the
pieces of target word t. Target word t is aligned to its best source word argmax_s W[t, s]; a pair
that is also the source word's best target word (argmax_t W[t, s]) is mutual, the high-precision
subset span placement anchors on. All layers are averaged rather than Garg et al.'s penultimate one:
it is the choice span restoration was measured with (docs/text.md), and one choice
keeps the two uses consistent.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor


def mean_attention(cross: Tensor, n_tgt: int) -> Tensor:
    """A hypothesis's cross-attention [L, H, T, S] averaged over layers and heads: [n_tgt, S] float32."""
    return cross.float().mean(dim=(0, 1))[:n_tgt]


def words(pieces: Sequence[str]) -> list[list[int]]:
    """The positions of pieces grouped into words: a word starts at a piece with the word-boundary
    mark "▁" (or at the first piece) and takes the pieces after it that lack the mark."""
    out: list[list[int]] = []
    for i, piece in enumerate(pieces):
        if out and not piece.startswith("▁"):
            out[-1].append(i)
        else:
            out.append([i])
    return out


def word_attention(att: Tensor, src_words: Sequence[Sequence[int]], tgt_words: Sequence[Sequence[int]],
                   skip_src: Iterable[int] = (), skip_tgt: Iterable[int] = ()) -> Tensor:
    """W [len(tgt_words), len(src_words)]: ``att`` [T, S] summed over each source word's pieces and
    averaged over each target word's pieces, leaving out the piece positions ``skip_src`` /
    ``skip_tgt`` (every word given must keep at least one piece)."""
    skip_src, skip_tgt = set(skip_src), set(skip_tgt)
    to_src = torch.zeros(att.shape[1], len(src_words))             # pieces -> words, summed
    for k, w in enumerate(src_words):
        to_src[[i for i in w if i not in skip_src], k] = 1.0
    to_tgt = torch.zeros(len(tgt_words), att.shape[0])             # pieces -> words, averaged
    for k, w in enumerate(tgt_words):
        r = [t for t in w if t not in skip_tgt]
        to_tgt[k, r] = 1.0 / len(r)
    return to_tgt @ att.float() @ to_src


def sentence_alignment(src_pieces: Sequence[str], tgt_pieces: Sequence[str], cross: Optional[Tensor]
                       ) -> tuple[list[tuple[int, int]], int, int]:
    """One sentence's word alignment for ``return_alignment``.

    Args:
        src_pieces: the source pieces the model saw (ending in "</s>"; a leading ">>xx<<" token
            and the "</s>" are no words); tgt_pieces: the hypothesis's pieces (EOS excluded);
        cross: its cross-attention [L, H, T, S] (None or empty: no pairs).
    Returns (pairs, source words, target words): pairs (source word, target word), one per target
    word, its best source word, in target order; word indices count from 0 within the sentence.
    """
    skip = {i for i, p in enumerate(src_pieces) if p == "</s>" or (p.startswith(">>") and p.endswith("<<"))}
    src_words = [w for w in words(src_pieces) if any(i not in skip for i in w)]
    tgt_words = words(tgt_pieces)
    if cross is None or cross.dim() != 4 or not src_words or not tgt_words or cross.shape[2] < len(tgt_pieces):
        return [], len(src_words), len(tgt_words)
    W = word_attention(mean_attention(cross, len(tgt_pieces))[:, : len(src_pieces)], src_words, tgt_words, skip)
    return [(int(s), t) for t, s in enumerate(W.argmax(1).tolist())], len(src_words), len(tgt_words)


def continues(piece: str) -> bool:
    """Whether a target piece continues the word before it (no word-boundary mark, letters or digits)."""
    return not piece.startswith("▁") and any(c.isalnum() for c in piece)


def wordlike(piece: str) -> bool:
    """Whether a piece has a letter or digit."""
    return any(c.isalnum() for c in piece)
