"""Per-row top-k of a step's log-probabilities: the candidates beam search ranks (greedy is k = 1)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import kernels, settings

TOPK_CHUNK = 64  # vocabulary entries per chunk of ``row_topk``


def row_topk(x: Tensor, k: int, cpu_kernels: Optional[bool] = None) -> tuple[Tensor, Tensor]:
    """``x.topk(k, dim=-1)`` of a [N, V] matrix (values descending), cheaper for small k and large V.

    On CPU (float32/float64), with ``cpu_kernels`` (default: the process's) the compiled kernel (``model.inference.kernels.topk_op``) reads each row once,
    keeping a sorted list of the k best (ties go to the lower index, as in ``torch.topk`` here).
    Otherwise: the k largest entries of a row lie in the k chunks (of TOPK_CHUNK entries) with the
    largest maxima: any other chunk's maximum is at most the k-th largest of those. So chunk maxima (a
    cheap reduction), then top-k of the k * TOPK_CHUNK candidates, instead of a top-k over all V.
    Among exactly equal values the chosen ids may differ from ``torch.topk``'s; the values are the
    same (a row with fewer than k values above -inf may repeat an id among its -inf entries).
    Returns (values [N, k], ids [N, k]).
    """
    N, V = x.shape
    if (x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and 1 <= k <= V
            and settings.or_default("cpu_kernels", cpu_kernels)):
        compiled = kernels.topk_op()
        if compiled is not None:  # one pass per row (``model/inference/csrc/row_topk.cpp``)
            v, i = compiled(x, k)
            return v, i
    C = TOPK_CHUNK
    n_chunks = -(-V // C)
    if N < 2 or n_chunks < 4 * k or x.device.type != "cpu":
        return x.topk(k, dim=-1)
    full = V // C
    chunk_max = x[:, : full * C].reshape(N, full, C).amax(-1)                   # [N, V / C]
    if full < n_chunks:                                                         # a shorter last chunk
        chunk_max = torch.cat([chunk_max, x[:, full * C:].amax(-1, keepdim=True)], dim=1)
    chunks = chunk_max.topk(k, dim=-1).indices                                  # [N, k]
    ids = (chunks[:, :, None] * C + torch.arange(C, device=x.device)).view(N, k * C)
    if full == n_chunks:
        v, j = x.gather(1, ids).topk(k, dim=-1)
        return v, ids.gather(1, j)
    past = ids >= V                                          # past the end of the shorter last chunk
    cand = x.gather(1, ids.clamp(max=V - 1)).masked_fill_(past, float("-inf"))
    v, j = cand.topk(k, dim=-1)
    return v, ids.gather(1, j).clamp_(max=V - 1)
