"""Elementwise rules: one rule for every unary, binary and ternary pointwise op.

Inputs broadcast as in torch (a lower-rank operand's dims align to the right) and are aligned
to one common layout: each output dim takes the axes of the most-sharded operand that splits it,
the other operands are resharded to match (replicated operands are sliced locally, no
communication). Pending sums (partial values) survive only where the op is linear in them:

- additive ops (``add``, ``sub``, ``neg``, ``clone``, float casts...) keep a pending sum when no
  Python number is added; non-partial operands become partial by zeroing all but one addend;
- ``mul`` keeps it when exactly one operand is partial, ``div`` when only the numerator is;
- every other op (``exp``, ``gelu``, comparisons...) first reduces partial inputs (an
  all_reduce, refused in strict mode).

Example:
    >>> y = torch.exp(x) * 2.0 + b   # x P("dp"), b replicated: b is sliced, no communication  # doctest: +SKIP
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..spec import BaseLayout, Layout
from . import parts, random, rows
from ._common import meta_call, out_layout, spec
from .registry import SCALAR, SHAPE_ONLY, OpSharding, register_rule, tensor_inputs

__all__ = ["elementwise_rule", "align", "own_dims"]

NONLINEAR, ADDITIVE, SCALE, DIVIDE, CAST = "nonlinear", "additive", "scale", "divide", "cast"


def _has_number_addend(args) -> bool:
    return any(a is SCALAR or (type(a) in (int, bool)) for a in args[1:]) or (
        bool(args) and (args[0] is SCALAR or type(args[0]) in (int, bool))
    )


def _kept_partial(kind: str, ins: list[Layout], args, meta) -> tuple[str, ...]:
    partial_ins = [x for x in ins if x.partial]
    if not partial_ins or kind == NONLINEAR:
        return ()
    if kind == CAST:
        src, dst = ins[0].dtype, meta.dtype
        return ins[0].partial if src.is_floating_point and dst.is_floating_point else ()
    if kind == ADDITIVE:
        if _has_number_addend(args):
            return ()
        axes = tuple(dict.fromkeys(a for x in partial_ins for a in x.partial))
    elif kind == SCALE:
        if len(partial_ins) != 1:
            return ()
        axes = partial_ins[0].partial
    else:  # DIVIDE: only the numerator may be pending
        if len(partial_ins) != 1 or partial_ins[0] is not ins[0] or args[0] is not ins[0]:
            return ()
        axes = ins[0].partial
    if any(set(axes) & set(x.sharded_axes) for x in ins):
        return ()
    return axes


def align(ins: list[Layout], shape: tuple[int, ...], reserved=()) -> list[tuple[str, ...]]:
    """Per output dim, the axes of the most-sharded operand splitting it (right-aligned)."""
    nd = len(shape)
    dims: list[tuple[str, ...]] = [()] * nd
    used = set(reserved)
    for x in sorted(ins, key=lambda x: -len(x.sharded_axes)):
        off = nd - x.ndim
        for d, axes in enumerate(x.dim_axes):
            o = off + d
            if axes and x.shape[d] == shape[o] and not dims[o] and not used & set(axes):
                dims[o] = axes
                used |= set(axes)
    return dims


def own_dims(x: Layout, dims, shape) -> list[tuple[str, ...]]:
    """The output ``dims``' axes on ``x``'s own (right-aligned) dims; broadcast dims unsplit."""
    off = len(shape) - x.ndim
    return [dims[off + d] if x.shape[d] == shape[off + d] else () for d in range(x.ndim)]


def input_specs(ins, dims, shape, partial, keep_partial_of) -> list:
    return [spec(own_dims(x, dims, shape), partial if keep_partial_of(x) else ()) for x in ins]


def elementwise_rule(kind: str):
    """A rule for pointwise ops whose partial-value behaviour is ``kind``."""

    def rule(op, args, kwargs):
        ins = tensor_inputs(args, kwargs)
        meta = meta_call(op, args, kwargs)
        if isinstance(meta, tuple):  # frexp: (mantissa, exponent), both of the inputs' shape
            return _several(rule, op, args, kwargs, meta)
        shape = tuple(meta.shape)
        if any(x.is_explicit for x in ins):
            return _rows_rule(op, ins, meta)
        partial = _kept_partial(kind, ins, args, meta)
        dims = align(ins, shape, reserved=partial)
        if kind == ADDITIVE:
            keep = lambda x: bool(partial)  # noqa: E731
        else:
            keep = lambda x: bool(partial) and bool(x.partial)  # noqa: E731
        specs = input_specs(ins, dims, shape, partial, keep)
        return OpSharding(specs, out_layout(ins[0].mesh, dims, partial, meta))

    rule.explicit_layouts = True
    return parts.aligned(rule, parts.pointwise_groups)


def _several(rule, op, args, kwargs, metas):
    """An elementwise op with several outputs: each laid out as the first would be."""
    first = rule(lambda *a, **k: op(*a, **k)[0], args, kwargs)
    outs = [first.out.with_dtype(m.dtype) for m in metas]
    return OpSharding(first.in_specs, type(metas)(outs), op)


def _rows_rule(op, ins, meta):
    """Inputs with the same row blocks (:mod:`fshard.ops.rows`): the op runs on them as they
    are; its output has those row blocks."""
    bounds = rows.same_rows(ins)
    if bounds is None or tuple(meta.shape) != tuple(ins[0].shape):
        raise rows.explicit_error(getattr(op, "__name__", str(op)), ins)
    out = rows.rows_layout(ins[0].mesh, bounds, tuple(meta.shape), meta.dtype)
    return OpSharding([None] * len(ins), out)


def like_rule(op, args, kwargs):
    """``zeros_like`` & co.: the input's dims, no pending sum, the op's dtype."""
    (x,) = tensor_inputs(args, kwargs)
    meta = meta_call(op, args, kwargs)
    return OpSharding([None], out_layout(x.mesh, x.dim_axes, (), meta))


#: ``torch.<op>_like`` -> the fill that draws its values (``torch.rand_like(x)`` is
#: ``torch.empty_like(x).uniform_()``, the numbers of ``torch.rand(x.shape)``)
RANDOM_LIKE = {"rand_like": "uniform_", "randn_like": "normal_", "randint_like": "random_"}


def random_like_rule(op, args, kwargs):
    """``torch.rand_like(x)`` & co.: ``x``'s dims, not pending, the op's dtype; every rank
    draws the whole tensor and keeps its block (:mod:`.random`): dense's values for the same
    seed."""
    (x,) = tensor_inputs(args, kwargs)
    if kwargs.get("generator") is not None:
        raise TypeError(f"ShardedArray: torch.{op.__name__}(generator=) is not supported")
    fill = RANDOM_LIKE[op.__name__]
    out = like_rule(op, args, kwargs).out  # zeros_like's layout: x's dims, the op's dtype

    def local(t, *bounds, **k):  # randint_like(x, high) or (x, low, high)
        device = k.get("device") or t.device
        fill_args = (0, *bounds)[-2:] if bounds else ()
        what = f"torch.{op.__name__}"
        drawn = random.whole(out, out.shape, out.dtype, device, fill, fill_args, what=what)
        return random.block_of(out, drawn, device).contiguous()

    return OpSharding([None], out, local)


def _cast_target(op, args, kwargs) -> tuple[torch.dtype | None, torch.device | None]:
    """The dtype and device a ``Tensor.to``/``Tensor.type`` call asks for (``None``: keep)."""
    dtype = kwargs.get("dtype")
    device = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (torch.device, str, int)) and not isinstance(a, bool):
            if op is torch.Tensor.type and isinstance(a, str):  # "torch.DoubleTensor"
                dtype = torch.empty(0).type(a.replace("cuda.", "")).dtype
                device = "cuda" if ".cuda." in a else "cpu"
            else:
                device = a
        elif isinstance(a, BaseLayout):  # x.to(other)
            dtype = a.dtype
    return dtype, None if device is None else torch.device(device)


def cast_rule(op, args, kwargs):
    """``Tensor.to``/``Tensor.type``/``Tensor.type_as``: a dtype cast (pending sums survive
    float -> float; another tensor argument is read for its dtype only); a device argument must
    name the mesh's device (moving shards between devices is a new mesh)."""
    x = args[0]
    dtype, device = _cast_target(op, args, kwargs)
    if x.is_explicit:
        target = dtype or x.dtype
        n_other = len(tensor_inputs(args, kwargs)) - 1
        return OpSharding(
            [None] + [SHAPE_ONLY] * n_other,
            x.with_dtype(target),
            lambda t, *a, **k: t.to(target),
            tensors_only=True,
        )
    if op is torch.Tensor.type and dtype is None and len(args) == 1 and not kwargs:
        return OpSharding([None] * len(tensor_inputs(args, kwargs)), None)  # x.type() -> its name
    if device is not None and not x.mesh.is_abstract:
        here = x.mesh.device()
        if device.type != here.type or (device.index is not None and device != here):
            raise NotImplementedError(
                f"{op.__name__}(device={device}) on a ShardedArray whose mesh lives on {here}: "
                "fshard does not move shards between devices. Build the value on a mesh of "
                f"that device (fs.shard(fs.gather(x).to({str(device)!r}), mesh, spec))"
            )
    meta = torch.empty(x.shape, dtype=x.dtype, device="meta").to(dtype or x.dtype)
    partial = _kept_partial(CAST, [x], args, meta)
    out = out_layout(x.mesh, x.dim_axes, partial, meta)
    # x.to(other) / x.type_as(other) read other's dtype only
    specs = [spec(x.dim_axes, partial)] + [SHAPE_ONLY] * (len(tensor_inputs(args, kwargs)) - 1)
    target = meta.dtype
    return OpSharding(specs, out, lambda t, *a, **k: t.to(target), tensors_only=True)


