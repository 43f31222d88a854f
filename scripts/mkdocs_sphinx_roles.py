"""mkdocs hook (mkdocs.yml ``hooks:``): the docstrings' Sphinx roles (``:func:`train```) as plain code.

The API reference pages render docstrings as Markdown, where a role's name would stay in the text
(":func:" before the code span); this drops it, leaving the code span.
"""

import re

ROLE = re.compile(r":(?:func|class|meth|attr|data|mod|exc|obj):(?=<code>)")


def on_page_content(html: str, **kwargs) -> str:
    return ROLE.sub("", html)
