"""Tools and tool traffic in a conversation, for a chat template that has no tool format of its own.

Qwen2.5-VL's, Qwen2-VL's and LLaVA-OneVision's templates render neither `tools` nor an assistant's `tool_calls`:
a call in the history would vanish from the prompt, a tool result would sit under a `tool` role the language
model never saw. Their language models (Qwen2 / Qwen2.5) were trained on Qwen2.5's tool format, so the turns are
rewritten into it, and the checkpoint's own template renders the result (`hermes_turns`):

    system    its content + "\n\n" + the tool block (schemas/tools.py `system_block`); without a system message,
              the template's default system prompt (`default_system`) + "\n\n" + the block, as Qwen2.5 does
    assistant its content, then each call as `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>`
    tool      consecutive results joined into one user turn of `<tool_response>\n…\n</tool_response>` blocks

which is, character for character, what Qwen2.5-Instruct's own template writes for the same system prompt
(tests/serve/http/test_tools.py renders both). A template
that does render tools (`renders_tools`) is given them as they are instead.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace

from pipeline.runtime.conversation import ChatPart, ChatTurn
from schemas.tools import ToolDef, format_call, system_block

_PROBE = "qvpic_probe_function"


def renders_tools(tokenizer) -> bool:
    """Whether the checkpoint's template shows the model a `tools` list (a probe function's name appears)."""
    probe = [{"type": "function", "function": {"name": _PROBE, "description": "", "parameters": {"type": "object"}}}]
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=probe, tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # noqa: BLE001  a template that refuses the argument renders no tools
        return False
    return _PROBE in text


def default_system(tokenizer) -> str:
    """The system prompt the template writes when a conversation has none ("" if it writes none): the rendering
    without a system message, less what surrounds a sentinel system message's content."""
    user = [{"role": "user", "content": "x"}]
    try:
        bare = tokenizer.apply_chat_template(user, tokenize=False)
        marked = tokenizer.apply_chat_template([{"role": "system", "content": _PROBE}, *user], tokenize=False)
    except Exception:  # noqa: BLE001  a template without a system role
        return ""
    before, _, after = marked.partition(_PROBE)
    if bare.startswith(before) and bare.endswith(after) and len(bare) >= len(before) + len(after):
        return bare[len(before):len(bare) - len(after)]
    return ""


def hermes_turns(turns: Sequence[ChatTurn], tools: list[ToolDef] | None,
                 default: str = "") -> tuple[list[ChatTurn], list[int]]:
    """`turns` in Qwen2.5's tool format, and where each old turn went (old index → new index; merged tool results
    share one). `default`: the system prompt to extend when there is none. No tools and no tool traffic: the turns
    come back unchanged."""
    out: list[ChatTurn] = []
    where: list[int] = []
    if tools:
        block = system_block(tools)
        if turns and turns[0].role == "system":
            first = turns[0]
            out.append(replace(first, parts=(*first.parts, ChatPart(text="\n\n" + block))))
            where.append(0)
            turns = turns[1:]
        else:
            out.append(ChatTurn("system", (ChatPart(text=default + "\n\n" + block if default else block),)))
    for turn in turns:
        if turn.role == "assistant" and turn.tool_calls:
            has_text = any(p.text for p in turn.parts)
            calls = "\n".join(format_call(c["function"]["name"], c["function"]["arguments"]) for c in turn.tool_calls)
            parts = (*turn.parts, ChatPart(text=("\n" if has_text else "") + calls))
            out.append(replace(turn, parts=parts, tool_calls=(), as_string=True))
        elif turn.role == "tool":
            opening = "<tool_response>\n" if not (out and out[-1].role == "tool_results") else "\n<tool_response>\n"
            parts = (ChatPart(text=opening), *turn.parts, ChatPart(text="\n</tool_response>"))
            if out and out[-1].role == "tool_results":  # Qwen's template joins consecutive results in one turn
                out[-1] = replace(out[-1], parts=(*out[-1].parts, *parts))
            else:
                out.append(ChatTurn("tool_results", parts))
        else:
            out.append(turn)
        where.append(len(out) - 1)
    return [replace(t, role="user", tool_call_id=None) if t.role == "tool_results" else t for t in out], where


def tool_dicts(tools: list[ToolDef]) -> list[dict]:
    """The tools as a template that renders them takes them (OpenAI's shape; unset fields left out)."""
    return [json.loads(t.model_dump_json(exclude_none=True)) for t in tools]
