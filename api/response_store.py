"""Stored Responses (OpenAI's ``store``): :class:`ResponseStore` keeps them in memory, the most
recent first, within :data:`STORE_RESPONSES` responses and :data:`STORE_CHARS` characters, each
owned by the identity that created it; :func:`page_of_items` lists a stored response's input items
as OpenAI pages them."""

from __future__ import annotations

import collections
import json
from typing import TYPE_CHECKING

from goodspeed.api.errors import ApiError

if TYPE_CHECKING:
    from multidict import MultiMapping  # aiohttp's request.query


STORE_RESPONSES = 1024  # stored responses kept in memory, the oldest forgotten first


STORE_CHARS = 64 << 20  # and characters of conversation and output kept across them


ITEMS_PAGE = 20  # OpenAI's default page of input items, of at most MAX_ITEMS_PAGE


MAX_ITEMS_PAGE = 100


def page_of_items(items: list[dict], query: MultiMapping[str]) -> dict:
    """One page of a response's input items as OpenAI lists them: ``order`` (``desc``, the
    default, newest first, or ``asc``), then the items ``after`` and/or ``before`` the ones of those
    ids, at most ``limit`` of them (1-100, default 20); ``has_more`` says whether more follow.
    A bad or unknown query parameter is a 400 that names it."""
    known = {"limit", "order", "after", "before", "include", "include[]"}
    for name in query:
        if name not in known:
            raise ApiError(400, f"unknown query parameter {name!r} (known: limit, order, after, before, include)", param=name)
    included = [value for name in ("include", "include[]") for value in query.getall(name, ()) if value]
    if included:
        raise ApiError(400, f"include: none of {', '.join(map(repr, included))} is served by this server (an item "
                            "is listed as it was given)", param="include")
    raw = query.get("limit", str(ITEMS_PAGE))
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_ITEMS_PAGE:
        raise ApiError(400, f"limit must be an integer from 1 to {MAX_ITEMS_PAGE}, not {raw!r}", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be 'asc' or 'desc', not {order!r}", param="order")
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    start, end = 0, len(ordered)
    for name in ("after", "before"):
        if name in query:
            if query[name] not in ids:
                raise ApiError(400, f"{name}: this response has no input item with id {query[name]!r}", param=name)
            if name == "after":
                start = ids.index(query[name]) + 1
            else:
                end = ids.index(query[name])
    window = ordered[start:max(start, end)]
    page = window[:int(raw)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(window) > len(page)}


def _size(value) -> int:
    return len(json.dumps(value))


class ResponseStore:
    """Stored responses in memory: each its response object, its owner, the conversation that
    led to it (chat messages) and its own input items, the most recently stored kept first within
    :data:`STORE_RESPONSES` responses and :data:`STORE_CHARS` characters."""

    def __init__(self, responses: int = STORE_RESPONSES, chars: int = STORE_CHARS) -> None:
        self.limit, self.chars = responses, chars
        self._kept: collections.OrderedDict[str, tuple[str, dict, list[dict], list[dict], int]] = collections.OrderedDict()
        self._used = 0

    def put(self, owner: str, response: dict, conversation: list[dict], inputs: list[dict] = ()) -> None:
        size = _size(response) + _size(conversation) + _size(list(inputs))
        if size > self.chars:
            return  # larger than the whole store: a later turn naming it gets the 404 an evicted one gets
        self._kept[response["id"]] = (owner, response, conversation, list(inputs), size)
        self._used += size
        while len(self._kept) > self.limit or self._used > self.chars:
            *_, dropped = self._kept.popitem(last=False)[1]
            self._used -= dropped

    def get(self, owner: str, response_id: str, param: str | None = None) -> tuple[dict, list[dict]]:
        """The response and its conversation; 404 if it is not kept or belongs to someone else."""
        kept = self._kept.get(response_id)
        if kept is None or kept[0] != owner:
            raise ApiError(404, f"no stored response with id {response_id!r} (responses are kept in memory, the "
                                f"{self.limit} latest; one made with store: false is not)", param=param,
                           code="response_not_found")
        return kept[1], kept[2]

    def input_items(self, owner: str, response_id: str) -> list[dict]:
        """The response's own input items, in order; 404 as :meth:`get`."""
        self.get(owner, response_id)
        return self._kept[response_id][3]

    def delete(self, owner: str, response_id: str) -> None:
        self.get(owner, response_id)
        *_, size = self._kept.pop(response_id)
        self._used -= size

    def __len__(self) -> int:
        return len(self._kept)
