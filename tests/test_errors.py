"""Bad input: each case checks the error type and the words that tell the user the fix."""

import pytest
import torch
import torch.distributed as dist

import fshard as fs

M1 = fs.Mesh.abstract((2,), ("x",))
M2 = fs.Mesh.abstract((2, 2), ("x", "y"))

LOCAL_CASES = [
    (lambda: fs.P("x", "x"), ValueError, ["'x'", "more than once"]),
    (lambda: fs.P("x", partial="x"), ValueError, ["'x'", "more than once"]),
    (lambda: fs.P(1), TypeError, ["entry 0", "axis name"]),
    (lambda: fs.P(""), ValueError, ["empty axis name"]),
    (lambda: fs.P(partial=(3,)), TypeError, ["partial"]),
    (lambda: fs.Layout(M1, fs.P("z"), (4,)), ValueError, ["'z'", "not an axis", "('x',)"]),
    (lambda: fs.Layout(M1, fs.P(None, "x"), (4,)), ValueError, ["2 entries", "1 dims"]),
    (lambda: fs.Layout(M1, fs.P(), (4, -1)), ValueError, ["non-negative", "(4, -1)"]),
    (lambda: fs.Layout(M1, fs.P(), (1.5,)), TypeError, ["tuple of ints", "1.5"]),
    (lambda: fs.Layout(M1, ("x",), (4,)), TypeError, ["fshard.P"]),
    (lambda: fs.Layout(M1, fs.P(), (4,), dtype="float"), TypeError, ["torch.dtype"]),
    (lambda: fs.Mesh.abstract((2, 2), ("a", "a")), ValueError, ["'a'", "unique"]),
    (lambda: fs.Mesh.abstract((2,), ("",)), ValueError, ["non-empty"]),
    (lambda: fs.Mesh.abstract((2, 2), ("a",)), ValueError, ["one name per axis"]),
    (lambda: fs.Mesh.abstract((0,), ("a",)), ValueError, ["positive ints"]),
    (lambda: M1.rank, ValueError, ["abstract"]),
    (lambda: M2.size("q"), ValueError, ["'q'", "('x', 'y')"]),
    (lambda: fs.ShardMetadata((0,), (1, 2), "rank:0/cpu"), ValueError, ["1 entries", "2"]),
    (lambda: fs.ShardMetadata((-1,), (2,), "rank:0/cpu"), ValueError, ["shard_offsets", ">= 0"]),
    (lambda: fs.ShardMetadata((0,), (-2,), "rank:0/cpu"), ValueError, ["shard_sizes", ">= 0"]),
    (lambda: fs.plan("layout", fs.P()), TypeError, ["fshard.Layout"]),
    (lambda: fs.plan(fs.Layout(M1, fs.P(), (2,)), "x"), TypeError, ["fshard.P"]),
    (lambda: fs.lax.psum(torch.ones(2), "x"), ValueError, ["shard_map", "mesh="]),
    (lambda: fs.shard(torch.ones(2), M1, fs.P("x")), ValueError, ["abstract", "Mesh.create"]),
    (lambda: fs.Mesh.create((2,), ("x",)), RuntimeError, ["process group", "Mesh.abstract"]),
]


