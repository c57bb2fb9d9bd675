"""Linear layers with a copy of the weight prepared for CPU inference: int8 (the default), or float32
or bfloat16 in oneDNN's prepacked layout.

``pack_for_inference(model)`` is a module-swap pass (as gpt-fast quantizes): every ``nn.Linear`` of
the model becomes a ``PackedLinear`` with the same parameters and state-dict keys, and the shared
output projection gets its own prepared copy (``output_logits``). ``model.load.load_model`` runs it;
the network itself (``model/transformer.py``) knows nothing of it. The prepared copy is used only when no gradient is needed, on fp32 CPU inputs, and only while the weight is the
one that was prepared (an optimizer step or ``load_state_dict`` changes its version, and the plain
float32 path takes over). Training, float64 and CUDA always use the plain path. The dtype and
whether the compiled kernels serve the int8 layers are the caller's (``EngineConfig.linear_dtype`` /
``cpu_kernels`` in the service), else the process's (``settings.current()``: int8 unless
``MT_LINEAR_DTYPE`` says otherwise; ``settings.py``).

**int8** (default): the weights are int8 with one scale per output feature (absmax / 127; on AVX2 CPUs
without VNNI 63 levels a side, ``kernels.int8_weight_levels`` and ``kernels.quantize_weight``), and each
input row is quantized to int8 with its own scale at every call (dynamic, per row, like
CTranslate2's int8 mode): an exact int32 product (``torch._int_mm``; on AVX-512 VNNI CPUs and on AVX2
CPUs without VNNI the whole layer is one compiled call, ``kernels.int8_linear_kernel``), then
``acc * row_scale * weight_scale + bias`` in float32. Every step is per row and exact or
elementwise, so a row's result does not depend at all on the rows it is batched with (bit for bit;
the float32 products below differ in the last digits with the batch). A layer's output is within
about 1% of float32 (``tests/test_linear.py``); speed and translation quality against float32 are
measured in ``docs/performance.md``.

**float32**: oneDNN's blocked ("prepacked") weight layout, read faster than MKL's sgemm on the plain
layout; results equal the plain path's up to summation order.

**bfloat16**: inputs are rounded to bf16 at each layer and products come back as float32 (rounded to
bf16 first). On CPUs with native bf16 dot products (x86 AVX512-BF16 or AMX, Arm BF16) this is
faster than float32, at bf16 precision; a row's result may change in its last bf16 digit with the
batch it shares.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import kernels, settings


def onednn_available() -> bool:
    """True when this torch build has oneDNN's prepacked linear kernels (x86-64 and aarch64 builds)."""
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return (torch.backends.mkldnn.is_available() and ops is not None
                and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


def default_dtype() -> torch.dtype:
    """The prepared weights' dtype when the caller names none: ``settings.current().linear_dtype``
    (int8, or what MT_LINEAR_DTYPE says). Raises ValueError for a bad MT_LINEAR_DTYPE."""
    return getattr(torch, settings.current().linear_dtype)


PACKED_DTYPES = (torch.float32, torch.bfloat16, torch.int8)


class PackedWeight:
    """A copy of a [out, in] fp32 CPU weight prepared for inference, valid while the weight is
    unchanged: oneDNN-blocked in float32 or bfloat16, or int8 with per-output scales (``dtype``; see
    the module docstring). ``cpu_kernels``: int8 products may run the compiled kernels (default: the
    process's)."""

    def __init__(self, weight: Tensor, dtype: torch.dtype = torch.float32, cpu_kernels: Optional[bool] = None):
        if dtype not in PACKED_DTYPES:
            raise ValueError(f"packed linear dtype must be float32, bfloat16 or int8, got {dtype}")
        w = weight.detach()
        self.key = (w.data_ptr(), w._version)
        self.dtype = dtype
        self.cpu_kernels: bool = settings.or_default("cpu_kernels", cpu_kernels)
        self.small: Optional[tuple[Tensor, Tensor]] = None
        if dtype == torch.int8:  # one scale per output feature: the rows of w, quantized like inputs
            # [out, in], [out]; 63 levels a side for the AVX2 kernel (kernels.int8_weight_levels)
            q, self.scale = kernels.quantize_weight(w.float(), kernels.int8_weight_levels())
            # Two layouts of the same int8 values, [in, out] each: torch._int_mm is 2-3x faster on one
            # row with the column-major view, and up to 1.9x faster on 2+ rows with the row-major copy
            # (d_ff -> d_model most). Integer products are exact, so both give the same bits.
            self.packed = q.t()                                                   # column-major view
            # One compiled call does the whole layer, any rows (a copy of the int8 values in its own
            # layout; the same bits as the path above), on AVX-512 VNNI and on AVX2 CPUs.
            kernel = kernels.int8_linear_kernel() if self.cpu_kernels else None
            self.small = kernels.vnni_weight(q) if kernel is not None else None
            # The row-major copy only where torch._int_mm serves 2+ rows, i.e. where no kernel is (the
            # column-major view stays for a fallback, e.g. kernels turned off later)
            self.packed_rows: Optional[Tensor] = None if kernel is not None else self.packed.contiguous()
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous().to(dtype))
        # Check the kernel once against the plain product on a small input; any mismatch -> not used.
        x = torch.randn(3, w.size(1), dtype=w.dtype, generator=torch.Generator().manual_seed(0))
        ref = F.linear(x, w)
        got = self(x, bias=None)
        tol = 1e-4 if dtype == torch.float32 else 5e-2 * float(ref.abs().max()) + 1e-2
        if not torch.allclose(got, ref, rtol=1e-4 if dtype == torch.float32 else 2e-2, atol=tol):
            raise RuntimeError("prepacked linear disagrees with F.linear")
        if self.small is not None and not torch.equal(self._int8(x, bias=None), got):   # the torch._int_mm path
            raise RuntimeError("the compiled int8 layer and torch._int_mm disagree")

    def __call__(self, x: Tensor, bias: Optional[Tensor]) -> Tensor:
        """x [..., in] (float32) @ weight.T + bias -> [..., out] float32."""
        if self.dtype == torch.int8:
            if self.small is not None:
                kernel = kernels.int8_linear_kernel()
                if kernel is not None:
                    return kernel(x, *self.small, self.scale, bias, self.scale.numel())
            return self._int8(x, bias)
        if self.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        b = None if bias is None else bias.to(self.dtype)
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed, b, "none", [], "").float()

    def _int8(self, x: Tensor, bias: Optional[Tensor]) -> Tensor:
        """Dynamic per-row int8: each row of x is scaled by its own absmax / 127 and rounded; the
        elementwise halves run compiled (``kernels.int8_ops``) where available."""
        rows = x.reshape(-1, x.size(-1))
        ops = kernels.int8_ops() if self.cpu_kernels else None
        quantize = kernels.quantize_rows_eager if ops is None else ops.quantize_rows
        dequantize = kernels.dequantize_eager if ops is None else ops.dequantize
        q, scale = quantize(rows)
        w = self.packed if rows.size(0) == 1 or self.packed_rows is None else self.packed_rows
        out = dequantize(torch._int_mm(q, w), scale, self.scale, bias)   # exact int32 products
        return out.view(*x.shape[:-1], out.size(-1))

    def valid_for(self, weight: Tensor) -> bool:
        return self.key == (weight.data_ptr(), weight._version)

    def applies(self, x: Tensor, weight: Tensor) -> bool:
        """Whether ``x @ weight.T`` may use this copy: inference (no gradients) on fp32 CPU inputs, and
        ``weight`` still the tensor that was prepared."""
        return (x.dtype == torch.float32 and x.device.type == "cpu" and x.numel() > 0
                and not torch.is_grad_enabled() and self.key == (weight.data_ptr(), weight._version))

    @staticmethod
    def usable(weight: Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dtype == torch.float32 and onednn_available()


def packed_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], packed: Optional[PackedWeight]) -> Tensor:
    """x @ weight.T + bias: [..., in] -> [..., out]; through ``packed`` when it applies (see module doc)."""
    if packed is not None and packed.applies(x, weight):
        return packed(x, bias)
    return F.linear(x, weight, bias)


