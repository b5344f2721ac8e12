"""qwen3-coder's XML-style calls: `<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`,
read as vLLM's qwen3_coder parser reads them: a call may open at `<function=` without `<tool_call>`, a value ends
at `</parameter>` or, when the model dropped it, at the next `<parameter=` or `</function>`, and inside a value
`</tool_call>` is text. Values take their JSON types from the request's tool schema (gateway.text.toolcalls.schema_types).
Calls stream: the name when `<function=NAME>` is complete, then the arguments' JSON text as values arrive (a text
value as it is written, any other when it ends)."""

from __future__ import annotations

import json

from gateway.text.markers import MarkerScanner
from gateway.text.toolcalls.base import CallPiece, ToolCall, ToolDelta
from gateway.text.toolcalls.schema_types import coerce, is_text

MARKERS = ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", ">")


class _Call:
    def __init__(self, number: int, name: str, schema: dict):
        self.number, self.call = number, ToolCall(name, "")
        self.props = (schema.get("parameters") or {}).get("properties") or {}
        self.params = 0  # parameters written so far (the next one needs a separator)
        self.param, self.value, self.text = "", "", False
        self.lead, self.held = True, ""  # one newline each side of a value is the template's markup; `held`: a
        # value's tail that may be markup: its last newline, or a `</tool_call>` that ends the call if nothing follows


class Qwen3XMLToolParser:
    def __init__(self, tools: list[dict]):
        self.tools = {(t.get("function") or {}).get("name"): t.get("function") or {} for t in tools}
        self.scanner = MarkerScanner(MARKERS)
        self.state = "content"  # content | preamble | name | args | pname | value | between
        self.raw = ""  # a call's opening text, given back as content if no function follows
        self.name = ""
        self.call: _Call | None = None
        self.started = 0

    def feed(self, text: str) -> ToolDelta:
        d = ToolDelta()
        for kind, s in self.scanner.feed(text):
            self._step(kind, s, d)
        return d

    def finish(self) -> ToolDelta:
        """The held-back tail; a call cut off (max tokens) ends with what came, as vLLM's partial arguments."""
        d = ToolDelta()
        for kind, s in self.scanner.flush():
            self._step(kind, s, d)
        if self.state in ("args", "pname", "value"):
            self._close(d, cut_off=True)
        elif self.state in ("preamble", "name"):
            d.content += self.raw + self.name
        self.state = "content"
        return d

    def _step(self, kind: str, s: str, d: ToolDelta) -> None:
        getattr(self, f"_{self.state}")(kind, s, d)

    def _content(self, kind: str, s: str, d: ToolDelta) -> None:
        if kind == "marker" and s in ("<tool_call>", "<function="):
            self.raw, self.name = s, ""
            self.state = "preamble" if s == "<tool_call>" else "name"
        else:
            d.content += s

    def _preamble(self, kind: str, s: str, d: ToolDelta) -> None:
        if kind == "marker" and s == "<function=":
            self.raw, self.name, self.state = self.raw + s, "", "name"
        elif kind == "marker" and s == "</tool_call>":  # a call with no function in it is text
            d.content += self.raw + s
            self.state = "content"
        else:
            self.raw += s

    def _name(self, kind: str, s: str, d: ToolDelta) -> None:
        if kind == "text":
            self.name += s
        elif s == ">" and self.name.strip() and not any(c.isspace() for c in self.name.strip()):
            name = self.name.strip()
            self.call = _Call(self.started, name, self.tools.get(name, {}))
            self.started += 1
            d.pieces.append(CallPiece(self.call.number, "", name, self.call.call.id))
            self._emit("{", d)
            self.state = "args"
        else:  # not a function header after all: what came is text
            d.content += self.raw + self.name + s
            self.state = "content"

    def _args(self, kind: str, s: str, d: ToolDelta) -> None:
        if kind == "marker" and s == "<parameter=":
            self.call.param, self.state = "", "pname"
        elif kind == "marker" and s in ("</function>", "</tool_call>", "<tool_call>", "<function="):
            self._close(d)
            self.state = "between" if s == "</function>" else "content"
            if s in ("<tool_call>", "<function="):  # the next call began without closing this one
                self._content(kind, s, d)
        # anything else between parameters (whitespace, a stray `>`) is the template's layout

    def _pname(self, kind: str, s: str, d: ToolDelta) -> None:
        c = self.call
        if kind == "text":
            c.param += s
        elif s == ">" and c.param.strip():
            c.param, c.value, c.lead, c.held = c.param.strip(), "", True, ""
            c.text = is_text(c.props.get(c.param))
            if c.text:
                self._emit(self._key() + '"', d)
            self.state = "value"
        else:
            self.state = "args"
            self._args(kind, s, d)

    def _value(self, kind: str, s: str, d: ToolDelta) -> None:
        if kind == "marker" and s in ("</parameter>", "<parameter=", "</function>"):
            self._end_value(d)
            self.state = "args"
            if s != "</parameter>":  # the model dropped `</parameter>`: the value ended here
                self._args(kind, s, d)
            return
        c = self.call
        if c.lead and s:
            s, c.lead = s[1:] if s.startswith("\n") else s, False
        s, c.held = c.held + s, ""
        cut, end = len(s), s.rfind("</tool_call>")
        if end != -1 and not s[end + len("</tool_call>"):].strip():
            cut = end - 1 if s[:end].endswith("\n") else end
        elif s.endswith("\n"):
            cut -= 1
        s, c.held = s[:cut], s[cut:]
        self._value_text(s, d)

    def _value_text(self, s: str, d: ToolDelta) -> None:
        self.call.value += s
        if self.call.text and s:
            self._emit(json.dumps(s, ensure_ascii=False)[1:-1], d)

    def _between(self, kind: str, s: str, d: ToolDelta) -> None:
        if kind == "marker" and s == "</tool_call>":
            self.state = "content"
        elif kind == "marker" and s in ("<tool_call>", "<function="):
            self._content(kind, s, d)
        elif s.strip():
            self.state = "content"
            d.content += s

    def _key(self) -> str:
        c = self.call
        c.params += 1
        return (", " if c.params > 1 else "") + json.dumps(c.param, ensure_ascii=False) + ": "

    def _end_value(self, d: ToolDelta, cut_off: bool = False) -> None:
        """The value is complete: what was held is part of it, less the template's newline; cut off (the output
        ended), a held `</tool_call>` was the call's end."""
        c = self.call
        if not cut_off:
            self._value_text(c.held[:-1] if c.held.endswith("\n") else c.held, d)
        c.held = ""
        if c.text:
            self._emit('"', d)
        else:
            self._emit(self._key() + json.dumps(coerce(c.value, c.props.get(c.param)), ensure_ascii=False), d)

    def _close(self, d: ToolDelta, cut_off: bool = False) -> None:
        if self.state == "value":
            self._end_value(d, cut_off)
        self._emit("}", d)
        d.calls.append(self.call.call)
        self.call = None

    def _emit(self, fragment: str, d: ToolDelta) -> None:
        self.call.call.arguments += fragment
        d.pieces.append(CallPiece(self.call.number, fragment))
