"""Finished responses kept for `previous_response_id`: a bounded in-memory store, oldest forgotten first. Each entry
is the conversation as chat messages (without instructions, which a follow-up does not inherit) and the response."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from aiohttp import web

from gateway.errors import InvalidRequest

DEFAULT_CAPACITY = 1024  # a coding agent's session is tens of turns; many sessions fit


class ResponseNotFound(InvalidRequest):
    status = 404
    code = "previous_response_not_found"


@dataclass
class Stored:
    messages: list[dict]
    response: dict


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("a response store needs room for at least one response")
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, messages: list[dict], response: dict) -> None:
        self._items[response_id] = Stored(messages, response)
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str = "previous_response_id") -> Stored:
        """The stored response; ResponseNotFound (404) when it never was or was forgotten."""
        hit = self._items.get(response_id)
        if hit is None:
            raise ResponseNotFound(f"Previous response with id '{response_id}' not found: it was never stored "
                                   f"(store: false) or this gateway has forgotten it (restart, or more than "
                                   f"{self.capacity} newer responses)", param=param)
        self._items.move_to_end(response_id)  # a conversation in use stays
        return hit


STORE = web.AppKey("disagg_responses_store", ResponseStore)
