"""Responses requests into the shared chat request: `input` items become chat messages (function calls as assistant
`tool_calls`, their outputs as `tool` messages), flat function tools (and a namespace's functions, as
`<namespace>__<name>`, vLLM's flat form) become chat tools, `text.format` a `response_format`, `reasoning.effort`
the template's effort."""

from __future__ import annotations

import logging

from gateway.api import translate
from gateway.api.openai.protocol import ChatRequest
from gateway.api.openai.responses.protocol import ResponsesRequest, TextConfig
from gateway.api.translate import function_tool, named_function, text_of
from gateway.errors import InvalidRequest

log = logging.getLogger("gateway.api.serving")

# A namespace's function as the model sees it (vLLM's separator); answered back as name + namespace, as Codex reads.
NAMESPACE_SEP = "__"

_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def _reasoning(item: dict, param: str) -> str:
    """A reasoning item's text: its `content` (reasoning_text parts, what this gateway answers), else its summary."""
    parts = item.get("content") or item.get("summary") or []
    return text_of(parts, f"{param}.content", _TEXT_PARTS)


def _reasoned(out: list[dict]) -> dict | None:
    """The assistant turn a reasoning item opened and nothing has joined yet (no text, no calls), else None."""
    last = out[-1] if out else None
    if last and last["role"] == "assistant" and last.get("content") is None and "tool_calls" not in last:
        return last
    return None


def input_messages(items: str | list[dict]) -> list[dict]:
    """`input` as chat messages. A reasoning item opens the assistant turn its response's message and calls join, as
    its `reasoning` (the chat API's passback: gateway.text.history gives it to the template, which renders a tool-call
    turn's reasoning, as gpt-oss's published template does)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequest(f"{param}.role must be user, assistant, system or developer", param=param)
            text = text_of(item.get("content", ""), f"{param}.content", _TEXT_PARTS)
            turn = _reasoned(out)
            if role == "assistant" and turn is not None:
                turn["content"] = text  # the answer after its reasoning
                continue
            # Chat templates know system, not developer; the Responses API treats them alike.
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "reasoning":
            text = _reasoning(item, param)
            turn = _reasoned(out)
            if turn is not None:
                turn["reasoning"] = (turn.get("reasoning") or "") + text  # more than one item: one analysis
            elif text:
                out.append({"role": "assistant", "content": None, "reasoning": text})
        elif kind == "function_call":
            name = item.get("name")
            if item.get("namespace"):  # the flat name the model was shown
                name = f"{item['namespace']}{NAMESPACE_SEP}{name}"
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": name, "arguments": item.get("arguments") or "{}"}}
            if out and out[-1]["role"] == "assistant":  # parallel calls, or text then calls: one assistant turn
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": text_of(output, f"{param}.output", _TEXT_PARTS)})
        else:
            raise InvalidRequest(f"{param}: input items of type {kind!r} are not supported", param=param)
    return out


def _function(t: dict, name: str, param: str) -> dict:
    if not isinstance(t.get("name"), str) or not t["name"]:
        raise InvalidRequest(f"{param}: a function tool needs a name", param=param)
    return function_tool(name, description=t.get("description"), parameters=t.get("parameters"),
                         strict=t.get("strict"))


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' function tools as chat tools, a namespace's functions flattened to `<namespace>__<name>`. Hosted
    tools (web_search, file_search, mcp...) have nothing here to run them: dropped with a warning, as vLLM drops
    them (it renders only function tools for the model)."""
    out, dropped = [], []
    for i, t in enumerate(tools or []):
        kind = t.get("type")
        if kind == "function":
            out.append(_function(t, t.get("name"), f"tools[{i}]"))
        elif kind == "namespace" and isinstance(t.get("name"), str) and isinstance(t.get("tools"), list):
            for j, inner in enumerate(t["tools"]):
                if inner.get("type") == "function":
                    out.append(_function(inner, f"{t['name']}{NAMESPACE_SEP}{inner.get('name')}",
                                         f"tools[{i}].tools[{j}]"))
                else:
                    dropped.append(f"{t['name']}.{inner.get('type')}")
        else:
            dropped.append(str(kind))
    if dropped:
        log.warning("responses: ignoring tools the gateway cannot run: %s", ", ".join(dropped))
    return out or None


def namespaced_names(tools: list[dict] | None) -> dict[str, tuple[str, str]]:
    """Flat name -> (namespace, name) for the namespace tools of a request: how a call is named back to the client."""
    out = {}
    for t in tools or []:
        if t.get("type") == "namespace" and isinstance(t.get("tools"), list):
            for inner in t["tools"]:
                if inner.get("type") == "function":
                    out[f"{t.get('name')}{NAMESPACE_SEP}{inner.get('name')}"] = (t.get("name"), inner.get("name"))
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return named_function(choice.get("name"))
    return choice


def _response_format(text: TextConfig | None) -> dict | None:
    f = text.format if text else None
    if f is None or f.type == "text":
        return None
    if f.type == "json_object":
        return {"type": "json_object"}
    if f.schema_ is None:
        raise InvalidRequest("text.format json_schema needs a schema", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": f.name, "schema": f.schema_, "strict": f.strict}}


def chat_request(req: ResponsesRequest, history: list[dict]) -> ChatRequest:
    """The chat request to run: instructions, the stored conversation (`history`), then this request's input."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else [])
    messages += history + input_messages(req.input)
    if not messages:
        raise InvalidRequest("input must not be empty", param="input")
    body = {"model": req.model, "messages": messages, "tools": chat_tools(req.tools),
            "tool_choice": chat_tool_choice(req.tool_choice), "max_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "response_format": _response_format(req.text),
            "reasoning_effort": req.effort()}
    return translate.chat_request(body, req.model_extra)
