"""Every difference between the torch and Python versions fshard supports, decided once at import.

No other module tests a version or probes an attribute of torch: each difference is one name here,
bound when fshard is imported, and the rest of the package calls that name. Adding support for an
older or newer torch means adding a row here (and a line to ``tests/data/torch_api_oldest.txt``,
which ``tests/test_compat.py`` checks every ``torch.*`` name in fshard against).

| name | newest torch (2.13+) | oldest supported (2.11) |
|---|---|---|
| :func:`all_gather_into` | ``dist.all_gather_single`` | ``dist.all_gather_into_tensor`` |
| :func:`funcol_all_gather` | ``_functional_collectives.all_gather_single`` | ``all_gather_tensor`` |
| :func:`funcol_reduce_scatter` | ``_functional_collectives.reduce_scatter_single`` | ``reduce_scatter_tensor`` |
| :func:`is_exporting` | ``torch.compiler.is_exporting()`` | the same, but True inside *every* dynamo trace; export is then told apart by export's own flag |
| :data:`TRACES_TREESPEC_EQ` | dynamo compares optree specs | it cannot: ``fs.optim`` checks structure in eager only |
| :func:`attribute_callable` | dynamo calls a ``torch.Tensor`` method held in an attribute | it cannot: such a method is wrapped in a Python function |
| :data:`TRACES_CLASS_EQ` | dynamo compares classes | ``ShardedArray.__eq__(cls)`` answers for a class |
| :data:`TRACES_TUPLE_HASH` | dynamo hashes tuples: a ``shard_map`` body compiles | it cannot: ``shard_map`` under ``torch.compile`` is refused, naming torch 2.13 |
| :data:`TRACES_ATTRIBUTE_DELETE` | dynamo traces deleting a module attribute it saw set | it cannot: ``functional_call`` rebinds ``forward`` under dynamo |
| :func:`nccl_reduces_float8` | NCCL 2.24+: float8 reductions | older NCCL: float8 moves only |
| :func:`freeze_key` | (Python 3.12+: ``slice`` hashes) | Python 3.11: slices in cache keys become tuples |
| :func:`trace_matmul_operator` | (2.14+) dynamo traces ``a @ b`` of a Python class through its ``__matmul__``; ``a @ tensor`` (2.11-2.14) is traced as ``tensor @ a``: fixed | 2.11-2.13 cannot ("builtin operator matmul"): 2.14's handler is installed for ShardedArray operands when dynamo is imported |
| :func:`trace_torch_function_in_tuples` | (2.11-2.14.1, every version so far) dynamo looks for ``__torch_function__`` inside list and dict arguments, not tuples: ``torch.cat((a, b))`` of ShardedArrays breaks the graph (eager looks inside both) | the same; its argument flattening gains tuples when dynamo is imported |
| :data:`GRAD_FROM_FUNCTION_NODES` | ``torch.autograd.grad`` starts from a custom Function's node (a ``GradientEdge`` root) after a backward through it: ZB-H1's weight pass runs only the weight branches | 2.11-2.12: it raises ("``_input_metadata`` is invalid ... legacy access pattern"): where a stage's cut meets such a node, the weight pass runs the stage's whole backward again (the same numbers, more compute) |
| :data:`STAGER_REUSABLE` | DCP's ``DefaultStager`` keeps its host copies between ``stage`` calls: ``fs.checkpoint.save(blocking=False)`` keeps one for the process | 2.11-2.12: it closes its copier after every ``stage`` (a second call raises ``KeyError: <class 'type'>``): one stager per save |

The older names still exist in 2.13 but warn (deprecated), so the new ones are preferred where
they exist.
"""

from __future__ import annotations

import collections
import functools
import importlib.abc
import importlib.util
import operator
import sys
import types

import torch
import torch.distributed as dist
import torch.utils.checkpoint

#: ``(major, minor)`` of the running torch, for the compatibility table (docs/measurements.md) and error text.
TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split(".")[:2])

