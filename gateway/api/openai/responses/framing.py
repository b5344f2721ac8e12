"""Responses API answers: the `response` object with its output items (reasoning, message, function_call), or the
documented server-sent events (`response.created` ... `response.completed`) built from gateway.api.blocks' events.
A finished response is stored for `previous_response_id` unless the request said `store: false`."""

from __future__ import annotations

import time
import uuid

from kv_bridge.protocol import DoneLine

from gateway.api.blocks import Block, BlockFraming, Blocks, Event
from gateway.errors import APIError

from gateway.api.openai.responses.protocol import ResponsesRequest
from gateway.api.openai.responses.translate import namespaced_names
from gateway.api.openai.responses.store import ResponseStore

_PREFIX = {"reasoning": "rs", "text": "msg", "call": "fc"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _part(block: Block) -> dict:
    if block.kind == "reasoning":
        return {"type": "reasoning_text", "text": block.text}
    return {"type": "output_text", "text": block.text, "annotations": [], "logprobs": []}


def _call_name(name: str, names: dict[str, tuple[str, str]]) -> dict:
    """A call's `name`, and its `namespace` when the model called a namespace's function by its flat name."""
    if name in names:
        namespace, local = names[name]
        return {"name": local, "namespace": namespace}
    return {"name": name}


def _item(block: Block, item_id: str, status: str, names: dict[str, tuple[str, str]]) -> dict:
    """The output item of `block`; in_progress: as `output_item.added` shows it, before any text."""
    done = status != "in_progress"
    if block.kind == "call":
        c = block.call
        return {"id": item_id, "type": "function_call", "call_id": c.id, **_call_name(c.name, names),
                "arguments": c.arguments if done else "", "status": status}
    content = [_part(block)] if done else []
    if block.kind == "reasoning":
        return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


class ResponsesFraming(BlockFraming):
    def __init__(self, req: ResponsesRequest, blocks: Blocks, conversation: list[dict],
                 store: ResponseStore | None) -> None:
        super().__init__(blocks)
        self.req, self.conversation, self.store = req, conversation, store
        self.id, self.created = _id("resp"), int(time.time())
        self._ids: dict[int, str] = {}
        self.names = namespaced_names(req.tools)
        self._seq = 0

    # ---- the response object ----

    def response(self, status: str, done: DoneLine | None = None) -> dict:
        r = self.req
        out = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": r.model,
            "output": [], "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "temperature": 1.0 if r.temperature is None else r.temperature, "top_p": 1.0 if r.top_p is None else r.top_p,
            "tools": r.tools or [], "tool_choice": r.tool_choice or "auto",
            "parallel_tool_calls": True if r.parallel_tool_calls is None else r.parallel_tool_calls,
            "previous_response_id": r.previous_response_id, "metadata": r.metadata or {},
            "text": {"format": {"type": "text"}} if r.text is None else r.text.model_dump(by_alias=True, exclude_none=True),
            "reasoning": {"effort": r.reasoning.effort if r.reasoning else None, "summary": None},
            "error": None, "incomplete_details": None, "usage": None,
        }
        if done is not None:
            out["output"] = [_item(b, self._item_id(i), "completed", self.names)
                             for i, b in enumerate(self.blocks.blocks)]
            out["usage"] = {"input_tokens": done.prompt_tokens, "output_tokens": done.completion_tokens,
                            "input_tokens_details": {"cached_tokens": done.prefix_tokens},
                            "output_tokens_details": {"reasoning_tokens": self.blocks.reasoning_tokens},
                            "total_tokens": done.prompt_tokens + done.completion_tokens}
            if done.finish_reason == "length":
                out["status"], out["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        return out

    def _item_id(self, index: int) -> str:
        if index not in self._ids:
            self._ids[index] = _id(_PREFIX[self.blocks.blocks[index].kind])
        return self._ids[index]

    def _finished(self, done: DoneLine) -> dict:
        body = self.response("completed", done)
        if self.store is not None:
            turn: dict = {"role": "assistant", "content": self.blocks.text or None}
            reasoning = "".join(b.text for b in self.blocks.blocks if b.kind == "reasoning")
            if reasoning:  # a follow-up's template gets it back, as a client's reasoning item
                turn["reasoning"] = reasoning
            if self.blocks.calls:
                turn["tool_calls"] = [{k: v for k, v in c.openai(i).items() if k != "index"}
                                      for i, c in enumerate(self.blocks.calls)]
            self.store.put(self.id, [*self.conversation, turn], body)
        return body

    # ---- complete ----

    def body(self, dones: list[DoneLine]) -> dict:
        return self._finished(dones[0])

    # ---- streamed ----

    def _event(self, kind: str, **fields) -> dict:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def opening(self, n: int) -> list[list[dict]]:
        return [[self._event("response.created", response=self.response("in_progress")),
                 self._event("response.in_progress", response=self.response("in_progress"))]]

    def closing(self, dones: list[DoneLine]) -> list[list[dict]]:
        # Cut off too (status "incomplete" inside), as vLLM does: the SDK's stream helper ends on this event only.
        return [[self._event("response.completed", response=self._finished(dones[0]))]]

    def error(self, err: APIError) -> list[list[dict]]:
        return [[self._event("error", code=err.code or err.type, message=err.message, param=err.param)]]

    def _events(self, events: list[Event]) -> list[dict]:
        out = []
        for ev in events:
            b, at = ev.block, {"item_id": self._item_id(ev.index), "output_index": ev.index}
            if ev.type == "start":
                out.append(self._event("response.output_item.added", output_index=ev.index,
                                       item=_item(b, at["item_id"], "in_progress", self.names)))
                if b.kind != "call":
                    out.append(self._event("response.content_part.added", **at, content_index=0,
                                           part={**_part(b), "text": ""}))
            elif ev.type == "delta":
                out.append(self._delta(b, at, ev.delta))
            else:
                out += self._done(b, at)
        return out

    def _delta(self, b: Block, at: dict, delta: str) -> dict:
        if b.kind == "call":
            return self._event("response.function_call_arguments.delta", **at, delta=delta)
        if b.kind == "reasoning":
            return self._event("response.reasoning_text.delta", **at, content_index=0, delta=delta)
        return self._event("response.output_text.delta", **at, content_index=0, delta=delta, logprobs=[])

    def _done(self, b: Block, at: dict) -> list[dict]:
        out = []
        if b.kind == "call":
            out.append(self._event("response.function_call_arguments.done", **at, arguments=b.call.arguments))
        elif b.kind == "reasoning":
            out.append(self._event("response.reasoning_text.done", **at, content_index=0, text=b.text))
        else:
            out.append(self._event("response.output_text.done", **at, content_index=0, text=b.text, logprobs=[]))
        if b.kind != "call":
            out.append(self._event("response.content_part.done", **at, content_index=0, part=_part(b)))
        item = _item(b, at["item_id"], "completed", self.names)
        return out + [self._event("response.output_item.done", output_index=at["output_index"], item=item)]