class PackedLinear(nn.Linear):
    """``nn.Linear`` (same parameters and state-dict keys) that can use a prepacked weight."""

    packed: Optional[PackedWeight] = None

    def pack(self, dtype: torch.dtype = torch.float32, cpu_kernels: Optional[bool] = None) -> bool:
        """Prepack the weight (in ``dtype``, see ``PackedWeight``) for CPU inference; returns whether
        the packed path is active."""
        self.packed = None
        if PackedWeight.usable(self.weight):
            try:
                self.packed = PackedWeight(self.weight, dtype, cpu_kernels)
            except (RuntimeError, AttributeError):  # a torch without this kernel (e.g. no CPU _int_mm)
                self.packed = None
        return self.packed is not None

    def unpack(self) -> None:
        self.packed = None

    def forward(self, x: Tensor) -> Tensor:
        packed, weight = self.packed, self.weight
        if packed is not None and packed.applies(x, weight):   # packed_linear, one call fewer per layer
            return packed(x, self.bias)
        return F.linear(x, weight, self.bias)


# The prepared copy of each model's shared output projection (the target embedding matrix, which is
# no nn.Linear to swap): kept beside the model, not on it, so the network stays as defined.
_OUTPUT: "weakref.WeakKeyDictionary[nn.Module, PackedWeight]" = weakref.WeakKeyDictionary()