#: The oldest torch the suite has passed on (declared in pyproject.toml; docs/measurements.md, "Compatibility").
OLDEST_TORCH: tuple[int, int] = (2, 11)

_HAS_GATHER_SINGLE = hasattr(dist, "all_gather_single")

#: ``all_gather_into(out, x, group=None, async_op=False)``: every rank's ``x`` into ``out`` along
#: dim 0, in group-rank order.
all_gather_into = dist.all_gather_single if _HAS_GATHER_SINGLE else dist.all_gather_into_tensor

#: ``reduce_scatter_into(out, x, group=None, async_op=False)``: the sum over ranks of ``x``'s
#: group-rank-th block of dim 0, into ``out``.
reduce_scatter_into = (
    dist.reduce_scatter_single
    if hasattr(dist, "reduce_scatter_single")
    else dist.reduce_scatter_tensor
)


def funcol():
    """``torch.distributed._functional_collectives``, imported on first use (it imports dynamo:
    seconds at fshard import). Callers pass detached tensors: these are raw collectives, as in
    eager (fshard's Functions define their gradients), and the ops' own autograd kernels fail
    under ``torch.func.grad`` in dynamo. tools/torch_api.py checks the names read from it."""
    from torch.distributed import _functional_collectives

    return _functional_collectives


def funcol_all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """The functional all_gather of ``x`` along dim 0 over process group ``group`` (traced code)."""
    f = funcol()
    if _HAS_GATHER_SINGLE:
        return f.all_gather_single(x, 0, group)
    return f.all_gather_tensor(x, 0, group)


def funcol_reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """The functional sum-reduce_scatter of ``x`` along dim 0 over ``group`` (traced code)."""
    f = funcol()
    if _HAS_GATHER_SINGLE:
        return f.reduce_scatter_single(x, "sum", 0, group)
    return f.reduce_scatter_tensor(x, "sum", 0, group)


#: torch < 2.13: dynamo folds ``torch.compiler.is_exporting()`` to True in *every* frame it
#: traces (torch/_dynamo/variables/torch.py, ``tracing_state_functions``), so inside a plain
#: ``torch.compile`` it says "exporting". The flag it should have read is export's own, which
#: export sets around both its strict and non-strict traces and dynamo reads as a guarded global.
_EXPORT_CALL_FOLDED = TORCH_VERSION < (2, 13)


def is_exporting() -> bool:
    """Whether ``torch.export`` is tracing the caller, on every supported torch (not True
    inside a plain ``torch.compile`` trace, as ``torch.compiler.is_exporting()`` is on 2.11).

    Example:
        >>> is_exporting()
        False
    """
    if _EXPORT_CALL_FOLDED:
        return torch.compiler._is_exporting_flag
    return torch.compiler.is_exporting()


#: Whether dynamo can trace ``spec_a != spec_b`` of optree tree specs (torch 2.11's pytree
#: polyfill compares their function-valued fields and raises "Polyfill handler ... __eq__").
#: Where it cannot, ``fs.optim``'s structure checks run in eager calls only.
TRACES_TREESPEC_EQ = TORCH_VERSION >= (2, 13)


#: Whether dynamo can call a C method descriptor (``torch.Tensor.mean``) read from an object's
#: attribute (torch 2.11: "Dynamo does not know how to trace method ``fn`` of class ...").
_TRACES_DESCRIPTOR_ATTRIBUTES = TORCH_VERSION >= (2, 13)
_DESCRIPTORS = (
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.ClassMethodDescriptorType,
)


def attribute_callable(fn):
    """``fn``, made callable from an object's attribute under dynamo: on torch < 2.13 a C method
    descriptor is wrapped in a Python function (one more frame in eager), elsewhere ``fn``.

    Example:
        >>> attribute_callable(abs)(-2)
        2
    """
    if _TRACES_DESCRIPTOR_ATTRIBUTES or not isinstance(fn, _DESCRIPTORS):
        return fn

    def call(*args, **kwargs):
        return fn(*args, **kwargs)

    return call


