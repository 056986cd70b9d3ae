"""The gateway's HTTP application (Starlette): the OpenAI API, /metrics and the live map,
each request served by talking to colibrid as a client of its user socket.

Each generate runs on its own thread with its own connection (ctl/client.py, blocking
ZeroMQ), and hands its events to the request's asyncio task through a queue. A streamed
request waits for its first event before it answers, so an error the daemon gives at once
(busy, invalid, loading, down) is an HTTP status, not a broken stream. A client that goes
away (the stream's task is cancelled, or a waiting request sees the disconnect) sets the
job's cancel flag: its thread sends cancel_request and the daemon stops the request.
"""

import asyncio
import hmac
import json
import threading
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..ctl.client import Client, DaemonDown, PermissionDenied, ReplyError, TooLarge
from ..daemon import protocol as P
from . import openai as O

DONE = object()  # the queue's end
HEAT = "0123456789abcdefghijklmnopqrstuvwxyz"  # heat 0..1 as one character a cell
MAP_POLL_S = 0.25  # the live map asks colibrid this often
WATCH_S = 0.2  # a waiting (non-streamed) request looks at its client's connection this often


class Job:
    """One generate request on its own thread and connection; its events (stream messages,
    then the final reply or an error) arrive on `queue` in the caller's event loop."""

    def __init__(self, socket_path: str, fields: dict, loop: asyncio.AbstractEventLoop, on_hello=None):
        self.socket_path, self.fields, self.loop = socket_path, fields, loop
        self.on_hello = on_hello  # hears the daemon's hello: which model this request runs on
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        threading.Thread(target=self._run, name="colibri-gateway-job", daemon=True).start()

    def _put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def _run(self) -> None:
        c = Client(self.socket_path, timeout_s=10.0)
        try:
            c.connect()
            hello = c.hello()
            if self.on_hello is not None:
                self.on_hello(hello)
            rid = c.send("generate", **self.fields)
            reply = c.reply_to(rid, None, stream=lambda m: self._put(("token", m)), cancel=self.cancel)
            if reply.get("status") == "ok":
                self._put(("reply", reply))
            else:
                err = reply.get("error") or {}
                self._put(("error", err.get("name", "INTERNAL"), err.get("message", "error")))
        except ReplyError as e:
            self._put(("error", e.name, str(e)))
        except TooLarge as e:
            self._put(("error", "TOO_LARGE", str(e)))
        except PermissionDenied as e:
            self._put(("error", "FORBIDDEN", f"the gateway may not use colibrid's socket: {e}"))
        except DaemonDown as e:
            self._put(("error", "DAEMON_DOWN", str(e)))
        except Exception as e:  # a bug: the HTTP client gets a 500, the gateway goes on
            self._put(("error", "INTERNAL", f"{type(e).__name__}: {e}"))
        finally:
            c.close()
            self._put(DONE)


