"""mkdocs hook (mkdocs.yml ``hooks:``): the docstrings' reST markup, rendered as plain text.

The API reference renders rlk's docstrings as Markdown. Two reST habits in them would show up
verbatim: roles (``:func:`x```, which Markdown turns into ``:func:<code>x</code>``) and the
``Example::`` that introduces a code block. This drops the role prefix (and the ``~`` that
shortens a dotted name) and writes the ``::`` as one colon.
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj):<code>~?")
_DOUBLE_COLON = re.compile(r"([^\s:])::</p>")


def on_page_content(html: str, **kwargs: object) -> str:
    return _DOUBLE_COLON.sub(r"\1:</p>", _ROLE.sub("<code>", html))
