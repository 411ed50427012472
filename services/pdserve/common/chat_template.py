"""A model's Jinja chat template, rendered the way Hugging Face ``apply_chat_template`` does.

Same environment as ``transformers`` (``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, the ``{% generation %}`` tag, a ``tojson`` that
keeps non-ASCII text and HTML characters as they are, the globals ``raise_exception`` and
``strftime_now``) and the same variables (``messages``, ``add_generation_prompt``, ``tools`` and
``documents`` as None, and the special tokens as text: ``bos_token``, ``eos_token``,
``pad_token``). So a prompt rendered here is the one the model saw in training and the one vLLM
renders for the same messages. The template comes from a worker; the sandbox keeps it from
reaching anything but its variables.

Messages arrive in OpenAI form; content given as a list of text parts is joined with newlines
(as vLLM does for templates that expect a string), None content becomes "".
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdserve.common.errors import InvalidArgumentError
from pdserve.common.tokenizer import content_text


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's tokens
    with it (for training masks); rendering keeps the body as it is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(date_format: str) -> str:
    return datetime.datetime.now().strftime(date_format)


class ChatTemplate:
    """One compiled chat template with the model's special tokens.

    ``special_tokens`` maps ``bos_token``/``eos_token``/``pad_token`` to their text (absent ones
    are left undefined, as transformers leaves unset tokens). Raises ``InvalidArgumentError``
    (``field``) if ``source`` is not a valid template.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str], *,
                 field: str = "chat_template") -> None:
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateError as exc:
            raise InvalidArgumentError(f"{field}: not a valid Jinja template ({exc})",
                                       field=field) from None
        self._special_tokens = {name: text for name, text in special_tokens.items() if text}

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool = True) -> str:
        """The prompt for ``messages``. Raises ``InvalidArgumentError``: field ``messages[i]``,
        ``messages[i].role`` or ``messages[i].content`` for a malformed message, ``messages``
        when the template refuses them (``raise_exception``) or fails on them."""
        try:
            return self._template.render(
                messages=_template_messages(messages), add_generation_prompt=add_generation_prompt,
                tools=None, documents=None, **self._special_tokens)
        except jinja2.TemplateError as exc:
            raise InvalidArgumentError(f"messages: the model's chat template refused them: {exc}",
                                       field="messages") from None
        except (TypeError, ValueError, ArithmeticError, LookupError) as exc:
            raise InvalidArgumentError(
                f"messages: the model's chat template failed on them ({type(exc).__name__}: "
                f"{exc})", field="messages") from None


def _template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as templates expect them: other keys (``name``, ``tool_calls``, ...)
    pass through; ``content`` becomes one string."""
    prepared = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidArgumentError("a chat message must be an object",
                                       field=f"messages[{index}]")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidArgumentError("role must be a non-empty string",
                                       field=f"messages[{index}].role")
        content = content_text(message.get("content"), field=f"messages[{index}].content",
                               separator="\n")
        prepared.append({**message, "content": content})
    return prepared
