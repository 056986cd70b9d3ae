"""The OpenAI HTTP API over colibrid: request bodies into generate requests, replies and
stream events into OpenAI's objects, daemon errors into OpenAI's error shape and status.

Pure functions only: gateway/app.py does the I/O. What OpenAI clients send that colibri
cannot honour (n > 1, logprobs, tools) is refused with a 400 naming the field, never
silently ignored; `model` is accepted whatever it says (one model is served) and answered
with the served model's id.
"""

import time
import uuid

# daemon error name -> (HTTP status, OpenAI error type)
ERRORS = {
    "BAD_MESSAGE": (400, "invalid_request_error"), "INVALID_REQUEST": (400, "invalid_request_error"),
    "UNKNOWN_TYPE": (400, "invalid_request_error"), "VERSION_MISMATCH": (500, "server_error"),
    "NOT_FOUND": (404, "invalid_request_error"), "TOO_LARGE": (413, "invalid_request_error"),
    "BUSY": (429, "rate_limit_error"), "SHUTTING_DOWN": (503, "server_error"), "LOADING": (503, "server_error"),
    "MODEL_ERROR": (500, "server_error"), "INTERNAL": (500, "server_error"), "FORBIDDEN": (403, "permission_error"),
    "CANCELLED": (499, "cancelled"), "DAEMON_DOWN": (503, "server_error"), "UNAUTHORIZED": (401, "authentication_error"),
}
UNSUPPORTED = ("tools", "functions", "tool_choice", "logprobs", "top_logprobs", "response_format", "logit_bias")


class BadRequest(Exception):
    """A request body colibri cannot run as asked; `param` names the field."""

    def __init__(self, message: str, param: str | None = None, name: str = "INVALID_REQUEST"):
        super().__init__(message)
        self.param, self.name = param, name


def error_body(name: str, message: str, param: str | None = None) -> tuple[int, dict]:
    status, kind = ERRORS.get(name, (500, "server_error"))
    return status, {"error": {"message": message, "type": kind, "param": param, "code": name.lower()}}


def _number(body: dict, key: str, kind, low=None, high=None):
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, kind):
        raise BadRequest(f"'{key}' must be {'an integer' if kind is int else 'a number'}", key)
    if (low is not None and v < low) or (high is not None and v > high):
        raise BadRequest(f"'{key}' is out of range", key)
    return v


def sampling(body: dict) -> dict:
    """The generate request's sampling fields from an OpenAI body. Raises BadRequest."""
    for key in UNSUPPORTED:
        if body.get(key) not in (None, False, [], {}):
            raise BadRequest(f"'{key}' is not supported by colibri", key)
    if body.get("n") not in (None, 1):
        raise BadRequest("'n' must be 1: colibri generates one choice", "n")
    out = {}
    max_tokens = _number(body, "max_completion_tokens", int, 1) or _number(body, "max_tokens", int, 1)
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    for key, field in (("temperature", "temperature"), ("top_p", "top_p")):
        v = _number(body, key, int | float, 0)
        if v is not None:
            out[field] = float(v)
    seed = _number(body, "seed", int)
    if seed is not None:
        out["seed"] = seed
    top_k = _number(body, "top_k", int, 0)  # (an extension llama.cpp and vLLM take too)
    if top_k is not None:
        out["top_k"] = top_k
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise BadRequest("'stop' must be a string or a list of strings", "stop")
        out["stop"] = stop
    session = body.get("session")
    if session is not None:
        if not isinstance(session, str):
            raise BadRequest("'session' must be a string", "session")
        out["session"] = session
    return out


def chat_request(body: dict) -> dict:
    """A generate request (messages and sampling) from a chat completions body."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts",
                             f"messages[{i}].content")
        out.append({"role": m["role"], "content": content})
    return {"messages": out, **sampling(body)}


def completion_request(body: dict) -> dict:
    """A generate request (a raw prompt and sampling) from a completions body."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("'prompt' must be a non-empty string (one prompt)", "prompt")
    if body.get("echo") or body.get("suffix") or body.get("best_of") not in (None, 1):
        raise BadRequest("'echo', 'suffix' and 'best_of' are not supported by colibri", "echo")
    return {"prompt": prompt, **sampling(body)}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(reply: dict) -> dict:
    p, c = len(reply.get("prompt_token_ids") or []), len(reply.get("token_ids") or [])
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def finish(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length"}.get(reason, reason)


def chat_object(rid: str, model: str, reply: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": reply["text"]},
                         "finish_reason": finish(reply.get("finish_reason")), "logprobs": None}],
            "usage": usage(reply), **({"session": reply["session"]} if reply.get("session") else {})}


def completion_object(rid: str, model: str, reply: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": reply["text"], "finish_reason": finish(reply.get("finish_reason")),
                         "logprobs": None}], "usage": usage(reply)}


def chat_chunk(rid: str, model: str, created: int, delta: dict, reason: str | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]}


def completion_chunk(rid: str, model: str, created: int, text: str, reason: str | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": reason, "logprobs": None}]}


def usage_chunk(kind: str, rid: str, model: str, created: int, reply: dict) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage(reply)}
