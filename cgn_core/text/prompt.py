"""From an OpenAI request body to the prompt's token ids.

Engine and router both use this module, so the router's block hashes
(cgn_core.kv.blockhash over these ids) equal the ones the engine computes for
the same request: the same message normalisation, chat template and tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cgn_core.errors import InvalidRequest
from cgn_core.openai.tools import history_message
from cgn_core.text.chat_template import ChatTemplate
from cgn_core.text.gguf_file import GGUFFile
from cgn_core.text.tokenizer import GGUFTokenizer


@dataclass(frozen=True, slots=True)
class PromptCodec:
    """A model's tokenizer and chat template, both read from its GGUF."""

    tokenizer: GGUFTokenizer
    template: ChatTemplate

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> PromptCodec:
        tokenizer = GGUFTokenizer(gguf)
        pieces = tokenizer.pieces

        def piece(key: str) -> str:
            idx = gguf.get(key)
            return pieces[int(idx)] if idx is not None and 0 <= int(idx) < len(pieces) else ""

        template = ChatTemplate(
            gguf.get("tokenizer.chat_template"),
            bos_token=piece("tokenizer.ggml.bos_token_id"),
            eos_token=piece("tokenizer.ggml.eos_token_id"),
        )
        return cls(tokenizer, template)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the templated conversation (the template writes any BOS itself)."""
        return self.tokenizer.encode(self.chat_text(messages, tools), add_bos=False)

    def chat_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The templated conversation. `tools` go to a template that renders them; any other
        template gets them as a system message in the Hermes format
        (`fallback_tool_messages`)."""
        if tools and not self.template.renders_tools:
            messages, tools = fallback_tool_messages(messages, tools), None
        return self.template.render(messages, tools=tools)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a completion prompt (BOS added where the model wants one)."""
        return self.tokenizer.encode(text)


FALLBACK_TOOLS = """You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def fallback_tool_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """A conversation with tools for a template that has no tool section: the tools as a
    system message (joined to the caller's own system message), earlier calls and results
    as text in the same Hermes format the model is asked to answer in."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    text = FALLBACK_TOOLS.format(tools=listing)
    out = [dict(m) for m in messages]
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{text}"
    else:
        out.insert(0, {"role": "system", "content": text})
    for m in out:
        for call in m.pop("tool_calls", None) or ():
            body = json.dumps(call["function"], ensure_ascii=False)
            m["content"] = f"{m['content']}\n<tool_call>\n{body}\n</tool_call>".lstrip("\n")
        if m["role"] == "tool":
            m["role"], m["content"] = "user", f"<tool_response>\n{m['content']}\n</tool_response>"
    return out


def chat_messages(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    """The validated `messages` of a chat body, content parts joined, `developer` as `system`."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise InvalidRequest(f"{where} must be an object", param=where)
        role = msg.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise InvalidRequest(
                f"{where}.role must be system, user, assistant or tool", param=where
            )
        content = msg.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            parts = []
            for part in content:
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise InvalidRequest(
                        f"{where}.content: only text parts are supported", param=where
                    )
                parts.append(part["text"])
            content = "".join(parts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise InvalidRequest(f"{where}.content must be a string", param=where)
        msg = history_message(msg, where)
        out.append({**msg, "role": "system" if role == "developer" else role, "content": content})
    return tuple(out)


def completion_prompt(body: Mapping[str, Any]) -> tuple[str | None, tuple[int, ...] | None]:
    """A completion body's prompt: (text, None) or (None, ids); a batch of one is unwrapped."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("'prompt' must not be empty", param="prompt")
        return prompt, None
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return None, tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise InvalidRequest(
            "batched prompts are not supported; send one prompt per request", param="prompt"
        )
    raise InvalidRequest(
        "'prompt' must be a non-empty string or a list of token ids", param="prompt"
    )