def _variants(*names, fn=True, method=True, nn=False):
    out = []
    for n in names:
        if fn and hasattr(torch, n):
            out.append(getattr(torch, n))
        if method and hasattr(torch.Tensor, n):
            out.append(getattr(torch.Tensor, n))
        if nn and hasattr(F, n):
            out.append(getattr(F, n))
        if hasattr(torch.special, n) and fn:
            out.append(getattr(torch.special, n))
    return out


UNARY_NONLINEAR = [
    "exp",
    "exp2",
    "expm1",
    "log",
    "log2",
    "log10",
    "log1p",
    "sqrt",
    "rsqrt",
    "abs",
    "sign",
    "sin",
    "cos",
    "tan",
    "tanh",
    "sigmoid",
    "relu",
    "erf",
    "erfc",
    "reciprocal",
    "square",
    "floor",
    "ceil",
    "round",
    "trunc",
    "frac",
    "sinh",
    "cosh",
    "asin",
    "acos",
    "atan",
    "logical_not",
    "bitwise_not",
    "isnan",
    "isinf",
    "isfinite",
    "nan_to_num",
    "logit",
    "acosh",
    "asinh",
    "atanh",
    "arccosh",
    "i0",
    "sinc",
    "sgn",
    "signbit",
    "angle",
    "isposinf",
    "isneginf",
    "isreal",
    "digamma",
    "erfinv",
    "lgamma",
    "mvlgamma",
    "polygamma",
    "fill",
    "cfloat",
    "cdouble",
]
#: torch.special's own pointwise functions (the ones torch also has are listed above).
SPECIAL = (
    "i0e i1 i1e ndtr ndtri log_ndtr erfcx entr airy_ai bessel_j0 bessel_j1 bessel_y0 "
    "bessel_y1 modified_bessel_i0 modified_bessel_i1 modified_bessel_k0 modified_bessel_k1 "
    "scaled_modified_bessel_k0 scaled_modified_bessel_k1 spherical_bessel_j0 xlog1py zeta "
    "chebyshev_polynomial_t chebyshev_polynomial_u chebyshev_polynomial_v "
    "chebyshev_polynomial_w shifted_chebyshev_polynomial_t shifted_chebyshev_polynomial_u "
    "shifted_chebyshev_polynomial_v shifted_chebyshev_polynomial_w hermite_polynomial_h "
    "hermite_polynomial_he laguerre_polynomial_l legendre_polynomial_p"
)
NN_UNARY = (
    "gelu silu relu tanh sigmoid softplus mish elu leaky_relu relu6 hardtanh logsigmoid "
    "hardswish hardsigmoid celu selu softsign tanhshrink threshold softshrink hardshrink"
)
BINARY_NONLINEAR = [
    "pow",
    "maximum",
    "minimum",
    "fmax",
    "fmin",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "remainder",
    "fmod",
    "floor_divide",
    "atan2",
    "logical_and",
    "logical_or",
    "logical_xor",
    "bitwise_and",
    "bitwise_or",
    "bitwise_xor",
    "where",
    "clamp",
    "clip",
    "clamp_min",
    "clamp_max",
    "lerp",
    "masked_fill",
    "hypot",
    "copysign",
    "addcmul",
    "addcdiv",
    "polar",
    "complex",
    "heaviside",
    "nextafter",
    "ldexp",
    "logaddexp",
    "logaddexp2",
    "xlogy",
    "float_power",
    "igamma",
    "igammac",
    "isclose",
    "frexp",
]
OPERATORS_NONLINEAR = [
    "__pow__",
    "__rpow__",
    "__abs__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    "__eq__",
    "__ne__",
    "__and__",
    "__or__",
    "__xor__",
    "__invert__",
    "__floordiv__",
    "__rfloordiv__",
    "__mod__",
    "__rmod__",
    "__rtruediv__",
    "__rand__",
    "__ror__",
    "__rxor__",
    "__lshift__",
    "__rshift__",
    "__rlshift__",
    "__rrshift__",
]
ADDITIVE_OPS = [
    "add",
    "sub",
    "subtract",
    "neg",
    "negative",
    "positive",
    "clone",
    "detach",
    "contiguous",
    "conj",
    "conj_physical",
    "resolve_conj",
    "resolve_neg",
    "real",
    "deg2rad",
    "rad2deg",
    "alias_copy",
    "rsub",
]
ADDITIVE_OPERATORS = ["__add__", "__radd__", "__sub__", "__rsub__", "__neg__", "__pos__"]
CAST_METHODS = ["float", "double", "half", "bfloat16"]
INT_CASTS = ["long", "int", "short", "bool", "byte", "char"]
LIKE = ["zeros_like", "ones_like", "empty_like", "full_like"]