#: Whether dynamo compares two classes as Python does. torch 2.11's ``cmp_eq`` polyfill calls
#: ``a.__eq__(b)`` for classes ``a``, ``b``: with ``a`` the ShardedArray class that is the
#: elementwise ``__eq__`` op called on the class ``b`` (optree's ``node_type != spec.type`` in
#: ``fs.tree_map`` under ``torch.compile``). Where it does not, ShardedArray's ``__eq__`` and
#: ``__ne__`` answer for a class argument.
TRACES_CLASS_EQ = TORCH_VERSION >= (2, 13)


#: Whether dynamo traces ``hash`` of a tuple (torch 2.11: "Dynamo does not know how to trace
#: builtin operator hash with argument types ['tuple']"), which a ``Layout`` made inside a trace
#: needs. Where it does not, a ``shard_map`` called under ``torch.compile`` is refused with the
#: version in the message (without ``fullgraph`` dynamo then runs it eagerly, as before).
TRACES_TUPLE_HASH = TORCH_VERSION >= (2, 13)


#: Whether dynamo traces deleting an instance attribute of a module that a traced call set
#: (torch 2.11 refuses ``del m.__dict__[k]`` and ``m.__dict__.pop``, and replays a traced
#: ``delattr`` of such an attribute wrongly: the module loses the class's ``forward``).
#: Where it does not, ``fs.nn.functional_call`` restores an ``Output``-patched ``forward`` under
#: dynamo by binding the class's ``forward`` to the instance (the same calls).
TRACES_ATTRIBUTE_DELETE = TORCH_VERSION >= (2, 13)

#: Whether ``torch.autograd.grad`` takes a custom autograd.Function's backward node as a
#: ``GradientEdge`` root, and shows its ``next_functions``, after a backward has run through it
#: (2.13+). torch 2.11 raises "Attribute '_input_metadata' (or 'next_functions') is invalid for
#: this instance of _C._FunctionBase ... legacy access pattern"; there ZB-H1's weight pass
#: (``fshard.parallel.pipeline``) runs the stage's whole backward where its cut meets one.
GRAD_FROM_FUNCTION_NODES = TORCH_VERSION >= (2, 13)

#: Whether DCP's ``DefaultStager`` can ``stage`` more than once (2.13+). torch 2.11's closes its
#: state-dict copier at the end of every ``stage`` (breaking a reference cycle), so a second
#: call raises ``KeyError: <class 'type'>`` and no host copy is kept between saves; there
#: ``fs.checkpoint`` makes a stager per save.
STAGER_REUSABLE = TORCH_VERSION >= (2, 13)

#: The non-reentrant generator that ``torch.utils.checkpoint.checkpoint`` looks up by name at
#: each call (``fs.nn.functional_call`` wraps it so that a recompute runs with the values swapped
#: in, the caller's ``context_fn`` included). torch 2.14 calls
#: ``_checkpoint_without_reentrant_generator_impl(fn, args, kwargs, *, context_fn=...)`` and
#: keeps the older name only as a shim it does not call; 2.11-2.13 call
#: ``_checkpoint_without_reentrant_generator(fn, preserve_rng_state, context_fn, ...)``. Wrapping
#: the older name on 2.14 missed every caller-given ``context_fn`` (selective activation
#: checkpointing recomputed with the module's own tensors).
CHECKPOINT_GENERATOR = (
    "_checkpoint_without_reentrant_generator_impl"
    if hasattr(torch.utils.checkpoint, "_checkpoint_without_reentrant_generator_impl")
    else "_checkpoint_without_reentrant_generator"
)

