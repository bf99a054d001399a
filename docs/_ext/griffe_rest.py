"""A griffe extension for the API reference (mkdocs.yml, mkdocstrings ``extensions:``).

pinpool's docstrings are prose written for ``help()``, with a few reST habits that Markdown
renders badly. This rewrites them, for the site only (the source is untouched):

- ``:class:`X```, ``:func:`X```, ``:meth:`X``` and the other Sphinx roles become code that
  links to ``X``'s entry where the reference documents it (an optional cross-reference: a
  private or external name stays plain code, and never fails the strict build);
- a paragraph ending in ``::`` before an indented block ends in ``:`` (the block is already
  a Markdown code block);
- an ``Options:`` style block (a line ``Name:`` followed by ``  key: text`` lines indented
  two spaces) becomes a bulleted list, one item per key;
- ``PinnedPool(**options)`` and ``pin(tensor, **options)`` show the declared keywords with their
  types and defaults (``pinpool._plan.declared``), as ``help()`` does, and PinnedPool's
  ``Options:`` their help, as its ``__doc__`` does at run time.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import griffe

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pinpool._plan.declared import OPTIONS, Option

_ROLE = re.compile(r":(?:class|func|meth|data|attr|exc|mod|obj):`~?([A-Za-z_][\w.]*)`")
_LITERAL_BLOCK = re.compile(r"(\S)::\n\n", re.MULTILINE)
_KEY_LINE = re.compile(r"^  ([A-Za-z_][\w, ]*):( .*)?$")


class RestDocstrings(griffe.Extension):
    """Rewrite every docstring of the loaded package once it is loaded (aliases resolved)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name == "pinpool":
            _declared_keywords(pkg)
        for obj in _walk(pkg, set()):
            docstring = obj.docstring
            if docstring is not None:
                docstring.value = _rewrite(docstring.value, obj)


def _declared_keywords(pkg: griffe.Module) -> None:
    """``**options`` in the two signatures that take them replaced by the declared keywords."""
    for path, pin in (("_pool.pool.PinnedPool.__init__", False), ("_pool.pin.pin", True)):
        function = pkg[path]
        keywords = [o for o in OPTIONS if (o.pin if pin else o.pool)]
        fixed = [p for p in function.parameters if p.kind is not griffe.ParameterKind.var_keyword]
        function.parameters = griffe.Parameters(*fixed, *(_parameter(o, pin) for o in keywords))
    pool = pkg["_pool.pool.PinnedPool"]
    help_lines = "".join(f"\n  {o.name}: {o.help}." for o in OPTIONS if o.pool)
    pool.docstring.value += f"\n\nOptions:{help_lines}"


def _parameter(option: Option, pin: bool) -> griffe.Parameter:
    default = option.shown(option.default_for_pin if pin else option.default)
    return griffe.Parameter(
        option.name, annotation=option.type, kind=griffe.ParameterKind.keyword_only, default=default
    )


def _walk(obj: griffe.Object, seen: set[str]) -> list[griffe.Object]:
    if obj.path in seen:
        return []
    seen.add(obj.path)
    found = [obj]
    for member in obj.members.values():
        if member.is_alias:
            continue
        assert isinstance(member, griffe.Object)
        found += _walk(member, seen)
    return found


def _rewrite(text: str, obj: griffe.Object) -> str:
    text = _LITERAL_BLOCK.sub(r"\1:\n\n", text)
    text = _definition_lists(text)
    return _ROLE.sub(lambda m: _reference(m[1], obj), text)


def _reference(name: str, obj: griffe.Object) -> str:
    """Code that links to ``name`` where the site documents it (resolved in obj's scope)."""
    target = name
    if not name.startswith("pinpool."):
        scope = obj if obj.is_class or obj.is_module else obj.parent
        try:
            target = scope.resolve(name) if scope is not None else name
        except (griffe.NameResolutionError, griffe.AliasResolutionError, KeyError, ValueError):
            target = name
    label = name.rsplit(".", 1)[-1] if name.startswith("pinpool._") else name
    return f'<autoref identifier="{target}" optional><code>{label}</code></autoref>'


def _definition_lists(text: str) -> str:
    """``Options:`` + ``  key: text`` (+ deeper continuation lines) -> a Markdown list."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        if not (line.endswith(":") and not line.startswith(" ") and i < len(lines) and _KEY_LINE.match(lines[i])):
            continue
        out.append("")
        while i < len(lines) and (match := _KEY_LINE.match(lines[i]) or lines[i].startswith("    ")):
            if isinstance(match, re.Match):
                out.append(f"- `{match[1]}`:{match[2] or ''}")
            else:
                out.append("  " + lines[i].strip())
            i += 1
        out.append("")
    return "\n".join(out)
