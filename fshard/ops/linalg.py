"""Contraction rules: matmul, mm, bmm, F.linear, addmm, einsum — one engine over index letters.

Every operand dim gets an index letter (broadcast size-1 dims get none and must be unsplit).
Letters are assigned mesh axes greedily, largest operand first (resharding the biggest operand
is what costs most), a mesh axis at most once; every operand is resharded to carry its letters'
axes (replicated operands are sliced locally). A letter split over axes ``A`` that is summed
over (contracted) makes the output *partial* over ``A``; kept letters keep their axes. One
partial operand keeps its pending sum (the op is linear in it); further partial operands are
reduced first. Additive terms (the bias of ``F.linear``, ``addmm``'s input) take the output's
layout, pending sum included (zeroed on all but one rank: no communication).

Example:
    >>> h = F.linear(x, w1)   # w1 P("tp", None): h is P(None, "tp"), no communication  # doctest: +SKIP
    >>> y = F.linear(h, w2)   # w2 P(None, "tp"): y is partial over "tp"  # doctest: +SKIP
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..spec import BaseLayout, Layout
from . import parts, rows
from ._common import meta_call, out_layout, spec
from .binding import bind
from .contraction import contract
from .registry import OpSharding, register_rule, tensor_inputs
from .whole import batched_rule, register_table

__all__ = ["contract", "matmul_letters"]


def matmul_letters(a_shape, b_shape):
    """Index letters of ``a @ b`` (torch.matmul broadcasting): ``(a_letters, b_letters, out)``."""
    la, lb = len(a_shape), len(b_shape)
    if la == 0 or lb == 0:
        raise ValueError("matmul: both arguments need at least 1 dimension")
    a_batch = tuple(a_shape[:-2]) if la >= 2 else ()
    b_batch = tuple(b_shape[:-2]) if lb >= 2 else ()
    nb = max(len(a_batch), len(b_batch))
    out_batch = torch.broadcast_shapes(a_batch, b_batch)

    def batch_letters(batch):
        off = nb - len(batch)
        return [f"b{off + i}" if s == out_batch[off + i] else None for i, s in enumerate(batch)]

    a = batch_letters(a_batch) + (["n", "k"] if la >= 2 else ["k"])
    b = batch_letters(b_batch) + (["k", "m"] if lb >= 2 else ["k"])
    out = [f"b{i}" for i in range(nb)] + (["n"] if la >= 2 else []) + (["m"] if lb >= 2 else [])
    return a, b, out


def _additive_spec(term: Layout, out_dims, out_shape, partial):
    off = len(out_shape) - term.ndim
    dims = [
        out_dims[off + d] if term.shape[d] == out_shape[off + d] else () for d in range(term.ndim)
    ]
    return spec(dims, partial)


def _rows(op, args, kwargs, row: Layout):
    """An explicit row-block operand (:mod:`fshard.ops.rows`): row-wise when ``row`` is the
    operand whose rows the output keeps, else the registry's explicit-layout error."""
    ins = tensor_inputs(args, kwargs)
    sharding = None
    if row.is_explicit:
        sharding = rows.row_wise_rule(op, ins, row, meta_call(op, args, kwargs))
    if sharding is None:
        raise rows.explicit_error(getattr(op, "__name__", str(op)), ins)
    return sharding


def matmul_rule(op, args, kwargs):
    ins = tensor_inputs(args, kwargs)
    if len(ins) != 2:
        raise TypeError(f"{op.__name__}: expected two tensor operands")
    swapped = op is torch.Tensor.__rmatmul__
    a, b = (ins[1], ins[0]) if swapped else (ins[0], ins[1])
    if a.is_explicit or b.is_explicit:
        return _rows(op, args, kwargs, a)
    la, lb, lo = matmul_letters(a.shape, b.shape)
    (sa, sb), out_dims, partial = contract([a, b], [la, lb], lo)
    meta = meta_call(op, args, kwargs)
    specs = [sb, sa] if swapped else [sa, sb]
    return OpSharding(specs, out_layout(a.mesh, out_dims, partial, meta))


def linear_rule(op, args, kwargs):
    bound = bind(op, args, kwargs)
    x, w, bias = bound["input"], bound["weight"], bound["bias"]
    if any(t.is_explicit for t in tensor_inputs(args, kwargs)):
        return _rows(op, args, kwargs, x)
    lx = [f"b{i}" for i in range(x.ndim - 1)] + ["k"]
    lw = ["m", "k"] if w.ndim == 2 else ["k"]
    lo = lx[:-1] + (["m"] if w.ndim == 2 else [])
    # the weight keeps the split its plan gave it; the activation moves (Megatron, and
    # sequence parallelism's all_gather of a sequence-split input before a column layer)
    (sx, sw), out_dims, partial = contract([x, w], [lx, lw], lo, first=1)
    meta = meta_call(op, args, kwargs)
    specs = {"input": sx, "weight": sw}
    if isinstance(bias, BaseLayout):
        specs["bias"] = _additive_spec(bias, out_dims, tuple(meta.shape), partial)
    return OpSharding(specs, out_layout(x.mesh, out_dims, partial, meta))


def addmm_rule(op, args, kwargs):
    bound = bind(op, args, kwargs)
    c, a, b = bound["input"], bound["mat1"], bound["mat2"]
    if any(t.is_explicit for t in tensor_inputs(args, kwargs)):
        return _rows(op, args, kwargs, a)
    (sa, sb), out_dims, partial = contract([a, b], [["n", "k"], ["k", "m"]], ["n", "m"])
    meta = meta_call(op, args, kwargs)
    specs = {"input": _additive_spec(c, out_dims, tuple(meta.shape), partial), "mat1": sa}
    specs["mat2"] = sb
    return OpSharding(specs, out_layout(a.mesh, out_dims, partial, meta))