#: The no-op ``autograd.Function`` through which torch 2.11's non-reentrant checkpoint saves the
#: checkpointed call's inputs for its recompute (``_NoopSaveInputs.apply(dummy, kwargs, *args)``);
#: ``None`` where it keeps them in the recompute's closure (2.13+). ``fshard.ops.opaque`` passes
#: ShardedArray inputs to it untouched (held as Python objects, as 2.13's closure holds them)
#: instead of gathering them as for any other Function: the recompute must see the same values.
CHECKPOINT_INPUT_SAVER: type | None = getattr(torch.utils.checkpoint, "_NoopSaveInputs", None)


def storage_id(t: torch.Tensor) -> int:
    """Which buffer ``t``'s storage is: its data pointer, and on ``meta`` (where every data
    pointer is 0) the address of its StorageImpl, so that meta tensors (``fs.dry_run``) share a
    buffer exactly when the device tensors would.

    Example:
        >>> a = torch.empty(4, device="meta")
        >>> storage_id(a) == storage_id(a[1:]) != storage_id(torch.empty(4, device="meta"))
        True
    """
    st = t.untyped_storage()
    return st._cdata if t.device.type == "meta" else st.data_ptr()


def data_id(t: torch.Tensor) -> tuple[int, int]:
    """Where ``t``'s first element is: ``(storage_id(t), byte offset)``; equal for two live
    tensors exactly when their ``data_ptr()`` is (on meta too, unlike ``data_ptr()``)."""
    return storage_id(t), t.storage_offset() * t.element_size()


@functools.cache
def nccl_reduces_float8() -> bool:
    """Whether the NCCL torch runs with reduces float8 (e4m3fn, e5m2) values: NCCL 2.24+ has
    float8 types, which torch then maps them to (``NCCL_SUPPORTS_FP8`` in
    torch/csrc/distributed/c10d/NCCLUtils.hpp); older ones carry float8 as uint8 and torch
    refuses to reduce it. Seen: all_reduce of float8 accepted on torch 2.11 with NCCL 2.28.9.
    False on a build without NCCL.

    Example:
        >>> isinstance(nccl_reduces_float8(), bool)
        True
    """
    try:
        return tuple(torch.cuda.nccl.version()[:2]) >= (2, 24)
    except Exception:  # a CPU build has no NCCL
        return False


def freeze_key(v):
    """``v`` made hashable for a cache key: slices become tuples (a ``slice`` hashes only from
    Python 3.12), recursively through tuples and lists.

    Example:
        >>> freeze_key((slice(None, 2), Ellipsis, [1, 2]))
        (('slice', None, 2, None), Ellipsis, ('list', 1, 2))
    """
    if isinstance(v, slice):
        return ("slice", v.start, v.stop, v.step)
    if isinstance(v, tuple):
        return tuple(freeze_key(e) for e in v)
    if isinstance(v, list):
        return ("list", *(freeze_key(e) for e in v))
    return v


