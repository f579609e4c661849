"""Context parallelism: attention over q/k/v split on the sequence dim across a mesh axis.

Two forms, pure functions of this rank's local blocks ``(batch..., heads, seq/cp, head_dim)``,
called inside :func:`fshard.shard_map` (or any body where ``axis`` names a manual axis):

- :func:`ring_attention` (Liu et al. 2023, Brandon et al. 2023's striped/zigzag balance): the
  key/value block travels round the ring with :func:`fshard.lax.ppermute_start` (the next
  block's transfer is on the wire while this block is computed); each block gives an
  ``(out, lse)`` pair merged by log-sum-exp (online softmax). Differentiated once in reverse
  mode (``.backward()``, ``torch.func.grad``, :func:`fshard.value_and_grad`) it is one
  autograd Function whose backward overlaps its transfers too (flash attention's backward per
  block against the merged log-sum-exp; a block's key/value gradient travels back round the
  ring, each step's sum put on the wire before the next block's gradients are computed), and
  keeps the received blocks instead of each block's probabilities. There each block runs on
  CPU's fused flash attention kernel (``aten._scaled_dot_product_flash_attention_for_cpu``,
  which returns the rows' log-sum-exp; its backward kernel is called with the merged output and
  log-sum-exp, as torch's ``_templated_ring_attention``), causal chunk pairs cut so the kernel's
  ``is_causal`` skips the masked half (each causal square cut in halves down to 128-token
  squares, as the kernel skips masked keys only in blocks of 512), the blocks' outputs merged
  and their gradients summed in place; on other devices (CUDA: not wired, untested here) and
  dtypes the blocks are matmuls. Under other transforms
  (``vmap``, ``jvp``, grad of grad, ``torch.compile``), where a transfer cannot run ahead, for
  an eager ``create_graph=True`` backward, and under a ``torch.func`` grad level whose inputs a
  plain autograd graph holds (``fs.value_and_grad`` of a function of ``fs.value_and_grad``'s
  gradient: the outer one differentiates the inner one's gradient), the ring is differentiated
  op by op (each ppermute's transpose is the inverse rotation): every composition of the plain
  ops holds.
- :func:`ulysses_attention` (DeepSpeed-Ulysses): one all_to_all turns heads-split-sequence-
  whole into sequence-split-heads-whole (needs ``heads % cp == 0``), dense sdpa, one all_to_all
  back.

Causal attention uses the *load-balanced* layout (:func:`load_balance`): the sequence is cut
into ``2 * cp`` chunks and rank ``i`` holds chunks ``i`` and ``2*cp - 1 - i``, so every rank
does the same causal work. Ring attention then skips whole chunk pairs by chunk arithmetic:
after the first step every rank computes half a block, unmasked (all its queries against the
first key chunk when the block comes from a lower rank, its second query chunk against both key
chunks otherwise); only the first step's diagonal chunks are masked. ``load_balanced=False``
takes plain contiguous chunks (rank ``i`` holds chunk ``i``; causal work is then unbalanced).

Supported: key padding masks (``padding_mask``: True where a key is a real token), grouped
query attention (``k``/``v`` with fewer heads dividing ``q``'s; ring attention rotates the
unrepeated blocks), any leading batch dims. Not supported: local sequence lengths that differ
between ranks (the load-balanced layout needs the global length divisible by ``2 * cp``, the
contiguous one by ``cp``), dropout, arbitrary (non-causal, non-padding) masks.

:func:`context_parallel_loss` runs a transformers causal LM with no model edits: its attention
implementation is switched to this module's (registered with ``transformers.AttentionInterface``)
and its position ids are the global positions of the load-balanced chunks.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import itertools
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch._C._functorch import get_interpreter_stack

from .. import axis_env, lax
from .._function import under_plain_graph
from ..api import gather, reshard, shard
from ..array import ShardedArray
from ..axis_env import current_mesh
from ..mesh import Mesh
from ..module import functional_call
from ..shard_map import shard_map
from ..spec import P, spec_of_dims

__all__ = [
    "attention",
    "context_parallel_loss",
    "load_balance",
    "load_balance_inverse",
    "ring_attention",
    "ulysses_attention",
]


# -- layout ---------------------------------------------------------------------------------


@functools.cache
def _chunk_order(cp: int) -> tuple[int, ...]:
    """The global chunk indices in load-balanced order: rank i's chunks i and 2cp-1-i."""
    return tuple(c for i in range(cp) for c in (i, 2 * cp - 1 - i))


def _order(n: int, cp: int, what: str) -> torch.Tensor:
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"{what}: cp must be a positive int, got {cp!r}")
    if n % (2 * cp):
        raise ValueError(
            f"{what}: the sequence length {n} must be divisible by 2 * cp = {2 * cp} (two "
            "chunks per rank); pad the sequence"
        )
    c = n // (2 * cp)
    return torch.cat([torch.arange(k * c, (k + 1) * c) for k in _chunk_order(cp)])


def load_balance(x: torch.Tensor, cp: int, dim: int = -2) -> torch.Tensor:
    """Reorder ``x``'s sequence ``dim`` into the load-balanced layout: cut into ``2 * cp``
    chunks, put in the order ``0, 2cp-1, 1, 2cp-2, ...``, so that splitting the result evenly
    over ``cp`` ranks (``fs.P`` naming the axis on ``dim``) gives rank ``i`` chunks ``i`` and
    ``2cp-1-i``. ``load_balance(torch.arange(n), cp, 0)`` is the global position of each token.

    Args:
        x: a full tensor.
        cp: the context-parallel axis size.
        dim: the sequence dim (default ``-2``: ``(batch, heads, seq, head_dim)``).

    Returns:
        ``x`` reordered along ``dim`` (differentiable; :func:`load_balance_inverse` undoes it).

    Example:
        >>> load_balance(torch.arange(8), 2, dim=0)
        tensor([0, 1, 6, 7, 2, 3, 4, 5])
    """
    return x.index_select(dim, _order(x.shape[dim], cp, "load_balance").to(x.device))


def load_balance_inverse(x: torch.Tensor, cp: int, dim: int = -2) -> torch.Tensor:
    """The inverse of :func:`load_balance`: the natural sequence order back.

    Example:
        >>> x = torch.arange(8)
        >>> torch.equal(load_balance_inverse(load_balance(x, 2, 0), 2, 0), x)
        True
    """
    order = _order(x.shape[dim], cp, "load_balance_inverse")
    return x.index_select(dim, torch.argsort(order).to(x.device))


# -- ring attention -------------------------------------------------------------------------


