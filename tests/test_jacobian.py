"""Forward-mode Jacobians with respect to sharded values (issue 26 item 3): ``fs.jacfwd`` /
``fs.hessian`` equal torch.func's on the dense tensors for every layout (split, uneven,
replicated, partial), and torch.func's own ``jacfwd`` / ``hessian``, whose basis would be each
rank's local block, refuse a split or partial argument instead of returning a wrong Jacobian."""

import pytest
import torch

import fshard as fs

SPECS = [fs.P("x"), fs.P(None, "x"), fs.P(), fs.P(partial="x"), fs.P("x", partial=())]


def jacobians_rank_fn():
    mesh = fs.Mesh.create((2,), ("x",))
    t = (torch.arange(12.0).reshape(3, 4) / 7 - 0.5).double()  # 3 rows over 2 ranks: uneven
    w = torch.linspace(-1, 1, 4, dtype=torch.float64)
    out = []
    for spec in SPECS:
        x = fs.shard(t, mesh, spec)
        got = {}
        # a replicated (gathered) output and a sharded output
        got["plain"] = fs.jacfwd(lambda x: fs.gather((x * x).sum(0) * w))(x)
        jo = fs.jacfwd(lambda x: torch.sin(x) * 2)(x)
        got["sharded_spec"] = str(jo.spec), tuple(jo.shape)
        got["sharded"] = fs.gather(jo)
        h = fs.hessian(lambda x: fs.gather((x**3 * w).sum()))(x)
        got["hessian_spec"] = str(h.spec)
        got["hessian"] = fs.gather(h)
        # two arguments (a dict with a sharded and a replicated leaf, and a tensor), has_aux
        params = {"a": x, "b": fs.shard(w, mesh, fs.P())}

        def two(ps, v):
            y = fs.gather((ps["a"] * ps["b"]).sum(1)) * v.sum()
            return y, y.detach() + 1

        (ja, jv), aux = fs.jacfwd(two, argnums=(0, 1), has_aux=True)(params, w)
        got["two"] = (
            ja["a"],
            fs.gather(ja["b"]) if isinstance(ja["b"], fs.ShardedArray) else ja["b"],
            jv,
            aux,
        )
        refused = []
        for transform in (torch.func.jacfwd, torch.func.hessian):
            try:
                j = transform(lambda x: fs.gather((x * x * w).sum()))(x)
                got[transform.__name__] = fs.gather(j)  # x's layout, as a gradient
                refused.append(False)
            except (NotImplementedError, TypeError) as e:
                # never a wrong number: refused, naming the fix
                assert "fs.jacfwd" in str(e) and "fs.hessian" in str(e), e
                refused.append(type(e).__name__)
        got["refused"] = refused
        out.append(got)
    return out


def test_jacfwd_and_hessian_of_sharded_values_equal_dense(world2):
    t = (torch.arange(12.0).reshape(3, 4) / 7 - 0.5).double()
    w = torch.linspace(-1, 1, 4, dtype=torch.float64)
    dense = torch.func.jacfwd(lambda t: (t * t).sum(0) * w)(t)
    dense_sharded = torch.func.jacfwd(lambda t: torch.sin(t) * 2)(t)
    dense_h = torch.func.hessian(lambda t: (t**3 * w).sum())(t)

    def two(ps, v):
        y = (ps["a"] * ps["b"]).sum(1) * v.sum()
        return y, y + 1

    (dja, djv), daux = torch.func.jacfwd(two, argnums=(0, 1), has_aux=True)({"a": t, "b": w}, w)
    for rank_out in world2.run(jacobians_rank_fn):
        for spec, got in zip(SPECS, rank_out):
            torch.testing.assert_close(got["plain"], dense)
            torch.testing.assert_close(got["sharded"], dense_sharded)
            torch.testing.assert_close(got["hessian"], dense_h)
            ja, jb, jv, aux = got["two"]
            torch.testing.assert_close(ja if not isinstance(ja, fs.ShardedArray) else ja, dja["a"])
            torch.testing.assert_close(jb, dja["b"])
            torch.testing.assert_close(jv, djv)
            torch.testing.assert_close(aux, daux)
            # the output's layout on the leading dims, replicated over the argument's dims
            # (sin reduces a pending sum first: a partial argument gives a replicated output)
            lay = fs.Layout(fs.Mesh.abstract((2,), ("x",)), spec, (3, 4))
            dims = [d[0] if d else None for d in lay.dim_axes] if not spec.partial else [None] * 2
            # (a layout prints its spec canonically: fshard.spec.canonical_spec)
            want = fs.spec.canonical_spec(fs.P(*dims, None, None), lay.mesh.axis_names)
            assert got["sharded_spec"] == (str(want), (3, 4, 3, 4))
            if spec.partial or any(spec.dims):  # torch.func's basis would be the local block
                assert got["refused"] == ["NotImplementedError"] * 2, spec
            else:  # replicated: torch.func.jacfwd is right; its hessian nests a ShardedArray
                assert got["refused"] == [False, "TypeError"], spec
                torch.testing.assert_close(
                    got["jacfwd"], torch.func.jacfwd(lambda t: (t * t * w).sum())(t)
                )


def test_jacfwd_argument_errors():
    with pytest.raises(TypeError, match="argnums"):
        fs.jacfwd(lambda x: x, argnums="0")
    with pytest.raises(TypeError, match="callable"):
        fs.hessian(3)
    with pytest.raises(ValueError, match="out of range"):
        fs.jacfwd(lambda x: x, argnums=2)(torch.ones(2))
