"""Linear layers with an optional oneDNN-prepacked weight for CPU inference.

Decoding steps multiply a few dozen rows by each weight matrix, so on CPU their cost is mostly
reading the weights; oneDNN's blocked ("prepacked") weight layout reads them faster than MKL's
sgemm on the plain layout (1.4x for a whole decoder step of the small model, 1.6x for the 8k-vocabulary
output projection, measured on a 2-core AMD EPYC). This is what CTranslate2 does on non-Intel CPUs.

``Transformer.pack_for_inference()`` packs every weight once; the packed copy is used only when no
gradient is needed, on fp32 CPU inputs, and only while the weight is the one that was packed (an
optimizer step or ``load_state_dict`` changes its version, and the plain path takes over). The
results are float32 matrix products like the plain path's, equal up to summation order.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def onednn_available() -> bool:
    """True when this torch build has oneDNN's prepacked linear kernels (x86-64 and aarch64 builds)."""
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return (torch.backends.mkldnn.is_available() and ops is not None
                and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


class PackedWeight:
    """A oneDNN-blocked copy of a [out, in] fp32 CPU weight, valid while the weight is unchanged."""

    def __init__(self, weight: Tensor):
        w = weight.detach()
        self.key = (w.data_ptr(), w._version)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
        # Check the kernel once against the plain product on a small input; any mismatch -> not used.
        x = torch.randn(3, w.size(1), dtype=w.dtype, generator=torch.Generator().manual_seed(0))
        ref = F.linear(x, w)
        got = torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        if not torch.allclose(got, ref, rtol=1e-4, atol=1e-4):
            raise RuntimeError("oneDNN prepacked linear disagrees with F.linear")

    def valid_for(self, weight: Tensor) -> bool:
        return self.key == (weight.data_ptr(), weight._version)

    @staticmethod
    def usable(weight: Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dtype == torch.float32 and onednn_available()


def packed_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], packed: Optional[PackedWeight]) -> Tensor:
    """x @ weight.T + bias: [..., in] -> [..., out]; through ``packed`` when it applies (see module doc)."""
    if (packed is not None and x.dtype == torch.float32 and x.device.type == "cpu" and x.numel()
            and not torch.is_grad_enabled() and packed.valid_for(weight)):
        return torch.ops.mkldnn._linear_pointwise(x, packed.packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state-dict keys) that can use a prepacked weight."""

    packed: Optional[PackedWeight] = None

    def pack(self) -> bool:
        """Prepack the weight for CPU inference; returns whether the packed path is active."""
        self.packed = None
        if PackedWeight.usable(self.weight):
            try:
                self.packed = PackedWeight(self.weight)
            except RuntimeError:
                self.packed = None
        return self.packed is not None

    def unpack(self) -> None:
        self.packed = None

    def forward(self, x: Tensor) -> Tensor:
        return packed_linear(x, self.weight, self.bias, self.packed)