class _Group(NamedTuple):
    """Query pieces ``q0:q1`` of this rank attend key pieces ``k0:k1`` of the block held at a
    ring step; ``qchunks`` / ``kchunks`` are their global chunk indices; ``diagonal``: a query
    chunk meets itself, and the causal mask applies."""

    q0: int
    q1: int
    k0: int
    k1: int
    qchunks: tuple[int, ...]
    kchunks: tuple[int, ...]
    diagonal: bool


@functools.cache
def _ring_plan(cp: int, index: int, causal: bool, balanced: bool) -> tuple:
    """Per ring step ``t``: ``(src, groups)``, the rank whose key/value block this rank holds
    (``index - t``) and the :class:`_Group` s computed on it. A piece is a chunk (two per rank
    when ``balanced``); causal, a query chunk attends key chunks at or before it, and
    consecutive pieces attending the same keys form one group (one matmul)."""

    def chunks(r):
        return (r, 2 * cp - 1 - r) if balanced else (r,)

    steps = []
    for t in range(cp):
        src = (index - t) % cp
        qs, ks = chunks(index), chunks(src)
        attends = [tuple(j for j, kc in enumerate(ks) if not causal or kc <= qc) for qc in qs]
        groups = []
        for keys, run in itertools.groupby(range(len(qs)), key=attends.__getitem__):
            run = list(run)
            if not keys:
                continue
            assert keys == tuple(range(keys[0], keys[-1] + 1)), keys  # one slice of the block
            q0, q1, k0, k1 = run[0], run[-1] + 1, keys[0], keys[-1] + 1
            diagonal = causal and bool(set(qs[q0:q1]) & set(ks[k0:k1]))
            groups.append(_Group(q0, q1, k0, k1, qs[q0:q1], ks[k0:k1], diagonal))
        steps.append((src, tuple(groups)))
    return tuple(steps)


class _Tile(NamedTuple):
    """One kernel call of a ring step: query pieces ``q0:q1`` against key pieces ``k0:k1`` of
    the block held; ``causal``: the two are the same chunk (a square, masked top-left)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


@functools.cache
def _ring_tiles(cp: int, index: int, causal: bool, balanced: bool) -> tuple:
    """:func:`_ring_plan` as kernel calls: per ring step ``(src, tiles)``. A diagonal group (one
    query chunk against key chunks up to itself) is cut into its unmasked keys and the causal
    square, so the fused kernel's ``is_causal`` skips the square's upper half."""
    steps = []
    for src, groups in _ring_plan(cp, index, causal, balanced):
        tiles = []
        for g in groups:
            if not g.diagonal:
                tiles.append(_Tile(g.q0, g.q1, g.k0, g.k1, False))
                continue
            assert g.q1 - g.q0 == 1 and g.kchunks[-1] == g.qchunks[0], g
            if g.k1 - 1 > g.k0:
                tiles.append(_Tile(g.q0, g.q1, g.k0, g.k1 - 1, False))
            tiles.append(_Tile(g.q0, g.q1, g.k1 - 1, g.k1, True))
        steps.append((src, tuple(tiles)))
    return tuple(steps)


def _fused(q: torch.Tensor) -> bool:
    """Whether a block runs on CPU's fused flash attention kernel (which returns the rows'
    log-sum-exp, with a backward taking it). Elsewhere (CUDA included: its flash / efficient
    kernels are not wired here, as nothing here could test them) the block is plain matmuls."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)


class _Cut(NamedTuple):
    """One block call in tokens: this rank's query rows ``r0:r1`` against keys ``s0:s1`` of the
    block held; ``causal``: a square on the diagonal (masked top-left)."""

    r0: int
    r1: int
    s0: int
    s1: int
    causal: bool


#: Tokens: the side of the sub-squares a causal chunk square is cut into on the fused kernel
#: (:func:`_cuts`); 0 turns the cut off.
_STAIR = 128


@functools.cache
def _cuts(tiles: tuple, c: int, stair: int) -> tuple:
    """A ring step's :class:`_Tile` s as block calls in tokens (chunks of ``c`` tokens). With
    ``stair`` (the fused kernel), a causal ``c``-square of at least two ``stair``-squares is cut
    in halves, recursively: the unmasked rectangle of the lower half's rows against the upper
    half's keys, then the two causal half squares, down to squares of ``stair`` tokens. The
    CPU kernel computes keys in blocks of 512 and, causal, every block up to a row block's
    diagonal in full: a causal 1024-square costs ~3/4 of the unmasked one there, cut down to
    128-squares ~9/16 (the diagonal's masked halves included), in calls whose rectangles
    cover half the square's rows per level (what the merges and gradient sums move)."""

    def square(r: int, s: int, n: int) -> list:  # rows r:r+n against keys s:s+n
        if n < 2 * stair:
            return [_Cut(r, r + n, s, s + n, True)]
        h = n // (2 * stair) * stair
        return [_Cut(r + h, r + n, s, s + h, False), *square(r, s, h), *square(r + h, s + h, n - h)]

    cuts = []
    for t in tiles:
        r0, r1, s0, s1 = t.q0 * c, t.q1 * c, t.k0 * c, t.k1 * c
        if t.causal and stair and c % stair == 0:
            cuts += square(r0, s0, c)
        else:
            cuts.append(_Cut(r0, r1, s0, s1, t.causal))
    return tuple(cuts)


def _cut_keys(call: _RingCall, cut: _Cut, src: int, keep) -> torch.Tensor | None:
    """The gathered padding mask's keys of ``cut`` on the block of rank ``src``."""
    if keep is None:
        return None
    s_loc = call.c * (2 if call.balanced else 1)
    return keep[..., src * s_loc + cut.s0 : src * s_loc + cut.s1]


def _stair(qg, c: int) -> tuple[int, int]:
    """``(stair, unit)``: the :func:`_cuts` stair of a :class:`_Ring` call on ``qg`` (0 where
    its blocks are not on the fused kernel or a chunk is not whole sub-squares) and the
    tokens every cut's rows and keys are whole multiples of (its accumulators' unit)."""
    stair = _STAIR if _fused(qg) and _STAIR and c % _STAIR == 0 and c >= 2 * _STAIR else 0
    return stair, stair or c