@pytest.mark.parametrize("make,exc,words", LOCAL_CASES)
def test_bad_input_local(make, exc, words):
    with pytest.raises(exc) as info:
        make()
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def bad_input_on_ranks():
    """Cases that need a real mesh; every one is caught before any collective."""
    mesh = fs.Mesh.create((2,), ("x",))
    x = fs.shard(torch.arange(10.0).reshape(5, 2), mesh, fs.P("x"))
    view = x[1:]  # live while the cases run: in-place forms on x are refused
    cases = [
        (lambda: fs.Mesh.create((3,), ("x",)), ValueError, ["3 ranks", "world size is 2"]),
        (
            lambda: fs.from_local(torch.ones(1, 2), mesh, fs.P("x"), shape=(5, 2)),
            ValueError,
            ["(1, 2)", f"gives this rank {(3, 2) if dist.get_rank() == 0 else (2, 2)}"],
        ),
        (
            lambda: fs.from_local(torch.ones(3, 2), mesh, fs.P("x")),
            ValueError,
            ["shape=", "never infers"],
        ),
        (lambda: fs.from_local([1.0], mesh, fs.P()), TypeError, ["torch.Tensor", "list"]),
        (lambda: fs.shard([1, 2], mesh, fs.P()), TypeError, ["torch.Tensor", "list"]),
        (lambda: fs.shard(torch.ones(2), mesh, "x"), TypeError, ["fshard.P"]),
        (lambda: fs.shard(torch.ones(2), mesh, fs.P(), src=7), ValueError, ["src", "(0, 1)"]),
        (lambda: fs.gather(x, dst=5), ValueError, ["dst", "(0, 1)"]),
        (lambda: fs.gather(torch.ones(2)), TypeError, ["ShardedArray"]),
        (lambda: fs.reshard(x, "x"), TypeError, ["fshard.P"]),
        (lambda: fs.reshard(x, fs.P("y")), ValueError, ["'y'", "not an axis"]),
        (lambda: fs.reshard(x, fs.P(None, None, "x")), ValueError, ["3 entries", "2 dims"]),
        (  # every leaf whose spec does not fit is named by its key path, before any collective
            lambda: fs.reshard(
                {"a": x, "b": [x, x]}, {"a": fs.P("y"), "b": [fs.P(), fs.P(None, None, "x")]}
            ),
            ValueError,
            ["(2 leaves)", "x['a']: spec P('y')", "not an axis", "x['b'][1]: spec P(None, None"],
        ),
        (
            lambda: fs.reshard({"a": x, "b": 3, "c": torch.ones(1)}, fs.P()),
            TypeError,
            ["(2 leaves)", "x['b']: got int", "x['c']: got Tensor", "fs.shard"],
        ),
        (lambda: setattr(x, "local", torch.ones(1)), TypeError, ["immutable", "fs.reshard"]),
        (lambda: (view, x.add_(1)), TypeError, ["in-place", "live value", "x.add("]),
        (lambda: x.__setitem__(0, 1.0), TypeError, ["item assignment", ".at[idx].set(v)"]),
        (lambda: bool(x), TypeError, ["gather"]),
        (lambda: fs.lax.all_gather(torch.ones(2), "x", mesh=mesh, to="both"), ValueError, ["to"]),
        (
            lambda: fs.lax.all_gather(torch.ones(2), "x", mesh=mesh, sizes=(1, 2, 3)),
            ValueError,
            ["3 entries"],
        ),
        (
            lambda: fs.lax.psum_scatter(torch.ones(3), "x", mesh=mesh),
            ValueError,
            ["divisible", "sizes="],
        ),
        (
            lambda: fs.lax.ppermute(torch.ones(2), "x", [(0, 1), (1, 1)], mesh=mesh),
            ValueError,
            ["once"],
        ),
        (lambda: fs.lax.psum(torch.ones(2), "q", mesh=mesh), ValueError, ["'q'"]),
        (lambda: fs.zeros((4,), mesh, fs.P(partial="x")), ValueError, ["partial"]),
        (lambda: fs.randn((4,), mesh, fs.P(), generator=3), TypeError, ["torch.Generator"]),
    ]
    for i, (make, exc, words) in enumerate(cases):
        try:
            make()
        except exc as e:
            for w in words:
                assert w in str(e), (i, w, str(e))
        else:
            raise AssertionError(f"case {i} did not raise {exc.__name__}")
    # A tree is checked whole before any leaf moves: the valid first leaf is not resharded.
    with fs.debug.comm_log() as log:
        try:
            fs.reshard({"a": x, "b": x}, {"a": fs.P(), "b": fs.P("y")})
        except ValueError as e:
            assert "x['b']: spec P('y')" in str(e) and "x['a']" not in str(e), str(e)
        else:
            raise AssertionError("reshard of a bad tree did not raise")
    assert log == [], log
    # The world is still healthy: no rank was left inside a collective.
    assert torch.equal(fs.gather(x), torch.arange(10.0).reshape(5, 2))
    return len(cases)


def test_bad_input_on_ranks(world2):
    assert world2.run(bad_input_on_ranks) == [25, 25]
