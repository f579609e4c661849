"""Rule selection in one process (issue 28 item 6's lane): the specs an op rule asks of its
inputs and the layout it gives its output, on an abstract 2x2 mesh, against what the layout
semantics require (DESIGN §4: a contraction over a split dim is a pending sum, a linear op keeps
a pending sum, a nonlinear one needs it reduced)."""

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from fshard.ops.registry import rule_for

M = fs.Mesh.abstract((2, 2), ("dp", "tp"))


def L(spec, shape):
    return fs.Layout(M, spec, shape)


P = fs.P
CASES = {
    # op, args, the input specs the rule asks for, the output layout's spec and shape
    "column-parallel linear": (
        F.linear, (L(P("dp"), (8, 6)), L(P("tp", None), (4, 6))),
        {"input": P("dp"), "weight": P("tp", None)}, P("dp", "tp"), (8, 4),
    ),
    "row-parallel linear": (
        F.linear, (L(P("dp", None, "tp"), (8, 5, 6)), L(P(None, "tp"), (4, 6))),
        {"input": P("dp", None, "tp"), "weight": P(None, "tp")},
        P("dp", None, None, partial="tp"), (8, 5, 4),
    ),
    "sequence-parallel input to a column linear keeps its major axis": (
        # the sequence over (dp, tp) (a cp chunk split over tp): only tp, the weight's, gathered
        F.linear, (L(P(None, ("dp", "tp")), (2, 8, 6)), L(P("tp", None), (4, 6))),
        {"input": P(None, "dp"), "weight": P("tp", None)}, P(None, "dp", "tp"), (2, 8, 4),
    ),
    "matmul over a split contraction": (
        torch.matmul, (L(P(None, "tp"), (8, 6)), L(P("tp", None), (6, 4))),
        [P(None, "tp"), P("tp", None)], P(None, None, partial="tp"), (8, 4),
    ),
    "sum over a split dim": (
        torch.sum, (L(P("dp", "tp"), (8, 6)), 1), [P("dp", "tp")], P("dp", partial="tp"), (8,),
    ),
    "mean keepdim over a split dim": (
        torch.mean, (L(P("dp", "tp"), (8, 6)), 0, True),
        [P("dp", "tp")], P(None, "tp", partial="dp"), (1, 6),
    ),
    "softmax along a split dim": (
        torch.softmax, (L(P("dp", "tp"), (8, 6)), 0), [P("dp", "tp")], P("dp", "tp"), (8, 6),
    ),
    "transpose": (
        torch.transpose, (L(P("dp", "tp"), (8, 6)), 0, 1), [None], P("tp", "dp"), (6, 8),
    ),
    "add keeps a pending sum": (
        torch.add, (L(P(partial="tp"), (8, 6)), L(P(partial="tp"), (8, 6))),
        [P(None, None, partial="tp")] * 2, P(None, None, partial="tp"), (8, 6),
    ),
    "mul reduces pending sums": (
        torch.mul, (L(P(partial="tp"), (8, 6)), L(P(partial="tp"), (8, 6))),
        [P(None, None)] * 2, P(None, None), (8, 6),
    ),
    "gelu reduces a pending sum": (
        F.gelu, (L(P("dp", partial="tp"), (8, 6)),), [P("dp", None)], P("dp", None), (8, 6),
    ),
    "nansum over a split dim leaves a pending sum": (
        torch.nansum, (L(P("dp", "tp"), (8, 6)), 1), [P("dp", "tp")], P("dp", partial="tp"),
        (8,),
    ),
    "count_nonzero reduces a pending input first": (
        torch.count_nonzero, (L(P("dp", partial="tp"), (8, 6)), 0), [P("dp", None)],
        P(None, partial="dp"), (6,),
    ),
    "prod gathers the dim it reduces, keeps the others": (
        torch.prod, (L(P("dp", "tp"), (8, 6)), 1), [P("dp", None)], P("dp"), (8,),
    ),
    "batched det: matrices whole, the batch stays split": (
        torch.linalg.det, (L(P("dp", "tp", None), (4, 6, 6)),), [P("dp", None, None)], P("dp"),
        (4,),
    ),
    "batched solve: a right-hand side of the same batch shares its axes": (
        torch.linalg.solve, (L(P("dp"), (4, 6, 6)), L(P(None, "tp"), (4, 6, 2))),
        [P("dp", None, None), P("dp", None, None)], P("dp", None, None), (4, 6, 2),
    ),
    "batched solve: a right-hand side with more dims gathers the batch": (
        torch.linalg.solve, (L(P("dp"), (4, 6, 6)), L(P(), (3, 4, 6, 2))),
        [P(None, None, None), P(None, None, None, None)], P(None, None, None, None), (3, 4, 6, 2),
    ),
    "a dim whose block would be empty is made whole": (
        F.pixel_shuffle, (L(P("dp"), (1, 4, 2, 2)), 2), [P(None, None, None, None)],
        P(None, None, None, None), (1, 1, 4, 4),
    ),
    "kl_div batchmean: a pending sum over the batch": (
        F.kl_div, (L(P("dp"), (8, 6)), L(P("dp"), (8, 6))), [P("dp", None)] * 2,
        P(partial="dp"), (),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_rule_chooses_the_layouts_the_semantics_require(case):
    op, args, in_specs, out_spec, out_shape = CASES[case]
    kwargs = {"reduction": "batchmean"} if op is F.kl_div else {}
    sharding = rule_for(op)(op, args, kwargs)
    got = sharding.in_specs
    if isinstance(in_specs, dict):
        got = {k: got[k] for k in in_specs}
    assert (got if isinstance(got, dict) else list(got)) == in_specs
    assert sharding.out.mesh == M and sharding.out.spec == out_spec
    assert tuple(sharding.out.shape) == out_shape
