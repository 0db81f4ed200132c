"""Chat templates from the GGUF (`tokenizer.chat_template`), rendered like llama.cpp and vLLM.

Jinja2 in an immutable sandbox with the conventions of HF chat templates:
`trim_blocks` and `lstrip_blocks`, a `raise_exception` helper, `tojson`,
`strftime_now`, and the variables `messages`, `add_generation_prompt`,
`bos_token`, `eos_token` (plus `tools` when given). A template error becomes
a clear 400 for the request that triggered it, never a 500.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cgn_core.errors import InvalidRequest

# Used when a GGUF carries no template (ChatML, the most common convention).
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise(message: str) -> NoReturn:
    raise InvalidRequest(f"chat template refused the conversation: {message}")


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


class ChatTemplate:
    """A compiled chat template."""

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, undefined=jinja2.ChainableUndefined
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        self.source = source or CHATML
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise InvalidRequest(f"the model's chat template does not compile: {exc}") from None
        # NOTE: a template's globals are a ChainMap over the environment's, which every render
        # copies key by key in Python (14 -> 9 µs a render, flat; nothing changes them later)
        self._template.globals = dict(self._template.globals)
        self.bos_token, self.eos_token = bos_token, eos_token
        # NOTE: a template that never reads `tools` would drop them silently
        self.renders_tools = "tools" in self.source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text for `messages`."""
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                tools=list(tools) if tools else None,
            )
        except InvalidRequest:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
            raise InvalidRequest(f"cannot apply the chat template: {exc}") from None