_DYNAMO_BUILTIN = "torch._dynamo.variables.builtin"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``fn(module)`` right after module ``name`` is first imported (then leaves
    ``sys.meta_path``): patching dynamo when fshard is imported would import dynamo (seconds)."""

    def __init__(self, name: str, fn):
        self.name, self.fn = name, fn

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run, fn = spec.loader.exec_module, self.fn

        def exec_module(module):
            run(module)
            fn(module)

        spec.loader.exec_module = exec_module
        return spec


def _after_import(name: str, fn) -> None:
    module = sys.modules.get(name)
    if module is not None:
        fn(module)
    else:
        sys.meta_path.insert(0, _AfterImport(name, fn))


_DYNAMO_TORCH_FUNCTION = "torch._dynamo.variables.torch_function"


def trace_torch_function_in_tuples() -> None:
    """Let ``torch.compile`` dispatch ``torch.cat((a, b))`` (a tuple holding ShardedArrays) to
    ``__torch_function__``, as eager does. dynamo decides whether a call has a torch-function
    override from its arguments flattened by ``_flatten_vts``, which opens lists and dicts but
    not tuples (torch 2.11 through 2.14.1), so a tuple of ShardedArrays reached torch's own
    ``cat`` and broke the graph: HF Llama's ``rotate_half`` (``torch.cat((-x2, x1), -1)``) on
    2+ ranks, inside ``fs.value_and_grad``'s ``torch.func.grad``, where dynamo cannot resume,
    ran the whole gradient eagerly. Installed when dynamo's module is imported; the flattening
    is dynamo's, with tuples opened too.

    Example:
        >>> trace_torch_function_in_tuples()  # fshard.array calls it once  # doctest: +SKIP
    """

    def install(module) -> None:
        if getattr(module._flatten_vts, "_fshard", False):
            return
        from torch._dynamo.variables.dicts import ConstDictVariable
        from torch._dynamo.variables.lists import ListVariable, TupleVariable

        def flatten_vts(vts):
            todo, out = collections.deque(vts), []
            while todo:
                vt = todo.popleft()
                if not vt.is_realized() and vt.peek_type() in (dict, list, tuple):
                    vt.realize()
                if vt.is_realized() and isinstance(vt, (ListVariable, TupleVariable)):
                    todo.extend(vt.items)
                elif vt.is_realized() and isinstance(vt, ConstDictVariable):
                    todo.extend(vt.items.values())
                else:
                    out.append(vt)
            return out

        flatten_vts._fshard = True
        module._flatten_vts = flatten_vts

    _after_import(_DYNAMO_TORCH_FUNCTION, install)


def trace_matmul_operator(cls: type) -> None:
    """Let ``torch.compile`` trace ``a @ b`` where ``a`` or ``b`` is a ``cls``, through
    ``cls.__matmul__`` / ``__rmatmul__``. dynamo traces the other binary operators of a Python
    class through its dunders, and from torch 2.14 ``@`` too (``BuiltinVariable.call_matmul``);
    before, it stops with "Dynamo does not know how to trace builtin operator matmul". There a
    handler that does what 2.14's does for ``cls`` operands (and nothing for others) is added to
    ``BuiltinVariable`` when dynamo is imported. On every version, ``a @ t`` with a plain
    tensor ``t`` was traced as ``t @ a`` (dynamo swaps the operands for the reflected method
    but had no reflected entry for matmul): its map gets ``Tensor.__rmatmul__``.

    Example:
        >>> class M:
        ...     def __matmul__(self, other):
        ...         return 7
        >>> trace_matmul_operator(M)
        >>> torch.compile(lambda m: m @ m, fullgraph=True, backend="eager")(M())  # doctest: +SKIP
        7
    """

    def install(module) -> None:
        # `a @ t` with a tensor t: dynamo swaps the operands to call t's reflected method, but
        # has no reflected entry for matmul and calls Tensor.__matmul__(t, a), i.e. `t @ a`
        # (2.11-2.14; a silently wrong product, or a shape error)
        module.BUILTIN_TO_TENSOR_RFN_MAP.setdefault(operator.matmul, torch.Tensor.__rmatmul__)
        builtin = module.BuiltinVariable
        if "call_matmul" in vars(builtin) and not hasattr(builtin.call_matmul, "_fshard"):
            return  # dynamo's own (2.14+)
        classes = getattr(vars(builtin).get("call_matmul"), "_fshard", frozenset()) | {cls}
        from torch._dynamo.variables.user_defined import UserDefinedObjectVariable

        def call_matmul(self, tx, a, b):
            for v, name, other in ((a, "__matmul__", b), (b, "__rmatmul__", a)):
                if isinstance(v, UserDefinedObjectVariable) and v.python_type() in classes:
                    return v.call_method(tx, name, [other], {})
            return None  # dynamo's other handlers, as before

        call_matmul._fshard = classes
        builtin.call_matmul = call_matmul

    _after_import(_DYNAMO_BUILTIN, install)
