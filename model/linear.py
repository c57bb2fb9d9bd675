"""Linear layers with an optional oneDNN-prepacked weight for CPU inference.

Decoding steps multiply a few dozen rows by each weight matrix, so on CPU their cost is mostly
reading the weights; oneDNN's blocked ("prepacked") weight layout reads them faster than MKL's
sgemm on the plain layout (1.4x for a whole decoder step of the small model, 1.6x for the 8k-vocabulary
output projection, measured on a 2-core AMD EPYC). This is what CTranslate2 does on non-Intel CPUs.

``Transformer.pack_for_inference()`` packs every weight once; the packed copy is used only when no
gradient is needed, on fp32 CPU inputs, and only while the weight is the one that was packed (an
optimizer step or ``load_state_dict`` changes its version, and the plain path takes over). The
results are float32 matrix products like the plain path's, equal up to summation order.

Optionally (``pack(dtype=torch.bfloat16)``, ``MT_LINEAR_DTYPE=bfloat16``) the packed copy is
bfloat16: inputs are rounded to bf16 at each layer and products come back as float32 (rounded to
bf16 first). On CPUs with native bf16 dot products (x86 AVX512-BF16 or AMX, Arm BF16) this halves
the linear layers' time (2.0 vs 4.2 ms for 211 x 256 by the 8k-vocabulary projection here) at
bf16 precision: results then differ from float32 in the 3rd significant digit, and a row's result
may change in its last bf16 digit with the batch it shares (float32 results only in the last
float32 digits). Off by default.
"""
from __future__ import annotations

import os
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


def default_dtype() -> torch.dtype:
    """The packed weights' dtype from MT_LINEAR_DTYPE: float32 (default) or bfloat16."""
    name = os.environ.get("MT_LINEAR_DTYPE", "float32").strip().lower()
    dtypes = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in dtypes:
        raise ValueError(f"MT_LINEAR_DTYPE must be float32 or bfloat16, got {name!r}")
    return dtypes[name]


class PackedWeight:
    """A oneDNN-blocked copy of a [out, in] fp32 CPU weight, valid while the weight is unchanged;
    in float32, or in bfloat16 (``dtype``; see the module docstring)."""

    def __init__(self, weight: Tensor, dtype: torch.dtype = torch.float32):
        w = weight.detach()
        self.key = (w.data_ptr(), w._version)
        self.dtype = dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous().to(dtype))
        # Check the kernel once against the plain product on a small input; any mismatch -> not used.
        x = torch.randn(3, w.size(1), dtype=w.dtype, generator=torch.Generator().manual_seed(0))
        ref = F.linear(x, w)
        got = self(x, None)
        tol = 1e-4 if dtype == torch.float32 else 5e-2 * float(ref.abs().max()) + 1e-2
        if not torch.allclose(got, ref, rtol=1e-4 if dtype == torch.float32 else 2e-2, atol=tol):
            raise RuntimeError("oneDNN prepacked linear disagrees with F.linear")

    def __call__(self, x: Tensor, bias: Optional[Tensor]) -> Tensor:
        """x [..., in] (float32) @ weight.T + bias -> [..., out] float32."""
        if self.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        b = None if bias is None else bias.to(self.dtype)
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed, b, "none", [], "").float()

    def valid_for(self, weight: Tensor) -> bool:
        return self.key == (weight.data_ptr(), weight._version)

    @staticmethod
    def usable(weight: Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dtype == torch.float32 and onednn_available()


def packed_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], packed: Optional[PackedWeight]) -> Tensor:
    """x @ weight.T + bias: [..., in] -> [..., out]; through ``packed`` when it applies (see module doc)."""
    if (packed is not None and x.dtype == torch.float32 and x.device.type == "cpu" and x.numel()
            and not torch.is_grad_enabled() and packed.valid_for(weight)):
        return packed(x, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state-dict keys) that can use a prepacked weight."""

    packed: Optional[PackedWeight] = None

    def pack(self, dtype: torch.dtype = torch.float32) -> bool:
        """Prepack the weight (in ``dtype``) for CPU inference; returns whether the packed path is active."""
        self.packed = None
        if PackedWeight.usable(self.weight):
            try:
                self.packed = PackedWeight(self.weight, dtype)
            except RuntimeError:
                self.packed = None
        return self.packed is not None

    def unpack(self) -> None:
        self.packed = None

    def forward(self, x: Tensor) -> Tensor:
        return packed_linear(x, self.weight, self.bias, self.packed)
