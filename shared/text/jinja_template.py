"""A checkpoint's Jinja chat template, compiled and rendered exactly as transformers does it.

This mirrors ``transformers.utils.chat_template_utils`` (5.x: ``_cached_compile_jinja_template``
and ``render_jinja_template``), so that a template gives the prompt that
``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`` gives:

* the environment: ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with
  the ``loopcontrols`` extension (``{% break %}``, ``{% continue %}``) and the
  ``{% generation %}`` tag (transformers tracks assistant tokens with it; the body renders as is);
* ``tojson`` that keeps non-ASCII text (``ensure_ascii=False``) and takes ``indent``,
  ``separators``, ``sort_keys`` (Jinja's own escapes HTML characters);
* the globals ``raise_exception(message)`` (a template's way to refuse a conversation: a
  :class:`jinja2.TemplateError`), ``strftime_now(format)`` (local time, as transformers), and
  transformers' ``dict`` and ``namespace`` (a namespace refuses underscore-prefixed names);
* the variables ``messages``, ``tools`` (the request's tool definitions as sent, else None),
  ``documents`` (None: the API takes none), ``add_generation_prompt`` and the tokenizer's special
  tokens (``bos_token``, ...).

Templates from the Hub are untrusted code: jinja2 >= 3.1.6 (earlier ones have known sandbox
escapes) and the immutable sandbox, as transformers requires.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` without the class itself: no attribute access to type internals."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed names (no reach into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's own signature trick
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")


class _Generation(Extension):
    """``{% generation %}…{% endgeneration %}``: rendered as its body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def compile_template(source: str) -> jinja2.Template:
    """The compiled template; raises :class:`jinja2.TemplateSyntaxError` (with ``lineno``)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def render(template: jinja2.Template, messages: Sequence[Mapping[str, Any]],
           special_tokens: Mapping[str, str], tools: Sequence[Any] | None = None) -> str:
    """The prompt: ``messages`` (plain dicts) followed by the assistant's generation prompt.

    Raises :class:`jinja2.TemplateError` when the template refuses the messages
    (``raise_exception``) or fails on them; any other exception is the template's bug.
    """
    return template.render(messages=[dict(m) for m in messages], tools=list(tools) if tools is not None else None,
                           documents=None, add_generation_prompt=True, **special_tokens)


__all__ = ["compile_template", "render"]