def _sharing(cls: type[nn.Linear], linear: nn.Linear) -> nn.Linear:
    """A ``cls`` (nn.Linear or PackedLinear) holding ``linear``'s weight and bias Parameters: made
    without ``nn.Linear.__init__``, which would allocate and initialise weights of its own."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.in_features, new.out_features = linear.in_features, linear.out_features
    new.weight, new.bias = linear.weight, linear.bias
    new.train(linear.training)
    return new


def _swap_linears(model: nn.Module, to_packed: bool) -> list[nn.Linear]:
    """Replace every nn.Linear child by a PackedLinear sharing its parameters (or back); returns the
    model's linear modules after the swap."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if to_packed and type(child) is nn.Linear:
                setattr(parent, name, _sharing(PackedLinear, child))
            elif not to_packed and isinstance(child, PackedLinear):
                setattr(parent, name, _sharing(nn.Linear, child))
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def _resolve_dtype(dtype) -> torch.dtype:
    if dtype is None:
        return default_dtype()
    if isinstance(dtype, str):
        return getattr(torch, settings.linear_dtype_name(dtype, "packed linear dtype"))
    if dtype not in PACKED_DTYPES:
        raise ValueError(f"packed linear dtype must be float32, bfloat16 or int8, got {dtype}")
    return dtype


def pack_for_inference(model: nn.Module, dtype: "torch.dtype | str | None" = None, enabled: bool = True,
                       cpu_kernels: Optional[bool] = None) -> bool:
    """Swap every linear layer of ``model`` (a ``Transformer``) for a ``PackedLinear`` and prepare
    its weight for oneDNN CPU inference, plus the shared output projection (``output_logits``).
    A no-op off CPU, off fp32 or without oneDNN. Returns whether packing is active.
    ``enabled=False`` swaps the plain layers back and drops the prepared copies. ``dtype``: int8,
    float32 or bfloat16 (a torch dtype or its name; default ``default_dtype()``). ``cpu_kernels``:
    the int8 layers may run the compiled kernels (default: the process's).
    Raises ValueError for another dtype."""
    dtype = _resolve_dtype(dtype)
    cpu_kernels = settings.or_default("cpu_kernels", cpu_kernels)
    _OUTPUT.pop(model, None)
    if not enabled:
        _swap_linears(model, to_packed=False)
        return False
    linears = _swap_linears(model, to_packed=True)
    ok = all([m.pack(dtype, cpu_kernels) for m in linears])
    tied = getattr(model, "out_proj", None) is None
    if ok and tied and PackedWeight.usable(model.tgt_embed.tok.weight):
        try:
            _OUTPUT[model] = PackedWeight(model.tgt_embed.tok.weight, dtype, cpu_kernels)
        except (RuntimeError, AttributeError):
            ok = False
    elif tied:
        ok = False
    if not ok:
        for m in linears:
            m.unpack()
        _OUTPUT.pop(model, None)
        if dtype != torch.float32 and PackedWeight.usable(model.tgt_embed.tok.weight):
            # e.g. a torch build without the int8 or bf16 kernels: prepacked float32 instead
            return pack_for_inference(model, torch.float32, cpu_kernels=cpu_kernels)
    return ok


def packed_output(model: nn.Module) -> Optional[PackedWeight]:
    """The prepared copy of ``model``'s shared output projection, or None."""
    return _OUTPUT.get(model)


def output_logits(model: nn.Module, x: Tensor) -> Tensor:
    """The output projection of ``model`` (``Transformer.logits``) on x [..., d_model] -> [..., vocab_size],
    through the prepared copy of the shared embedding matrix when ``pack_for_inference`` made one."""
    packed = _OUTPUT.get(model)
    if packed is not None and model.out_proj is None:
        return packed_linear(x, model.tgt_embed.tok.weight, model.logits_bias, packed)
    return model.logits(x)


def linear_dtype(model: nn.Module) -> str:
    """The arithmetic of the model's linear layers at inference: "int8", "bfloat16" or "float32" when
    prepared (``pack_for_inference``), else the parameters' dtype (e.g. "float32" on CUDA)."""
    packed = next((m.packed for m in model.modules() if isinstance(m, PackedLinear) and m.packed is not None), None)
    return str(packed.dtype if packed is not None else next(model.parameters()).dtype).removeprefix("torch.")