def _runs(seen: list, a: int, b: int, unit: int):
    """Tokens ``a:b`` (whole units) as maximal runs ``(start, stop, written)`` of units that
    ``seen`` says are all written or all not; then marks them written."""
    i, end = a // unit, b // unit
    while i < end:
        j = i
        while j < end and seen[j] == seen[i]:
            j += 1
        yield i * unit, j * unit, seen[i]
        i = j
    seen[a // unit : end] = [True] * (end - a // unit)


def _as_bhsd(q, k, v, keys):
    """The fused kernels' operands: ``(batch, heads, seq, dim)`` (the leading dims flattened;
    grouped-query k/v as they are: the kernels take fewer key heads) and the padding mask as an
    additive score bias ``(batch, 1, 1, keys)``: the dtype's lowest finite value where a key is
    padding, not -inf, so a row with no key in a block weighs zero in the merge without a nan
    (its log-sum-exp is finite, far below any real row's)."""
    h = q.shape[-4] * q.shape[-3]
    q4 = q.reshape(-1, h, *q.shape[-2:])
    k4, v4 = (t.reshape(-1, *t.shape[-3:]) for t in (k, v))
    bias = None
    if keys is not None:
        bias = torch.zeros(keys.shape, dtype=q.dtype, device=q.device)
        bias = bias.masked_fill(~keys, torch.finfo(q.dtype).min).reshape(-1, 1, 1, keys.shape[-1])
    return q4, k4, v4, bias


def _scores(q, k, scale: float, causal: bool, keys) -> torch.Tensor:
    """The matmul blocks' masked scores: masked entries the dtype's lowest finite value (not
    -inf: see :func:`_as_bhsd`)."""
    s = torch.matmul(q, k.unsqueeze(-3).transpose(-1, -2)) * scale
    if keys is not None:
        s = s.masked_fill(~keys[..., None, None, None, :], torch.finfo(s.dtype).min)
    if causal:
        tril = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~tril, torch.finfo(s.dtype).min)
    return s


def _block(q, k, v, scale: float, causal: bool, keys, fused: bool):
    """Attention of ``q`` (..., hkv, g, sq, d) on one key block (..., hkv, sk, d): the output
    and the rows' log-sum-exp (..., hkv, g, sq, 1). ``causal``: query ``i`` sees keys ``<= i``;
    ``keys``: (..., sk) bool, the keys that are not padding. ``fused``: CPU's flash kernel
    (not differentiable in the log-sum-exp: only inside :class:`_Ring`), else matmuls autograd
    differentiates."""
    if fused:
        q4, k4, v4, mask = _as_bhsd(q, k, v, keys)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q4, k4, v4, 0.0, causal, attn_mask=mask, scale=scale
        )
        return out.reshape(q.shape), lse.reshape(*q.shape[:-1], 1)
    s = _scores(q, k, scale, causal, keys)
    lse = torch.logsumexp(s, -1, keepdim=True)
    return torch.matmul(torch.exp(s - lse), v.unsqueeze(-3)), lse


def _merge(acc, new):
    """Two blocks' ``(out, lse)`` merged by log-sum-exp. Written around the rows' max (not
    ``logaddexp``, whose second derivative is nan where one side is a fully masked row's
    lowest finite value); the max cancels out of the value, so it is held constant."""
    if acc is None:
        return new
    (oa, la), (ob, lb) = acc, new
    m = torch.maximum(la, lb).detach()
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    z = wa + wb
    return (oa * wa + ob * wb) / z, m + torch.log(z)


def _check_qkv(fn: str, q, k, v) -> tuple[int, int]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() < 3:
            raise TypeError(
                f"{fn}: {name} must be a local torch.Tensor (..., heads, seq, head_dim), got "
                f"{type(t).__name__} {getattr(t, 'shape', '')}"
            )
    if k.shape != v.shape or q.shape[:-3] != k.shape[:-3] or q.shape[-2:] != k.shape[-2:]:
        raise ValueError(
            f"{fn}: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must agree "
            "on batch, local sequence and head dims (k and v equal)"
        )
    h, hkv = q.shape[-3], k.shape[-3]
    if h % hkv:
        raise ValueError(f"{fn}: q's {h} heads must be a multiple of k's and v's {hkv}")
    return h, hkv


def _check_mask(fn: str, mask, q) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(
            f"{fn}: padding_mask must be a bool tensor (True = a real key), got "
            f"{getattr(mask, 'dtype', type(mask).__name__)}"
        )
    if tuple(mask.shape) != (*q.shape[:-3], q.shape[-2]):
        raise ValueError(
            f"{fn}: padding_mask has shape {tuple(mask.shape)}, expected (batch..., local seq) "
            f"= {(*q.shape[:-3], q.shape[-2])}"
        )


