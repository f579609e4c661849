"""Every public name has a docstring with an example that runs (issue 24 item 3).

The public names are ``fshard.__all__`` and the ``__all__`` of ``fs.lax``, ``fs.nn``,
``fs.optim``, ``fs.checkpoint``, ``fs.hf_checkpoint``, ``fs.debug``, ``fs.launch``, ``fs.data`` and ``fs.parallel``.
Each needs its own docstring with a ``>>>`` example, none skipped. The examples run as doctests, with the globals of
the module that defines the name plus ``fs`` and ``torch``, on 2 ranks (the suite's ``world2``:
an example's output must be the same on both), except ``fs.launch``'s, which start their own
ranks and so run in this process. The reference site (``mkdocs build --strict``)
renders the same docstrings.
"""

import doctest
import inspect
import typing

import pytest
import torch

import fshard as fs
import fshard.tree

MODULES = {
    "fshard": fs,
    "fshard.lax": fs.lax,
    "fshard.nn": fs.nn,
    "fshard.optim": fs.optim,
    "fshard.checkpoint": fs.checkpoint,
    "fshard.hf_checkpoint": fs.hf_checkpoint,
    "fshard.debug": fs.debug,
    "fshard.launch": fs.launch,
    "fshard.data": fs.data,
    "fshard.parallel": fs.parallel,
}


def public_names() -> list[tuple[str, str]]:
    """``(module, name)`` of every public name, in ``__all__`` order."""
    return [(m, n) for m, mod in MODULES.items() for n in mod.__all__]


def is_type_alias(obj) -> bool:
    """A typing alias (``Schedule = Callable[...]``) cannot carry a docstring of its own: its
    ``__doc__`` is typing's. The site shows the comment-docstring written after it."""
    return typing.get_origin(obj) is not None or obj is typing.Any


def _obj(module: str, name: str):
    """The object whose docstring documents ``module.name``: the name's own, or for a name
    fshard re-exports from optree (``fs.tree_map``), ``fshard.tree``'s, whose example uses it."""
    obj = getattr(MODULES[module], name)
    foreign = not getattr(obj, "__module__", "fshard").startswith("fshard")
    if foreign and not inspect.ismodule(obj) and not is_type_alias(obj):
        return fshard.tree
    return obj


def own_doc(obj) -> str | None:
    """The docstring ``obj`` was given, not one it inherits or a generated one (NamedTuple's
    ``Name(field, ...)``, a class's ``__init__``'s)."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    if inspect.isclass(obj) and doc and doc.startswith(f"{obj.__name__}("):
        return None  # collections.namedtuple's generated text
    return doc


def problems() -> list[str]:
    out = []
    for module, name in public_names():
        obj = _obj(module, name)
        if is_type_alias(obj):
            continue
        doc = own_doc(obj)
        if not doc:
            out.append(f"{module}.{name}: no docstring")
        elif ">>>" not in doc:
            out.append(f"{module}.{name}: no >>> example")
        elif obj is fshard.tree and f"fs.{name}(" not in doc:
            out.append(f"{module}.{name}: not in fshard.tree's example")
        elif "+SKIP" in doc:
            out.append(f"{module}.{name}: a skipped example")
    return out


def run_examples(names: list[tuple[str, str]]) -> list[str]:
    """Runs the examples of ``names``' docstrings; the failures' reports."""
    failures = []
    finder = doctest.DocTestFinder(recurse=False)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    seen = set()
    for module, name in names:
        obj = _obj(module, name)
        if is_type_alias(obj) or not own_doc(obj) or id(obj) in seen:
            continue
        seen.add(id(obj))
        home = obj if inspect.ismodule(obj) else inspect.getmodule(obj)
        globs = {**vars(home), "fs": fs, "torch": torch}
        for test in finder.find(obj, f"{module}.{name}", module=False, globs=globs):
            out: list[str] = []
            runner = doctest.DocTestRunner(optionflags=flags)
            result = runner.run(test, out=out.append)
            if result.failed:
                failures.append("".join(out))
    return failures


def examples_rank_fn(names):
    return run_examples([tuple(n) for n in names])


def test_every_public_name_has_a_docstring_with_an_example():
    assert len(public_names()) > 140, len(public_names())
    found = problems()
    assert not found, f"{len(found)} public names lack a runnable example:\n" + "\n".join(found)


def _launches(name: tuple[str, str]) -> bool:
    return name[0] == "fshard.launch" or name == ("fshard", "launch")


@pytest.mark.timeout(300)
def test_public_examples_run_on_two_ranks(world2):
    names = [n for n in public_names() if not _launches(n)]
    failures = world2.run(examples_rank_fn, names)
    for rank, found in enumerate(failures):
        assert not found, f"rank {rank}: {len(found)} failing examples:\n" + "\n".join(found)


@pytest.mark.timeout(300)
def test_launch_examples_run_here():
    """``fs.launch``'s examples start their own ranks (a World's worker may not)."""
    names = [n for n in public_names() if _launches(n)]
    assert len(names) == 7, names
    failures = run_examples(names)
    assert not failures, "\n".join(failures)


def test_own_doc_sees_generated_docstrings():
    class Point(typing.NamedTuple):
        x: int

    assert own_doc(Point) is None
    assert is_type_alias(typing.Callable[[int], int]) and not is_type_alias(fs.shard)
