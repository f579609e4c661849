"""A griffe extension (``mkdocs.yml``): fshard's docstrings head their doctests ``Example:`` (or
``Example::``); griffe's Google-style parser knows only ``Examples:``, and would render the
doctest as prose."""

import re

import griffe

_HEADING = re.compile(r"^(\s*)Example::?[ \t]*$", re.M)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _HEADING.sub(r"\1Examples:", obj.docstring.value)