def _register():
    for n in UNARY_NONLINEAR + BINARY_NONLINEAR:
        for op in _variants(n):
            register_rule(op, elementwise_rule(NONLINEAR))
    for n in SPECIAL.split():
        register_rule(getattr(torch.special, n), elementwise_rule(NONLINEAR))
    for n in NN_UNARY.split():
        for op in _variants(n, fn=False, method=False, nn=True):
            register_rule(op, elementwise_rule(NONLINEAR))
    for n in OPERATORS_NONLINEAR:
        if hasattr(torch.Tensor, n):
            register_rule(getattr(torch.Tensor, n), elementwise_rule(NONLINEAR))
    for n in ADDITIVE_OPS:
        for op in _variants(n):
            register_rule(op, elementwise_rule(ADDITIVE))
    for n in ("real", "data"):  # x.real of a real value (fnet), x.data: a detached alias (ibert)
        register_rule(getattr(torch.Tensor, n).__get__, elementwise_rule(ADDITIVE))
    for n in ADDITIVE_OPERATORS:
        if hasattr(torch.Tensor, n):
            register_rule(getattr(torch.Tensor, n), elementwise_rule(ADDITIVE))
    for op in _variants("mul", "multiply") + [torch.Tensor.__mul__, torch.Tensor.__rmul__]:
        register_rule(op, elementwise_rule(SCALE))
    for op in _variants("div", "divide", "true_divide") + [torch.Tensor.__truediv__]:
        register_rule(op, elementwise_rule(DIVIDE))
    for n in CAST_METHODS:
        register_rule(getattr(torch.Tensor, n), elementwise_rule(CAST))
    cast_rule.explicit_layouts = True
    cast = parts.aligned(cast_rule, parts.pointwise_groups)
    register_rule(torch.Tensor.to, cast, aliases=(torch.Tensor.type, torch.Tensor.type_as))
    for n in INT_CASTS:
        register_rule(getattr(torch.Tensor, n), elementwise_rule(NONLINEAR))
    for n in LIKE:
        register_rule(getattr(torch, n), parts.aligned(like_rule, parts.pointwise_groups))
    for n in RANDOM_LIKE:
        register_rule(getattr(torch, n), random_like_rule)


_register()
