"""A griffe extension for the API reference: the reStructuredText markup of the docstrings, rendered in Markdown.

The docstrings are written for Sphinx. Markdown already reads their ``double-backtick`` code and indented literal
blocks; two constructs it would print as they are get rewritten here:

- roles (``:func:`spikefuse.lif```, ``:class:`~torch.nn.Linear```) become the code span of their target (``~``
  keeps the last component, as in Sphinx);
- the ``::`` that ends the paragraph before a literal block becomes ``:`` (or disappears after a space), as Sphinx
  renders it.

Loaded by ``mkdocs.yml`` (mkdocstrings' ``extensions`` option).
"""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|meth|class|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")
_LITERAL_MARKER = re.compile(r"(\s?)::$", re.MULTILINE)


def _code_span(match: re.Match) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def rst_to_markdown(text: str) -> str:
    text = _ROLE.sub(_code_span, text)
    return _LITERAL_MARKER.sub(lambda m: "" if m.group(1) else ":", text)


class RstMarkup(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)
