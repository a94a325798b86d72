"""The API's refusals: :class:`ApiError` (an HTTP status and OpenAI's error object), a backend's
error kinds as HTTP statuses (:data:`HTTP_STATUS`), and request bodies validated into their models
with the field at fault named (:func:`parse_body`)."""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import BaseModel, ValidationError

from goodspeed.serving.generation import RequestError


class ApiError(Exception):
    """A refusal with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s  # sent as Retry-After (whole seconds, at least 1)
        self.type = type_ or {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                              429: "rate_limit_error", 503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """``Retry-After`` when the refusal says when to retry (RFC 9110: whole seconds)."""
        return {} if self.retry_after_s is None else {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    @classmethod
    def of(cls, exc: RequestError) -> "ApiError":
        """A backend's refusal or failure as the HTTP status of its kind (:data:`HTTP_STATUS`)."""
        return cls(HTTP_STATUS[exc.kind], exc.message, param=exc.param, code=exc.code, retry_after_s=exc.retry_after_s)


# A backend's error kinds (goodspeed.serving.generation.ERROR_KINDS) as HTTP statuses
HTTP_STATUS = {"invalid": 400, "unauthorized": 401, "overloaded": 429, "unavailable": 503, "upstream": 502, "timeout": 504,
               "internal": 500}


def parse_body(model: type[BaseModel], body: Any) -> BaseModel:
    """Validate a JSON body into ``model``; 400 with the deepest problem's field path otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        # the deepest problem: where a union's members all fail, the member that got furthest names it
        # (a list of content parts whose part has a wrong type, not "content should be a string")
        first = max(exc.errors(), key=lambda e: len(e["loc"]))
        param = ".".join(str(p) for p in first["loc"]) or None
        message = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
        raise ApiError(400, f"{param}: {message}" if param else message, param=param) from None
    if hasattr(request, "refuse_unsupported"):
        request.refuse_unsupported()
    return request


def renamed(exc: ApiError, names: dict[str, str]) -> ApiError:
    """A chat completion's refusal as another API that is served by it names its fields (the
    Responses API's, Anthropic's Messages API's): ``names`` maps chat's field names to its."""
    param, message = exc.param, exc.message
    if param is not None and param.split(".")[0] in names:
        head = param.split(".")[0]
        param = names[head] + param[len(head):]
    for old, new in names.items():
        if "_" in old:  # a field's name in the text (not a word of prose such as "messages" or "stop")
            message = re.sub(rf"\b{re.escape(old)}\b", new, message)
    return ApiError(exc.status, message, param=param, code=exc.code, type_=exc.type)