def _gathered_mask(mask: torch.Tensor, axis, mesh) -> torch.Tensor:
    """Every rank's local padding mask, concatenated in rank order (one small all_gather)."""
    full = lax.all_gather(mask.to(torch.uint8), axis, dim=mask.dim() - 1, to="invariant", mesh=mesh)
    return full.bool()


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    axis: str,
    *,
    causal: bool = False,
    padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    load_balanced: bool = True,
    mesh: Mesh | None = None,
) -> torch.Tensor:
    """Ring attention over ``axis``: this rank's queries against every rank's keys and values.

    Equals ``F.scaled_dot_product_attention`` of the full q, k, v (``is_causal=causal``, the
    padding mask as a boolean ``attn_mask`` over keys) restricted to this rank's queries.
    ``cp - 1`` steps each send this rank's key/value block (stacked: one message) to the next
    rank with :func:`fshard.lax.ppermute_start` before computing on the current one; the
    backward sends the blocks' gradients back the same way (``cp - 1`` messages of the
    block's size, in the accumulation dtype), each overlapped with a block's gradients.

    Args:
        q: local queries ``(batch..., heads, seq/cp, head_dim)``.
        k, v: local keys and values ``(batch..., kv_heads, seq/cp, head_dim)``; ``kv_heads``
            divides ``heads`` (grouped-query attention, as transformers' ``repeat_kv``).
        axis: the context-parallel mesh axis.
        causal: causal attention over global positions (the layout says which: see
            ``load_balanced``).
        padding_mask: local bool ``(batch..., seq/cp)``, True for a real key token.
        scale: the score scale; default ``head_dim ** -0.5``.
        load_balanced: the local sequence is chunks ``i`` and ``2cp-1-i`` (:func:`load_balance`);
            ``False``: contiguous chunk ``i``.
        mesh: the mesh; default the enclosing shard_map's.

    Returns:
        This rank's attention output, shaped as ``q``.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("cp",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))
        >>> lb = lambda t: load_balance(t, 2)
        >>> ring = fs.shard_map(
        ...     lambda q, k, v: ring_attention(q, k, v, "cp", causal=True),
        ...     mesh, fs.P(None, None, "cp"), fs.P(None, None, "cp"))
        >>> out = load_balance_inverse(fs.gather(ring(lb(q), lb(k), lb(v))), 2)
        >>> torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)
        True
    """
    h, hkv = _check_qkv("ring_attention", q, k, v)
    _check_mask("ring_attention", padding_mask, q)
    m = current_mesh(mesh)
    cp = m.size(axis)
    index = m.axis_index(axis)
    pieces = 2 if load_balanced else 1
    s_loc, d = q.shape[-2], q.shape[-1]
    if s_loc % pieces:
        raise ValueError(
            f"ring_attention: the local sequence length {s_loc} must be even with "
            "load_balanced=True (chunks i and 2cp-1-i)"
        )
    c = s_loc // pieces
    scale = d**-0.5 if scale is None else float(scale)
    acc_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    qg = q.to(acc_dtype).unflatten(-3, (hkv, h // hkv))
    keep = None if padding_mask is None else _gathered_mask(padding_mask, axis, mesh)
    kv = torch.stack([k, v])
    call = _RingCall(axis, m, cp, index, bool(causal), load_balanced, c, scale)
    if not _overlappable(q, k, v):  # autograd (or the transform) differentiates op by op
        return _ring_forward(call, qg, kv, keep)[0].flatten(-4, -3).to(q.dtype)
    tracker = axis_env.tracker(m)
    if tracker is not None:  # as the ops would: an operand invariant where another varies
        vary = tracker.vma(qg) | tracker.vma(kv) | {axis}
        qg, kv = tracker.pcast(qg, tuple(vary)), tracker.pcast(kv, tuple(vary))
    with _paused(tracker):
        out = _Ring.apply(call, qg, kv, keep)[0]
    if tracker is not None:
        tracker.tag(out, frozenset(vary))
    return out.flatten(-4, -3).to(q.dtype)


class _RingCall(NamedTuple):
    """One ring attention call's static parts (what its forward and backward both need)."""

    axis: str
    mesh: Mesh
    cp: int
    index: int
    causal: bool
    balanced: bool
    c: int  # the tokens of a chunk
    scale: float


def _overlappable(*inputs: torch.Tensor) -> bool:
    """Whether the ring runs as :class:`_Ring` (its backward's transfers overlapped): where
    ``fs.lax.ppermute_start`` is asynchronous (no transform but autograd and ``torch.func``
    grad levels, no tracing, no remat), at most one grad level is open (the Function's
    backward is differentiated once) and no plain autograd graph around that level holds the
    ``inputs`` (where one could differentiate the gradient, which the Function's backward
    computes without autograd under the level: a silent zero there). Elsewhere (vmap, jvp, grad
    of grad, compile, a derivative of the gradient) the ring's ops are differentiated one by
    one, where each ppermute's transpose runs."""
    return (
        lax.computable_ahead()
        and len(get_interpreter_stack() or ()) <= 1
        and not under_plain_graph(*inputs)
    )


@contextlib.contextmanager
def _paused(tracker):
    """The body's varying-axes tracker off: inside :class:`_Ring` the transfers and ops act on
    local data whose axes the call as a whole declares (as ``fs.parallel.pipeline``'s)."""
    if tracker is None:
        yield
        return
    tracker.paused += 1
    try:
        yield
    finally:
        tracker.paused -= 1


def _cut_block(call: _RingCall, cut: _Cut, qg, kt, vt, keys, fused: bool) -> tuple:
    """:func:`_block` of ``cut``: its query rows against its keys of the block ``(kt, vt)``."""
    rows, cols = slice(cut.r0, cut.r1), slice(cut.s0, cut.s1)
    return _block(
        qg[..., rows, :], kt[..., cols, :], vt[..., cols, :], call.scale, cut.causal, keys, fused
    )


def _ring_forward(call: _RingCall, qg, kv, keep) -> tuple:
    """The ring op by op: ``(out, lse, blocks)``, the output ``(..., hkv, group, seq/cp,
    head_dim)`` and its rows' log-sum-exp in the accumulation dtype, and the key/value blocks
    received (ring steps ``1..cp-1``); the blocks are matmuls. Differentiable by autograd (each
    ppermute's transpose)."""
    cp, c, pieces = call.cp, call.c, 2 if call.balanced else 1
    ring = [(r, (r + 1) % cp) for r in range(cp)]
    acc = [None] * pieces
    blocks = []
    for t, (src, tiles) in enumerate(_ring_tiles(cp, call.index, call.causal, call.balanced)):
        pending = lax.ppermute_start(kv, call.axis, ring, mesh=call.mesh) if t < cp - 1 else None
        kt, vt = kv.to(qg.dtype).unbind(0)
        for cut in _cuts(tiles, c, 0):
            out, lse = _cut_block(call, cut, qg, kt, vt, _cut_keys(call, cut, src, keep), False)
            for p in range(cut.r0 // c, cut.r1 // c):
                rows = slice(p * c - cut.r0, (p + 1) * c - cut.r0)
                acc[p] = _merge(acc[p], (out[..., rows, :], lse[..., rows, :]))
        if not tiles:
            # no query here attends this block (contiguous causal layout), yet its ppermute must
            # be in this rank's graph: the backward runs the same collectives on every rank
            o0, l0 = acc[0]
            acc[0] = (o0 + kv[..., :0, :].sum(), l0)
        if pending is not None:
            kv = pending.wait()
            blocks.append(kv)
    return torch.cat([o for o, _ in acc], -2), torch.cat([lse for _, lse in acc], -2), blocks


def _ring_forward_fused(call: _RingCall, qg, kv, keep) -> tuple:
    """:func:`_ring_forward` as :class:`_Ring`'s forward (no autograd): the blocks on the fused
    kernel where :func:`_fused` (causal chunk squares cut by :func:`_cuts`), each merged in
    place into one output and log-sum-exp (:func:`_merge_into`)."""
    cp, c = call.cp, call.c
    ring = [(r, (r + 1) % cp) for r in range(cp)]
    stair, unit = _stair(qg, c)
    fused = _fused(qg)
    out, lse = torch.empty_like(qg), qg.new_empty((*qg.shape[:-1], 1))
    seen = [False] * (qg.shape[-2] // unit)
    blocks = []
    for t, (src, tiles) in enumerate(_ring_tiles(cp, call.index, call.causal, call.balanced)):
        pending = lax.ppermute_start(kv, call.axis, ring, mesh=call.mesh) if t < cp - 1 else None
        kt, vt = kv.to(qg.dtype).unbind(0)
        for cut in _cuts(tiles, c, stair):
            o, lo = _cut_block(call, cut, qg, kt, vt, _cut_keys(call, cut, src, keep), fused)
            for a, b, written in _runs(seen, cut.r0, cut.r1, unit):
                rows = slice(a - cut.r0, b - cut.r0)
                _merge_into(out[..., a:b, :], lse[..., a:b, :], o[..., rows, :], lo[..., rows, :],
                            not written)  # fmt: skip
        if pending is not None:
            kv = pending.wait()
            blocks.append(kv)
    assert all(seen), seen  # every query chunk attends its own chunk
    return out, lse, blocks


def _merge_into(out, lse, o, lo, first: bool) -> None:
    """:func:`_merge` in place (no autograd: :class:`_Ring`'s forward): ``out`` and ``lse``, a
    block's rows of the accumulated output and log-sum-exp, take the block ``(o, lo)``
    (``first``: copied). The output moves towards the block's by the block's weight (one
    ``lerp_``), the rows' weights computed on the small log-sum-exp."""
    if first:
        out.copy_(o)
        lse.copy_(lo)
        return
    m = torch.maximum(lse, lo)
    wa, wb = torch.exp(lse - m), torch.exp(lo - m)
    z = wa + wb
    out.lerp_(o, wb.div_(z))  # out * wa / z + o * wb / z, one pass over the rows
    lse.copy_(m.add_(z.log_()))


def _block_grads(q, k, v, scale: float, causal: bool, keys, out, lse, do, fused: bool):
    """The backward of :func:`_block` against the *merged* rows' ``out`` and ``lse`` (flash
    attention's: ``p = exp(s - lse)``, ``ds = p (do v^T - delta)``, ``delta`` the rows'
    ``do . out``): ``(dq, dk, dv)``, ``dk`` and ``dv`` summed over the query heads sharing a
    key head. ``fused``: CPU's flash attention backward kernel."""
    if fused:
        q4, k4, v4, mask = _as_bhsd(q, k, v, keys)
        h, sq = q4.shape[1], q4.shape[2]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do.reshape(q4.shape),
            q4,
            k4,
            v4,
            out.reshape(q4.shape),
            lse.reshape(-1, h, sq),
            0.0,
            causal,
            attn_mask=mask,
            scale=scale,
        )
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)
    s = _scores(q, k, scale, causal, keys)
    p = torch.exp(s - lse)
    delta = (do * out).sum(-1, keepdim=True)
    dv = torch.matmul(p.transpose(-1, -2), do).sum(-3)
    ds = p * (torch.matmul(do, v.unsqueeze(-3).transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, k.unsqueeze(-3)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(-3) * scale
    return dq, dk, dv


def _accumulate(bufs, seen: list, a: int, b: int, unit: int, grads) -> None:
    """Tokens ``a:b`` of each of ``bufs`` (``(..., seq/cp, head_dim)`` accumulators, no
    autograd) take the matching one of ``grads`` (``(..., b - a, head_dim)``): copied into the
    units not yet written (``seen``), added in place to those that are."""
    for x, y, written in _runs(seen, a, b, unit):
        for buf, g in zip(bufs, grads):
            dst, src = buf[..., x:y, :], g[..., x - a : y - a, :]
            dst.add_(src) if written else dst.copy_(src)


def _zero_unseen(buf, seen: list, unit: int) -> None:
    for p, s in enumerate(seen):
        if not s:
            buf[..., p * unit : (p + 1) * unit, :].zero_()


def _ring_backward(call: _RingCall, qg, kv, keep, out, lse, blocks, dout) -> tuple:
    """``(dq, dkv)`` of :func:`_ring_forward_fused`, the ring steps in reverse: a block's
    key/value gradient accumulates on its way back to its rank (step ``t``'s sum goes to the
    rank that held the same block at step ``t - 1``, by the inverse rotation), and each step's
    sum is put on the wire with ``fs.lax.ppermute_start`` before the next step's block is
    computed, taken only after it (ring-flash-attention's and torch context_parallel's
    overlap). No autograd: the blocks' gradients are copied or added in place into one ``dq``
    and into one key/value gradient per step (the sum received from the next rank added in
    place), which is sent as it is (contiguous, no copy)."""
    cp, c = call.cp, call.c
    back = [(r, (r - 1) % cp) for r in range(cp)]
    dout = dout.to(out.dtype)
    fused = _fused(qg)
    stair, unit = _stair(qg, c)
    if fused:
        # seq before heads in memory, the layout the backward kernel reads grad_out in (it
        # copies a grad_out in any other, at every call: here one copy)
        shape = (*dout.shape[:-4], dout.shape[-2], *dout.shape[-4:-2], dout.shape[-1])
        dout = dout.new_empty(shape).movedim(-4, -2).copy_(dout)
    units = qg.shape[-2] // unit
    dq, dq_seen = torch.empty_like(qg), [False] * units
    pending = dkv = None
    plan = _ring_tiles(cp, call.index, call.causal, call.balanced)
    for t in reversed(range(cp)):
        src, tiles = plan[t]
        kt, vt = (kv if t == 0 else blocks[t - 1]).to(qg.dtype).unbind(0)
        parts = []
        for cut in _cuts(tiles, c, stair):
            rows, cols = slice(cut.r0, cut.r1), slice(cut.s0, cut.s1)
            gq, gk, gv = _block_grads(
                qg[..., rows, :],
                kt[..., cols, :],
                vt[..., cols, :],
                call.scale,
                cut.causal,
                _cut_keys(call, cut, src, keep),
                out[..., rows, :],
                lse[..., rows, :],
                dout[..., rows, :],
                fused,
            )
            _accumulate((dq,), dq_seen, cut.r0, cut.r1, unit, (gq,))
            parts.append((cut.s0, cut.s1, gk, gv))
        dkv, seen = kt.new_empty((2, *kt.shape)), [False] * units
        for s0, s1, gk, gv in parts:
            _accumulate(dkv.unbind(0), seen, s0, s1, unit, (gk, gv))
        if pending is not None:  # the later steps' sum (every chunk), added into this one's
            # (not the reverse: under torch.func.grad the received tensor is outside the level)
            _accumulate((dkv,), seen, 0, kt.shape[-2], unit, (pending.wait(),))
        else:
            _zero_unseen(dkv, seen, unit)
        if t > 0:
            pending = lax.ppermute_start(dkv, call.axis, back, mesh=call.mesh)
    _zero_unseen(dq, dq_seen, unit)
    return dq, dkv.to(kv.dtype)


class _Ring(torch.autograd.Function):
    """Ring attention as one Function: forward :func:`_ring_forward_fused` (returning the output,
    its log-sum-exp and the received blocks, kept for the backward), backward
    :func:`_ring_backward`, whose transfers overlap its block computations as the forward's
    do (autograd through the ring runs each ppermute's transpose where it reaches it, after
    that step's block gradients and before the previous step's). The blocks are kept, not
    received again: the backward moves only the key/value gradients (as autograd's), holding
    the cp blocks (the global keys and values) instead of each block's probabilities."""

    @staticmethod
    def forward(call, qg, kv, keep):
        out, lse, blocks = _ring_forward_fused(call, qg, kv, keep)
        return (out, lse, *blocks)

    @staticmethod
    def setup_context(ctx, inputs, output):
        call, qg, kv, keep = inputs
        ctx.call, ctx.has_keep = call, keep is not None
        ctx.mark_non_differentiable(*output[1:])
        ctx.save_for_backward(qg, kv, *([keep] if keep is not None else []), *output)

    @staticmethod
    def backward(ctx, dout, *_):
        if torch.is_grad_enabled() and not get_interpreter_stack():
            return _Ring.differentiable_backward(ctx, dout)
        return _Ring.overlapped_backward(ctx, dout)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def overlapped_backward(ctx, dout):
        qg, kv, *rest = ctx.saved_tensors
        keep = rest.pop(0) if ctx.has_keep else None
        out, lse, *blocks = rest
        with _paused(axis_env.tracker(ctx.call.mesh)):
            dq, dkv = _ring_backward(ctx.call, qg, kv, keep, out, lse, blocks, dout)
        return None, dq, dkv, None

    @staticmethod
    def differentiable_backward(ctx, dout):
        """Eager ``create_graph=True`` (a derivative of the gradient to come): the ring's ops
        again under autograd and their vjp, itself differentiable (each ppermute's transpose)."""
        qg, kv, *rest = ctx.saved_tensors
        keep = rest[0] if ctx.has_keep else None
        need = ctx.needs_input_grad[1:3]
        wanted = [t for t, n in zip((qg, kv), need) if n]
        with torch.enable_grad():
            out = _ring_forward(ctx.call, qg, kv, keep)[0]
        grads = iter(torch.autograd.grad(out, wanted, dout, create_graph=True))
        return None, *(next(grads) if n else None for n in need), None


# -- Ulysses --------------------------------------------------------------------------------


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    axis: str,
    *,
    causal: bool = False,
    padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    load_balanced: bool = True,
    mesh: Mesh | None = None,
) -> torch.Tensor:
    """All-to-all (DeepSpeed-Ulysses) attention over ``axis``: an all_to_all gives each rank
    ``heads / cp`` heads of the whole sequence, dense ``F.scaled_dot_product_attention`` runs on
    them, and an all_to_all gives the sequence split back. Arguments and result as
    :func:`ring_attention`; ``heads`` (and ``kv_heads``, else k and v are repeated to
    ``heads`` first) must be divisible by the axis size.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("cp",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))
        >>> lb = lambda t: load_balance(t, 2)
        >>> uly = fs.shard_map(
        ...     lambda q, k, v: ulysses_attention(q, k, v, "cp", causal=True),
        ...     mesh, fs.P(None, None, "cp"), fs.P(None, None, "cp"))
        >>> out = load_balance_inverse(fs.gather(uly(lb(q), lb(k), lb(v))), 2)
        >>> torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)
        True
    """
    h, hkv = _check_qkv("ulysses_attention", q, k, v)
    _check_mask("ulysses_attention", padding_mask, q)
    cp = current_mesh(mesh).size(axis)
    if h % cp:
        raise ValueError(
            f"ulysses_attention: q has {h} heads, not divisible by the size {cp} of axis "
            f"{axis!r}; use ring_attention"
        )
    if hkv % cp:
        k, v = (t.repeat_interleave(h // hkv, dim=-3) for t in (k, v))
        hkv = h
    hd, sd = q.dim() - 3, q.dim() - 2

    def to_heads(t):
        return lax.all_to_all(t, axis, split_dim=hd, concat_dim=sd, mesh=mesh)

    qh, kh, vh = to_heads(q), to_heads(k), to_heads(v)
    s = qh.shape[-2]
    nat = back = None
    if load_balanced and cp > 1:
        if s % (2 * cp):
            raise ValueError(
                f"ulysses_attention: the local sequence length {s // cp} must be even with "
                "load_balanced=True (chunks i and 2cp-1-i)"
            )
        back = _order(s, cp, "ulysses_attention").to(q.device)
        nat = torch.argsort(back)
        qh, kh, vh = (t.index_select(-2, nat) for t in (qh, kh, vh))
    mask = None
    if padding_mask is not None:
        keep = _gathered_mask(padding_mask, axis, mesh)
        if nat is not None:
            keep = keep.index_select(-1, nat)
        mask = keep[..., None, None, :]
        if causal:
            mask = mask & torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    out = F.scaled_dot_product_attention(
        qh,
        kh,
        vh,
        attn_mask=mask,
        is_causal=bool(causal) and mask is None,
        scale=scale,
        enable_gqa=hkv != h,
    )
    if back is not None:
        out = out.index_select(-2, back)
    return lax.all_to_all(out, axis, split_dim=sd, concat_dim=hd, mesh=mesh)


# -- transformers models --------------------------------------------------------------------

#: The attention implementation registered with transformers (``AttentionInterface``).
HF_ATTENTION = "fshard_context_parallel"
_ATTENTION = {"ring": ring_attention, "ulysses": ulysses_attention}
#: ``(axis, attention function, mesh)`` while :func:`context_parallel_loss` runs its model.
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("fshard_context_parallel", default=None)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention that a model of your own calls to be context parallel:
    inside :func:`context_parallel_loss` (and ``fs.parallel.parallelize`` with ``cp > 1``)
    the attention of the call's axis (:func:`ring_attention` or :func:`ulysses_attention`) on
    this rank's sequence chunks, elsewhere ``F.scaled_dot_product_attention``. transformers
    models need no edit (their attention implementation is switched instead).

    Args:
        query, key, value: ``(batch..., heads, seq, head_dim)`` (``kv_heads`` dividing
            ``heads``: grouped-query attention); local chunks under context parallelism,
            ShardedArrays in the global view (heads split over tp, say).
        is_causal: causal attention over the global positions.
        scale: the score scale; default ``head_dim ** -0.5``.
        padding_mask: bool ``(batch..., seq)``, True for a real key token, or ``None``.

    Returns:
        The attention output, shaped as ``query``.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))
        >>> out = fs.parallel.attention(q, k, v, is_causal=True)  # not under cp: sdpa
        >>> torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
        True
    """
    active = _ACTIVE.get()
    if active is None:
        mask = None if padding_mask is None else padding_mask[..., None, None, :]
        if mask is not None and is_causal:
            s = query.shape[-2]
            mask = mask & torch.ones(s, s, dtype=torch.bool, device=query.device).tril()
        hkv, h = key.shape[-3], query.shape[-3]
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=is_causal and mask is None,
            scale=scale, enable_gqa=hkv != h,
        )  # fmt: skip
    axis, attend, mesh = active

    def local(q, k, v, mask):
        return attend(q, k, v, axis, causal=is_causal, padding_mask=mask, scale=scale)

    if isinstance(query, ShardedArray):
        # a body over the blocks of every axis (heads over tp, rows over the batch axes: each
        # attends on its own), so the blocks must be whole attention problems (_block_specs)
        query, key, value = (
            reshard(t, want) for t, want in zip((query, key, value), _block_specs(query, key, value, axis))
        )  # fmt: skip
        if isinstance(padding_mask, ShardedArray):
            rows = query.spec.padded(query.ndim)[: query.ndim - 3]
            seq = (axis,) if axis in query.layout.mesh.axis_names else ()
            padding_mask = reshard(padding_mask, spec_of_dims([*rows, seq]))
        mask = padding_mask
        specs = [t.spec for t in (query, key, value)]
        specs.append(None if mask is None else mask.spec if isinstance(mask, ShardedArray) else P())
        # the output's global shape is the query's with the value's head dim: given, so no
        # exchange of the blocks' shapes (none on a dry run's simulated ranks)
        shape = (*query.shape[:-1], value.shape[-1])
        local = shard_map(local, mesh, tuple(specs), query.spec, out_shapes=shape)
    return local(query, key, value, padding_mask)


def _block_specs(q, k, v, axis: str) -> tuple[P, P, P]:
    """The layouts whose blocks are whole attention problems for the ring or all-to-all over
    ``axis`` on each rank's blocks: the query's batch dims (k and v alike); the heads split
    only where the query's and the key/value heads split evenly over the same axes (each rank's
    q heads then use its own kv heads under grouped-query attention), else whole; the sequence
    over ``axis`` alone (the ring takes a rank's block as its cp chunk; whole inside a
    shard_map over ``axis``, where each value is the rank's chunk already: one gathered over cp
    by a layer before is split again, one over more axes (cp x tp, or tp) gathered over the
    others); the head dim whole (a kv head split over tp, fewer kv heads than tp ranks, is
    gathered)."""
    lead = [tuple(a for a in d if a != axis) for d in q.spec.padded(q.ndim)[: q.ndim - 3]]
    heads = tuple(a for a in q.spec.padded(q.ndim)[-3] if a != axis)
    n = q.layout.mesh.size(heads) if heads else 1
    if any(t.spec.padded(t.ndim)[-3] != heads or t.shape[-3] % n for t in (q, k, v)):
        heads = ()
    seq = (axis,) if axis in q.layout.mesh.axis_names else ()
    specs = []
    for t in (q, k, v):
        rows = lead[len(lead) - (t.ndim - 3) :] if t.ndim - 3 else []
        specs.append(spec_of_dims([*rows, heads, seq, ()]))  # a pending sum reduced: not linear
    return tuple(specs)


def _hf_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
    """transformers' attention-interface signature (as ``sdpa_attention_forward``): q, k, v
    ``(batch, heads, local seq, head_dim)``; returns ``(batch, local seq, heads, head_dim)``."""
    if _ACTIVE.get() is None:
        raise RuntimeError(
            f"attn_implementation {HF_ATTENTION!r} runs only inside "
            "fs.parallel.context_parallel_loss (it needs the context-parallel axis)"
        )
    if dropout:
        raise ValueError(f"{HF_ATTENTION}: attention dropout is not supported, got {dropout}")
    if kw.get("sliding_window") is not None:
        raise NotImplementedError(f"{HF_ATTENTION}: sliding-window attention is not supported")
    # what the attention would otherwise drop silently: sinks (GPT-OSS, Flint), a soft cap
    # on the scores (Gemma-2)
    for k in ("s_aux", "sinks", "softcap"):
        if kw.get(k) is not None:
            raise NotImplementedError(
                f"{HF_ATTENTION}: {type(module).__name__} passes {k}= (attention sinks or a "
                "soft cap on the scores), which ring and Ulysses attention do not apply; use "
                "cp = 1 for this model"
            )
    causal = kw.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    out = attention(query, key, value, is_causal=causal, scale=scaling, padding_mask=attention_mask)
    return out.transpose(1, 2).contiguous(), None


def _hf_mask(*args, attention_mask=None, **kwargs):
    """The mask transformers builds for :data:`HF_ATTENTION`: the 2-D padding mask itself (the
    attention applies it per key block, and causality by chunk arithmetic)."""
    return attention_mask


@functools.cache
def _register_hf() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(HF_ATTENTION, _hf_attention)
    AttentionMaskInterface.register(HF_ATTENTION, _hf_mask)


@contextlib.contextmanager
def _attention_of(module: torch.nn.Module, mesh: Mesh, axis: str, attend):
    """:func:`attention` is ``attend`` over ``axis`` while inside; a transformers model's
    (``module.config``'s) attention implementation is :data:`HF_ATTENTION`."""
    config = getattr(module, "config", None)
    hf = hasattr(config, "_attn_implementation")
    if hf:
        _register_hf()
        before = config._attn_implementation
    token = _ACTIVE.set((axis, attend, mesh))
    if hf:
        config._attn_implementation = HF_ATTENTION
    try:
        yield
    finally:
        if hf:
            config._attn_implementation = before
        _ACTIVE.reset(token)


def _loss_dtype(logits: torch.Tensor) -> torch.dtype:
    """The cross entropy's dtype: at least float32 (as transformers' loss upcasts), float64
    kept (a float32 cast would round a float64 model's loss and gradients to float32)."""
    return torch.promote_types(logits.dtype, torch.float32)


def target_count(targets: torch.Tensor) -> int:
    """The targets a causal-LM loss averages over (those not ``-100``): its divisor. On meta
    data (:func:`fshard.dry_run`) there is no value to read, and the count only scales the
    loss, so any positive count gives the step's bytes and FLOPs: the number of targets."""
    if targets.is_meta:
        return max(targets.numel(), 1)
    return int((targets != -100).sum())


def context_parallel_loss(
    module: torch.nn.Module,
    params: Mapping,
    mesh: Mesh,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    axis: str = "cp",
    attention: str = "ring",
    batch: str | tuple[str, ...] | None = None,
    call: Callable | None = None,
    targets: torch.Tensor | None = None,
) -> torch.Tensor:
    """The causal-LM loss of a transformers model (``LlamaForCausalLM`` and the like) with the
    sequence split over ``axis``: transformers' ``model(input_ids, labels=labels).loss``.

    A model of your own works the same way when its forward takes ``(input_ids,
    position_ids=...)`` (and ``attention_mask=`` if one is given), returns the logits (or an
    output with ``.logits``) and its attention calls :func:`attention`.

    The model runs unedited inside :func:`fshard.shard_map` over ``axis`` (partial-manual: the
    params keep their layouts over the other mesh axes, e.g. a Megatron plan over ``tp``). The
    sequence is load-balanced (:func:`load_balance`), the position ids are the global positions
    of each rank's chunks (so rotary embeddings are the dense model's), the attention
    implementation is :func:`ring_attention` or :func:`ulysses_attention` (the config's
    ``_attn_implementation`` is switched for the call and restored), and the next-token targets
    are shifted on the full sequence before it is split. The loss is each rank's summed cross
    entropy, ``psum``-ed over ``axis``, over the number of targets.

    Args:
        module: the causal LM.
        params: ``{name: ShardedArray}`` from :func:`fshard.nn.shard_params`: whole over
            ``axis`` (a plan that does not name it: ``{}`` replicates everything), or split
            over it by FSDP (:func:`fshard.nn.fsdp_plan` over an axis tuple holding ``axis``,
            as :func:`parallelize`'s FSDP x CP): those enter the body as they are and ``call``
            must gather them (:func:`fshard.nn.fsdp_call` over the same axes).
        mesh: the mesh.
        input_ids: the full ``(batch, seq)`` token ids, the same on every rank; ``seq``
            divisible by ``2 * cp``.
        labels: as transformers' (default ``input_ids``; shifted inside); -100 is ignored.
        attention_mask: ``(batch, seq)``, 1 for real tokens (key padding), or ``None``.
        axis: the context-parallel mesh axis.
        attention: ``"ring"`` or ``"ulysses"``.
        batch: mesh axes the batch (dim 0) is split over too (data parallel, FSDP's), or
            ``None``.
        call: what runs the model on a rank's chunks, ``call(module, params, args, kwargs)``:
            :func:`fshard.nn.functional_call` (``None``), or another strategy's, e.g.
            ``functools.partial(fs.nn.fsdp_call, mesh=mesh, axis="dp")`` for FSDP x CP.
        targets: instead of ``labels``: the token each position predicts, already shifted
            (torchtitan's convention), ``(batch, seq)``; -100 is ignored.

    Returns:
        The mean loss, a 0-d tensor equal on every rank (differentiable in ``params``: use
        ``torch.func.grad`` or :func:`fshard.value_and_grad`).

    Example:
        >>> import transformers
        >>> transformers.logging.set_verbosity_error()
        >>> _ = torch.manual_seed(0)
        >>> cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        ...     vocab_size=64, attn_implementation="sdpa")
        >>> model = transformers.LlamaForCausalLM(cfg)
        >>> mesh = fs.Mesh.create((2,), ("cp",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> params = fs.nn.shard_params(model, mesh, {})  # replicated over cp
        >>> ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        >>> loss = context_parallel_loss(model, params, mesh, ids)
        >>> torch.allclose(loss, model(ids, labels=ids).loss, atol=1e-5)
        True
    """
    if attention not in _ATTENTION:
        raise ValueError(f"attention must be one of {sorted(_ATTENTION)}, got {attention!r}")
    if call is not None and not callable(call):
        raise TypeError(f"context_parallel_loss: call must be callable, got {type(call).__name__}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise TypeError(
            f"input_ids must be a full (batch, seq) tensor, got {type(input_ids).__name__} "
            f"{getattr(input_ids, 'shape', '')}"
        )
    cp = mesh.size(axis)
    b, s = input_ids.shape
    if targets is not None and labels is not None:
        raise ValueError("context_parallel_loss: give labels or targets, not both")
    labels = input_ids if labels is None else labels
    if tuple(labels.shape) != (b, s):
        raise ValueError(f"labels has shape {tuple(labels.shape)}, expected {(b, s)}")
    if targets is not None and tuple(targets.shape) != (b, s):
        raise ValueError(f"targets has shape {tuple(targets.shape)}, expected {(b, s)}")
    if attention_mask is not None and tuple(attention_mask.shape) != (b, s):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(b, s)}"
        )
    if targets is None:
        targets = torch.cat([labels[:, 1:], labels.new_full((b, 1), -100)], 1)
    count = target_count(targets)
    positions = torch.arange(s, device=input_ids.device).expand(b, s)  # split as the ids

    def split(t):
        if t is None:
            return None
        t = load_balance(t, cp, 1)
        # the batch's split over other axes: a global-view value the body keeps as it is
        return t if batch is None else shard(t, mesh, P(batch, axis))

    mask = None if attention_mask is None else attention_mask.bool()
    attend = _ATTENTION[attention]

    def body(ps, ids, pos, tgt, keep):
        with _attention_of(module, mesh, axis, attend):
            out = _call(call or functional_call, module, ps, ids, pos, keep)
        logits = getattr(out, "logits", out)
        ce = F.cross_entropy(
            logits.flatten(0, -2).to(_loss_dtype(logits)),
            tgt.flatten(),
            ignore_index=-100,
            reduction="sum",
        )
        return lax.psum(ce, axis) / count

    seq = P(None, axis)
    # a param split over ``axis`` (parallelize's FSDP over dp_shard x cp: each rank holds
    # 1/(dp_shard * cp) of it) enters the body as it is (in_specs None): ``call`` gathers its
    # blocks over the FSDP group (fs.nn.fsdp_call over an axis tuple holding ``axis``), its
    # gradient one reduce_scatter over that group; the others are whole over ``axis`` (P())
    pspec: P | dict = P()
    as_is = [k for k, v in params.items() if isinstance(v, ShardedArray) and _names(v, axis)]
    if as_is:
        if call is None:
            raise ValueError(
                f"context_parallel_loss: params {as_is[:3]} are split over {axis!r}; the default "
                f"call (fs.nn.functional_call) needs them whole over it: fs.reshard them, or "
                f"give call=functools.partial(fs.nn.fsdp_call, axis=(..., {axis!r}), ...)"
            )
        params = dict(params)
        pspec = {k: None if k in as_is else P() for k in params}
    run = shard_map(
        body,
        mesh,
        (pspec, seq, seq, seq, None if mask is None else seq),
        P(),
        axis_names={axis},
    )
    loss = run(params, split(input_ids), split(positions), split(targets), split(mask))
    return gather(loss)


def _names(x: ShardedArray, axis: str) -> bool:
    """Whether ``x``'s layout splits it over mesh axis ``axis``."""
    return axis in getattr(x.layout.spec, "axes", ())


def _call(call, module, params, ids, positions, mask):
    kwargs = {"position_ids": positions, "attention_mask": mask, "use_cache": False}
    return call(module, params, (ids,), forward_kwargs(module, kwargs, "context_parallel_loss"))


def forward_kwargs(module: torch.nn.Module, kwargs: dict, where: str) -> dict:
    """The entries of ``kwargs`` that ``module.forward`` takes (all of them with ``**kwargs``);
    a ``None`` entry it does not take is dropped, any other is an error naming it."""
    params = inspect.signature(module.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    unknown = [
        k for k, v in kwargs.items() if k not in params and v is not None and k != "use_cache"
    ]
    if unknown:
        raise ValueError(
            f"{where}: {type(module).__name__}.forward takes no {unknown} (its parameters: "
            f"{list(params)}); a model of your own takes (input_ids, position_ids=None, "
            "attention_mask=None) to be run with them"
        )
    return {k: v for k, v in kwargs.items() if k in params}