def baddbmm_rule(op, args, kwargs):
    """``baddbmm(input, batch1, batch2, beta=, alpha=)``: a batched ``addmm``."""
    bound = bind(op, args, kwargs)
    c, a, b = bound["input"], bound["batch1"], bound["batch2"]
    letters = [["b", "n", "k"], ["b", "k", "m"]]
    (sa, sb), out_dims, partial = contract([a, b], letters, ["b", "n", "m"])
    meta = meta_call(op, args, kwargs)
    sc = _additive_spec(c, out_dims, tuple(meta.shape), partial)
    specs = {"input": sc, "batch1": sa, "batch2": sb}
    return OpSharding(specs, out_layout(a.mesh, out_dims, partial, meta))


def outer_rule(op, args, kwargs):
    """``outer(a, b)``: ``einsum("i,j->ij")``."""
    a, b = tensor_inputs(args, kwargs)
    (sa, sb), out_dims, partial = contract([a, b], [["i"], ["j"]], ["i", "j"])
    meta = meta_call(op, args, kwargs)
    return OpSharding([sa, sb], out_layout(a.mesh, out_dims, partial, meta))


def parse_einsum(eq: str, shapes) -> tuple[list[list[str | None]], list[str]]:
    """Letters per operand dim (``None`` for broadcast size-1 ellipsis dims) and output letters."""
    eq = eq.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        raise ValueError(f"einsum: equation {eq!r} has {len(terms)} operands, got {len(shapes)}")
    n_ell = max(
        (len(s) - len(t.replace("...", "")) for t, s in zip(terms, shapes) if "..." in t),
        default=0,
    )
    ell = [f"e{i}" for i in range(n_ell)]
    ell_sizes = [1] * n_ell
    for t, s in zip(terms, shapes):
        if "..." in t:
            k = len(s) - len(t.replace("...", ""))
            start = t.index("...")
            for i in range(k):
                ell_sizes[n_ell - k + i] = max(ell_sizes[n_ell - k + i], s[start + i])
    letters = []
    for t, s in zip(terms, shapes):
        ls: list[str | None] = []
        i = 0
        while i < len(t):
            if t.startswith("...", i):
                k = len(s) - len(t.replace("...", ""))
                for j in range(k):
                    e = n_ell - k + j
                    ls.append(ell[e] if s[len(ls)] == ell_sizes[e] else None)
                i += 3
            else:
                ls.append(t[i])
                i += 1
        letters.append(ls)
    if arrow:
        out = []
        i = 0
        while i < len(rhs):
            if rhs.startswith("...", i):
                out.extend(ell)
                i += 3
            else:
                out.append(rhs[i])
                i += 1
    else:
        flat = [c for t in terms for c in t.replace("...", "")]
        out = ell + sorted(c for c in set(flat) if flat.count(c) == 1)
    return letters, out


def einsum_rule(op, args, kwargs):
    eq = args[0]
    if not isinstance(eq, str):
        raise TypeError("einsum: the first argument must be the equation string")
    ins = tensor_inputs(args, kwargs)
    letters, out = parse_einsum(eq, [x.shape for x in ins])
    specs, out_dims, partial = contract(ins, letters, out)
    meta = meta_call(op, args, kwargs)
    return OpSharding(specs, out_layout(ins[0].mesh, out_dims, partial, meta))


def _register():
    for rule in (matmul_rule, linear_rule, addmm_rule):
        rule.explicit_layouts = True
    matmul = parts.aligned(matmul_rule, parts.linear_groups)
    for op in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__):
        register_rule(op, matmul)
    register_rule(torch.Tensor.__rmatmul__, matmul)
    for op in (torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm):
        register_rule(op, matmul)
    register_rule(F.linear, parts.aligned(linear_rule, parts.linear_groups))
    addmm = parts.aligned(addmm_rule, parts.linear_groups)
    register_rule(torch.addmm, addmm, aliases=(torch.Tensor.addmm,))
    register_rule(torch.einsum, einsum_rule)
    register_rule(torch.baddbmm, baddbmm_rule, aliases=(torch.Tensor.baddbmm,))
    for op in (torch.outer, torch.Tensor.outer, torch.ger, torch.Tensor.ger):
        register_rule(op, outer_rule)
    for op in (torch.mv, torch.Tensor.mv, torch.dot, torch.Tensor.dot, torch.vdot):
        register_rule(op, matmul_rule)
    register_rule(torch.Tensor.vdot, matmul_rule)
    register_table({batched_rule(2): MATRIX_FUNCTIONS, batched_rule(1): "linalg.vander"})


#: Functions of the matrices in the last two dims, batched over the leading ones
#: (:func:`fshard.ops.whole.batched_rule`: the matrices are whole, batch dims stay split).
MATRIX_FUNCTIONS = (
    "det logdet inverse cholesky cholesky_inverse cholesky_solve qr svd pinverse matrix_exp "
    "matrix_power ormqr lu_solve lu_unpack triangular_solve cdist linalg.det "
    "linalg.slogdet slogdet linalg.inv linalg.inv_ex linalg.cholesky linalg.cholesky_ex "
    "linalg.eig linalg.eigvals linalg.eigh linalg.eigvalsh linalg.householder_product "
    "linalg.ldl_factor linalg.ldl_factor_ex linalg.ldl_solve "
    "linalg.matrix_power linalg.matrix_exp linalg.qr linalg.lu_factor linalg.lu_factor_ex "
    "linalg.lu linalg.lu_solve linalg.solve linalg.solve_ex linalg.solve_triangular "
    "linalg.matrix_rank linalg.pinv linalg.svd linalg.svdvals linalg.diagonal"
)


_register()