class Gateway:
    """The application's state: where colibrid is, the bearer token (None: none asked), the
    largest body taken."""

    def __init__(self, socket_path: str | None = None, token: str | None = None, max_body: int = 1 << 20,
                 trace: str | None = None):
        self.socket_path = socket_path or P.default_socket()
        self.token, self.max_body = token, max_body
        self._model: tuple[float, str, str] | None = None  # (when asked, name, system_fingerprint)
        self.trace = trace  # a routing trace the Atlas starts from
        self.atlas = None  # atlas.Atlas, made with the first map state
        self.atlas_step = 0  # the last step whose routing the Atlas has counted

    # ---- plumbing ----------------------------------------------------------------------------

    def authorized(self, request: Request) -> bool:
        if self.token is None:
            return True
        got = request.headers.get("authorization", "")
        given = got[7:] if got.lower().startswith("bearer ") else request.query_params.get("token", "")
        return hmac.compare_digest(given.encode(), self.token.encode())

    def call(self, kind: str, **fields) -> dict:
        """One short request to colibrid (blocking: run it in a thread)."""
        c = Client(self.socket_path, timeout_s=5.0)
        try:
            c.connect()
            return c.call(kind, **fields)
        finally:
            c.close()

    async def model_id(self) -> str:
        """The served model's name (its directory's), asked of colibrid at most every 10 s;
        its precision's tag kept with it (self.fingerprint). A daemon still loading has no
        model to name: nothing is kept then, and a daemon that went down or restarted
        (forget()) is asked again at the next request."""
        now = time.monotonic()
        if self._model is None or now - self._model[0] > 10:
            self.learn(await asyncio.to_thread(self.call, "hello", protocol=P.PROTOCOL_VERSION,
                                               client="colibri-gateway"))
        return self._model[1] if self._model else "colibri"

    def learn(self, hello: dict) -> None:
        """The served model as a hello reply names it (each request's own hello too, so a
        daemon restarted with another model is named right at its first request)."""
        m = hello.get("model")
        if not m:
            self._model = None
            return
        name = (m.get("path") or "colibri").rstrip("/").rsplit("/", 1)[-1]
        self._model = (time.monotonic(), name, P.precision_tag(m.get("precision") or {}))

    def forget(self, name: str | None) -> None:
        """After an error of the daemon's state (down, loading, stopping): the next request
        asks which model it serves again."""
        if name in ("DAEMON_DOWN", "LOADING", "SHUTTING_DOWN"):
            self._model = None

    @property
    def fingerprint(self) -> str:
        """Every reply's and chunk's system_fingerprint: the served precision, lossy choices
        named (colibri-int4g64-a8-lossy)."""
        return self._model[2] if self._model else "colibri"

    async def body(self, request: Request) -> dict:
        """The JSON body, at most max_body bytes. Raises BadRequest (TOO_LARGE or invalid)."""
        size = request.headers.get("content-length")
        if size and size.isdigit() and int(size) > self.max_body:
            raise O.BadRequest(f"the request body is {size} bytes, above the gateway's {self.max_body}", None,
                               "TOO_LARGE")
        data = b""
        async for chunk in request.stream():
            data += chunk
            if len(data) > self.max_body:
                raise O.BadRequest(f"the request body is above the gateway's {self.max_body} bytes", None,
                                   "TOO_LARGE")
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise O.BadRequest("the body is not JSON") from None
        if not isinstance(body, dict):
            raise O.BadRequest("the body is not a JSON object")
        return body

    # ---- endpoints ---------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        try:
            name = await self.model_id()
        except (DaemonDown, ReplyError, PermissionDenied) as e:
            return error(getattr(e, "name", "DAEMON_DOWN"), str(e))
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                                        "owned_by": "colibri"}]})

    async def metrics(self, request: Request) -> Response:
        """Prometheus' scrape: colibrid's stats now (colibri_up 0 when it does not answer)."""
        from prometheus_client.exposition import CONTENT_TYPE_LATEST

        from .metrics import render

        try:
            stats = await asyncio.to_thread(self.call, "stats")
        except (DaemonDown, ReplyError, PermissionDenied):
            stats = None
        return Response(render(stats), media_type=CONTENT_TYPE_LATEST)

    # ---- the live map -------------------------------------------------------------------------

    async def page(self, request: Request) -> Response:
        from importlib.resources import files

        return HTMLResponse(files(__package__).joinpath("map.html").read_text(encoding="utf-8"))

    def map_state(self, since: int | None) -> dict:
        """One state of the map (blocking): where and heat per cell, the latest step's
        routed experts, the routing since `since` counted into the Atlas, and the counters
        the charts follow."""
        if self.atlas is None:
            since = 0  # the first state: the daemon's whole routing log seeds the Atlas
        m = self.call("map", **({} if since is None else {"since": since}))
        stats = self.call("stats")
        if self.atlas is None:
            from .atlas import Atlas

            self.atlas = Atlas(m["layers"], m["n_expert"])
            if self.trace:
                self.atlas.add_trace(self.trace)
        for step, il, ids in m["routing"]:
            if step > self.atlas_step:
                self.atlas.add(il, ids)
        self.atlas_step = max([self.atlas_step] + [s for s, _, _ in m["routing"]])
        latest = max((s for s, _, _ in m["routing"]), default=None)
        e, req = stats.get("experts") or {}, stats.get("requests") or {}
        return {"layers": m["layers"], "n_expert": m["n_expert"], "step": m["step"], "where": m["where"],
                "heat": ["".join(HEAT[min(35, int(h * 36))] for h in row) for row in m["heat"]],
                "flash": {str(il): ids for s, il, ids in m["routing"] if s == latest},
                "counters": {"t": time.time(), "hits": e.get("hits", 0), "experts": e.get("experts", 0),
                             "bytes_read": e.get("bytes_read", 0), "io_wait_s": e.get("io_wait_s", 0.0),
                             "tokens": req.get("tokens", 0)}}

    async def map_state_endpoint(self, request: Request) -> Response:
        try:
            return JSONResponse(await asyncio.to_thread(self.map_state, None))
        except (DaemonDown, ReplyError, PermissionDenied) as e:
            return error(getattr(e, "name", "DAEMON_DOWN"), str(e))

    async def map_events(self, request: Request) -> Response:
        """The map's state as server-sent events, each time the step moves (and every few
        seconds regardless), while the viewer stays."""

        async def events():
            sent, since, quiet = None, None, 0
            while True:
                try:
                    state = await asyncio.to_thread(self.map_state, since)
                except (DaemonDown, ReplyError, PermissionDenied) as e:
                    yield f"event: down\ndata: {json.dumps({'message': str(e)})}\n\n"
                    await asyncio.sleep(2.0)
                    continue
                since = state["step"]
                if state["step"] != sent or quiet >= 8:
                    yield f"data: {json.dumps(state)}\n\n"
                    sent, quiet = state["step"], 0
                else:
                    quiet += 1
                await asyncio.sleep(MAP_POLL_S)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def map_atlas(self, request: Request) -> Response:
        """One layer's Atlas layout (?layer=N; default the first MoE layer)."""
        try:
            if self.atlas is None:
                await asyncio.to_thread(self.map_state, None)
            layer = int(request.query_params.get("layer", self.atlas.layers[0]))
            if layer not in self.atlas.row:
                return error("INVALID_REQUEST", f"layer {layer} is not a MoE layer", "layer")
            return JSONResponse(await asyncio.to_thread(self.atlas.layout, layer))
        except ValueError:
            return error("INVALID_REQUEST", "'layer' must be an integer", "layer")
        except (DaemonDown, ReplyError, PermissionDenied) as e:
            return error(getattr(e, "name", "DAEMON_DOWN"), str(e))

    async def chat(self, request: Request) -> Response:
        return await self.generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, "completion")

    async def generate(self, request: Request, kind: str) -> Response:
        try:
            body = await self.body(request)
            fields = O.chat_request(body) if kind == "chat" else O.completion_request(body)
            model = await self.model_id()
        except O.BadRequest as e:
            return error(e.name, str(e), e.param)
        except (DaemonDown, ReplyError, PermissionDenied) as e:
            self.forget(getattr(e, "name", "DAEMON_DOWN"))
            return error(getattr(e, "name", "DAEMON_DOWN"), str(e))
        job = Job(self.socket_path, fields, asyncio.get_running_loop(), self.learn)
        rid = O.new_id("chatcmpl" if kind == "chat" else "cmpl")
        if body.get("stream"):
            return await self.stream(request, job, kind, rid, model, bool((body.get("stream_options") or {})
                                                                         .get("include_usage")))
        return await self.wait(request, job, kind, rid, model)

    async def wait(self, request: Request, job: Job, kind: str, rid: str, model: str) -> Response:
        """The whole reply; a client that disconnects meanwhile cancels it. The connection
        is looked at every WATCH_S whether or not tokens arrive (they arrive all the time
        while the request runs: a look only when none came was never taken)."""
        final, looked = None, time.monotonic()
        while True:
            try:
                item = await asyncio.wait_for(job.queue.get(), WATCH_S)
            except TimeoutError:
                item = None
            if time.monotonic() - looked >= WATCH_S and not job.cancel.is_set():
                looked = time.monotonic()
                if await request.is_disconnected():
                    job.cancel.set()
            if item is None:
                continue
            if item is DONE:
                break
            if item[0] != "token":
                final = item
        if final[0] == "error":
            self.forget(final[1])
            return error(final[1], final[2])
        model = self._model[1] if self._model else model  # (as this request's hello named it)
        reply = final[1]
        obj = O.chat_object(rid, model, reply) if kind == "chat" else O.completion_object(rid, model, reply)
        return JSONResponse(obj | {"system_fingerprint": self.fingerprint})

    async def stream(self, request: Request, job: Job, kind: str, rid: str, model: str,
                     include_usage: bool) -> Response:
        """Server-sent events, started once the first event is in (so an early error is a
        status); the stream's task cancelled (the client left) cancels the request."""
        first = await job.queue.get()
        if first is not DONE and first[0] == "error":
            self.forget(first[1])
        if first is DONE or first[0] == "error":
            return error(*first[1:]) if first is not DONE else error("INTERNAL", "no reply")
        model = self._model[1] if self._model else model  # (as this request's hello named it)
        created = int(time.time())

        def event(obj) -> str:
            if "object" in obj:  # a chunk (an error event has no fingerprint)
                obj["system_fingerprint"] = self.fingerprint
            return f"data: {json.dumps(obj)}\n\n"

        def piece(text: str, reason: str | None = None) -> str:
            if kind == "chat":
                return event(O.chat_chunk(rid, model, created, {"content": text} if reason is None else {}, reason))
            return event(O.completion_chunk(rid, model, created, text, reason))

        async def events():
            item = first
            try:
                if kind == "chat":
                    yield event(O.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
                while item is not DONE:
                    if item[0] == "token":
                        if item[1].get("text"):
                            yield piece(item[1]["text"])
                    elif item[0] == "reply":
                        yield piece("", O.finish(item[1].get("finish_reason")))
                        if include_usage:
                            yield event(O.usage_chunk(kind, rid, model, created, item[1]))
                    else:  # an error after the stream began: OpenAI's error event
                        yield event(O.error_body(item[1], item[2])[1])
                    item = await job.queue.get()
                yield "data: [DONE]\n\n"
            finally:
                if item is not DONE:  # the client went away (the task was cancelled): stop the request
                    job.cancel.set()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def error(name: str, message: str, param: str | None = None) -> JSONResponse:
    status, body = O.error_body(name, message, param)
    return JSONResponse(body, status_code=status)


def make_app(gw: Gateway) -> Starlette:
    """The routes, each behind the bearer token when one is set."""

    def guarded(handler):
        async def endpoint(request: Request) -> Response:
            if not gw.authorized(request):
                return error("UNAUTHORIZED", "a bearer token is needed (Authorization: Bearer TOKEN)")
            return await handler(request)
        return endpoint

    routes = [Route("/v1/models", guarded(gw.models), methods=["GET"]),
              Route("/metrics", guarded(gw.metrics), methods=["GET"]),
              Route("/", guarded(gw.page), methods=["GET"]),
              Route("/map/state", guarded(gw.map_state_endpoint), methods=["GET"]),
              Route("/map/events", guarded(gw.map_events), methods=["GET"]),
              Route("/map/atlas", guarded(gw.map_atlas), methods=["GET"]),
              Route("/v1/chat/completions", guarded(gw.chat), methods=["POST"]),
              Route("/v1/completions", guarded(gw.completions), methods=["POST"])]
    return Starlette(routes=routes)
