"""The side API (FastAPI), served by uvicorn in the broker's own event loop.

Agents authenticate with ``Authorization: Bearer <agent token>`` and see only their own
invocations; the operator token sees everything. An id the caller may not see is answered
exactly like an id that does not exist (404), so ids cannot be probed.
"""

import asyncio
import hmac
import json
import logging
import math
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Callable, Literal

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from . import VERSION, metrics
from . import decisions
from .broker import CODE_HEADER, INVOCATION_HEADER, OUTCOME_HEADER, REPLAYED_HEADER, Broker, LookupUnavailable, note_replay, shown
from .store.journal import Journal, brief
from .contract import Code, Outcome, Phase, Retry, Stage, UnreadableRecord, project
from .config import RecoverySection
from .crypto import DecryptError
from .envelope import MEDIA_TYPE, envelope
from .invocation_view import describe, iso
from .logs import LogThrottle
from .store import queries
from .store.reads import ResultReader


@dataclass(frozen=True, slots=True)
class Principal:
    agent: str | None  # None: the operator

    @property
    def operator(self) -> bool:
        return self.agent is None


class ApiError(Exception):
    def __init__(self, status: int, title: str, detail: str, headers: dict[str, str] | None = None):
        self.status, self.title, self.detail, self.headers = status, title, detail, headers or {}


log = logging.getLogger("affidavit.api")


def _retry_after(status: int) -> dict[str, str] | None:
    """``Retry-After`` for an answer that waiting may cure (the journal did not take a write)."""
    return {"Retry-After": "1"} if status == 503 else None


def _problem_body(status: int, title: str, detail: str) -> dict[str, Any]:
    return {"type": "about:blank", "title": title, "status": status, "detail": detail}


def _problem(status: int, title: str, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(_problem_body(status, title, detail), status_code=status, media_type=MEDIA_TYPE, headers=headers)


def _no_endpoint(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's answer for a path no endpoint has (404) or a method the path does not take
    (405), as a problem document like every other error of the API."""
    asked = f"{request.method} {shown(request.url.path)}"
    if exc.status_code == 405:
        # Every route on this path (GET and HEAD are two for the health probes), not only the
        # first that Starlette matched.
        methods = {m for route in request.app.router.routes
                   if route.matches(request.scope)[0] is not Match.NONE for m in getattr(route, "methods", None) or ()}
        allowed = ", ".join(sorted(methods)) or (exc.headers or {}).get("Allow", "")
        return _problem(405, "Method Not Allowed", f"{asked}: this endpoint takes only {allowed}. See docs/api.md.",
                        {"Allow": allowed})
    if request.scope.get(ABSOLUTE_FORM):  # GET http://upstream/...: sent here as to a proxy
        return _problem(404, "Not Found", f"{request.method} {shown(str(request.url))}: {NOT_THE_PROXY}")
    return _no_such_endpoint(asked, "none ends with a slash")


def _no_such_endpoint(asked: str, why: str) -> JSONResponse:
    return _problem(404, "Not Found", f"{asked}: the side API has no such endpoint (the paths are listed at "
                    f"/openapi.json and in docs/api.md; {why}).")


# What each error answer means, for /openapi.json (docs/api.md says the same at more length).
_ANSWERS = {
    400: "The body is not JSON text at all (not UTF-8, or nested too deeply to read): FastAPI's "
         "{\"detail\": \"There was an error parsing the body\"} (application/json)",
    401: "No bearer token, or one this broker does not know (problem+json)",
    403: "An agent token on an operator call (problem+json)",
    404: "No invocation with this id is visible to this token (problem+json)",
    409: "The record cannot take this now; the detail says why (problem+json)",
    413: "The request body is over 64 KiB; nothing was read or changed (problem+json)",
    422: "Malformed parameters or body: FastAPI's validation error (application/json)",
    503: "The journal (database) did not answer; nothing was changed; retry after Retry-After (problem+json)",
}

# FastAPI's own 422 for a malformed request, in its own schema: a call that declares a 422 (one that
# answers problem documents too, or one with a "default") has it replaced, so it is declared again.
_VALIDATION_ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/HTTPValidationError"}}}


def answers(*statuses: int, meaning: dict[int, str] | None = None) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for the listed error statuses (``meaning``: a call's own wording)."""
    meanings = {**_ANSWERS, **(meaning or {})}
    return {status: {"description": meanings[status], **({"content": _VALIDATION_ERROR} if status == 422 else {})}
            for status in statuses}


# Every field of an approval card, so that an empty one reads null instead of going missing
# (the journal leaves None out of event data).
CARD_FIELDS = ("agent", "route", "method", "target", "body_sha256", "body_bytes", "credential_id",
               "credential_version", "injection", "approves", "config_digest", "retry_of_uncertain_action")


#: The largest request body the side API reads. The largest valid one, a reconciliation with a
#: 500-character reference and a 2000-character note, every character an escaped surrogate pair
#: (\uD83D\uDE00), is 30 KB.
MAX_BODY = 64 * 1024
TOO_LARGE = (f"The request body is over {MAX_BODY} bytes, more than any call of this API takes; nothing was read or "
             "changed. Send the body the call describes (docs/api.md).")


class BodyLimit:
    """Refuses a request body over :data:`MAX_BODY` with a 413, before holding more of it than that.

    FastAPI reads a body whole into memory, and before it looks at the token: without this, anyone
    who reaches the port could make the broker, proxy and all, hold a body of any size. GET and
    HEAD pass untouched (no route reads their body; uvicorn stops reading one nobody asks for).
    Under uvicorn :class:`BoundedHead` refuses such a body first (a declared one before the app
    is called, a chunked one as it grows past the limit) and lingers; this stays for any other
    server the app is mounted in.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isascii() and declared.isdigit() and int(declared) > MAX_BODY:
            return await self._refuse(scope, receive, send)
        messages: list[Message] = []
        size = 0
        while True:  # what arrives without a Content-Length (chunked) is counted as it comes
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left, or the server refused the body itself: nobody to answer
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > MAX_BODY:
                return await self._refuse(scope, receive, send)
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send) -> None:
        response = _problem(413, "Content Too Large", TOO_LARGE, {"Connection": "close"})
        await response(scope, receive, send)


class EncodedSlash:
    """Answers a path with an encoded ``/`` (``%2F``) as one no endpoint has. Starlette routes on
    the decoded path, so ``/v1/invocations/act_x%2Fresult`` would have been served as
    ``/v1/invocations/act_x/result``: no id holds a ``/``, and no client means the one for the other."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = scope.get("raw_path") if scope["type"] == "http" and not scope.get(ABSOLUTE_FORM) else None
        if raw and b"%2f" in raw.lower():  # (a request in absolute-form gets the router's "not the proxy")
            asked = f"{scope['method']} {shown(raw.decode('latin-1').partition('?')[0])}"
            return await _no_such_endpoint(asked, "an encoded '/', %2F, is part of none, nor of any id")(scope, receive, send)
        return await self.app(scope, receive, send)


#: The most a request's head (request line and headers) may take. uvicorn's httptools protocol
#: has no bound of its own (h11's has one, at half the speed): a 200 MB header line was held whole.
MAX_HEAD = 64 * 1024


#: What a client that speaks to the side API as to a proxy is told.
NOT_THE_PROXY = ("this is Affidavit's side API (api.listen), not its proxy: nothing was sent anywhere. Point "
                 "HTTPS_PROXY and HTTP_PROXY at the proxy's address (proxy.listen; `affidavit env` prints the lines to "
                 "export), and call this API directly (list its host in NO_PROXY).")

#: The scope key BoundedHead sets on a request in absolute-form (``GET http://host/path``).
ABSOLUTE_FORM = "affidavit.absolute_form"


#: After a refusal, how long what the client still sends is read and dropped before the close: a
#: close with unread data would reset the connection, and the client could lose the answer.
LINGER = 2.0


class BoundedHead(HttpToolsProtocol):
    """uvicorn's httptools protocol, which refuses a request head over :data:`MAX_HEAD` with a
    431, and a declared body over :data:`MAX_BODY` with a 413, then lingers before it closes. What
    is held of a head is at most that plus one read.

    Lingering: the answer is written and the sending side shut down, and what the client still
    sends is read and dropped for :data:`LINGER` seconds. A client that sends its whole request
    before it reads (most do) then finds the answer, where closing on unread bytes would have made
    the kernel answer with a reset instead."""

    #: ``[api] request_timeout``: how long a request may take to arrive, from its first byte
    #: (:func:`bounded_head` makes the class that serves with the configured one).
    request_timeout = 30.0
    _head_bytes = 0
    _body_bytes = 0
    _in_head = True
    _refused = False
    _deadline: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # read and dropped until the close
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > MAX_HEAD and not self._refused and not self.transport.is_closing():
            self._refuse_head()

    def _refuse_head(self) -> None:
        log.warning("side API: refused a request head over %d bytes from %s", MAX_HEAD, (self.client or ("?",))[0])
        self._refuse(431, "Request Header Fields Too Large", f"The request line and headers are over {MAX_HEAD} "
                     "bytes; nothing was read or changed. Send the request docs/api.md describes.")

    def _refuse(self, status: int, title: str, detail: str) -> None:
        self._refused = True
        body = json.dumps(_problem_body(status, title, detail)).encode()
        self.transport.write(f"HTTP/1.1 {status} {title}\r\ncontent-type: {MEDIA_TYPE}\r\ncontent-length: {len(body)}"
                             "\r\nconnection: close\r\n\r\n".encode() + body)
        self.transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER, self.transport.close)

    def on_headers_complete(self) -> None:
        if self._refused:
            return  # a request pipelined behind the refused one
        # A head that arrived whole in one read is only seen here: measure what was parsed.
        if len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers) > MAX_HEAD:
            self._refuse_head()
            return
        if self.parser.get_http_version() not in ("1.0", "1.1"):  # answered as HTTP/1.1, it would not read it
            self._refuse(505, "HTTP Version Not Supported", f"The request says HTTP/{self.parser.get_http_version()}; "
                         "this API speaks HTTP/1.1 (and 1.0). Nothing was read or changed.")
            return
        if self.parser.get_method() == b"CONNECT":  # a client that took this port for the proxy's
            self._refuse(400, "Bad Request", "CONNECT: " + NOT_THE_PROXY)
            return
        if self.url[:8].lower().startswith((b"http://", b"https://")):  # absolute-form: read, and said if it finds nothing
            self.scope[ABSOLUTE_FORM] = True
        self._in_head, self._head_bytes, self._body_bytes = False, 0, 0
        declared = next((value for name, value in self.headers if name == b"content-length"), b"")
        idle = self.cycle is None or self.cycle.response_complete  # no answer of an earlier request on its way
        if idle and declared.isascii() and declared.isdigit() and int(declared) > MAX_BODY and self.parser.get_method() not in (b"GET", b"HEAD"):
            self._refuse(413, "Content Too Large", TOO_LARGE)
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        self._body_bytes += len(body)
        if self._body_bytes > MAX_BODY and self.parser.get_method() not in (b"GET", b"HEAD") and self.cycle is not None:
            # A body without a Content-Length (chunked) that grows past the limit: the app that
            # waits for it is told the client left (it answers nothing), the 413 is written
            # here, and the rest is read and dropped like the rest of a declared one.
            self.cycle.disconnected = True
            self.cycle.message_event.set()
            self.flow.resume_reading()
            self._refuse(413, "Content Too Large", TOO_LARGE)
            return
        super().on_body(body)

    def on_message_begin(self) -> None:
        if self._deadline is None:  # a request's first byte (also one read with the request before it)
            self._deadline = asyncio.get_running_loop().call_later(self.request_timeout, self._too_slow)
        super().on_message_begin()

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._stop_the_clock()
        self._in_head, self._head_bytes = True, 0  # the next request's head, if any
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_the_clock()
        super().connection_lost(exc)

    def _stop_the_clock(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        """The request did not arrive whole in time (a client trickling it, or one that stopped
        half-way): a 408, and the connection is closed, so no client holds one open for ever."""
        self._deadline = None
        if self._refused or self.transport.is_closing():
            return
        if self._in_head and self.cycle is not None and not self.cycle.response_complete:
            # A request pipelined behind one whose answer is still on its way: its clock waits.
            self._deadline = asyncio.get_running_loop().call_later(self.request_timeout, self._too_slow)
            return
        if not self._in_head and self.cycle is not None:  # the app waits for the rest of the body: it left
            self.cycle.disconnected = True
            self.cycle.message_event.set()
            self.flow.resume_reading()
        log.warning("side API: a request from %s did not arrive whole within %gs of its first byte; answered 408 "
                    "and closed", (self.client or ("?",))[0], self.request_timeout)
        self._refuse(408, "Request Timeout", f"The request did not arrive whole within {self.request_timeout:g}s of "
                     "its first byte ([api] request_timeout); nothing was read or changed. Send the whole request "
                     "at once.")

    def send_400_response(self, msg: str) -> None:
        """A request that is not HTTP/1.1 at all (uvicorn's own answer is a line of plain text)."""
        self._refuse(400, "Bad Request", "The request is not valid HTTP/1.1 (its request line, a header or its "
                     "framing could not be parsed); nothing was read or changed. Send the request docs/api.md "
                     "describes.")

    def _unsupported_upgrade_warning(self) -> None:
        if not self._refused:  # a refused CONNECT (an upgrade to llhttp) was answered, not unsupported
            super()._unsupported_upgrade_warning()


def bounded_head(request_timeout: float) -> type[BoundedHead]:
    """:class:`BoundedHead` with ``[api] request_timeout``, for uvicorn (which takes a class)."""
    return type("BoundedHead", (BoundedHead,), {"request_timeout": request_timeout})


def _text(value: str) -> str:
    """Text the journal can keep: JSON's ``"\\ud800"`` reads as a lone UTF-16 surrogate, which is
    no character and cannot be stored as UTF-8."""
    if not value.isascii() and any("\ud800" <= c <= "\udfff" for c in value):
        raise ValueError("holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is not text")
    return value


Note = Annotated[str, Field(max_length=2000), AfterValidator(_text)]
Reference = Annotated[str, Field(max_length=500), AfterValidator(_text)]


class ReconcileBody(BaseModel):
    """An operator's finding about an invocation's effect (or a request to look it up)."""

    model_config = ConfigDict(extra="forbid")
    outcome: Literal["committed", "rejected", "partial_effect"] | None = None
    certainty: Literal["operator_attested", "remote_query"] = "operator_attested"
    reference: Reference | None = Field(default=None, description="the remote's id for the operation")
    note: Note | None = None
    lookup: bool = Field(default=False, description="ask the remote through the route's declared lookup")
    override: bool = Field(default=False, description="the finding may change the outcome of a record that holds "
                                                      "the remote's complete answer")


class DecisionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    decision: Literal["approve", "deny"]
    note: Note | None = None


def create_app(
    engine: AsyncEngine,
    agent_tokens: dict[str, str],
    operator_token: str | None,
    journal: Journal,
    broker: Broker | None = None,
    reader: ResultReader | None = None,
    heartbeat_failing: Callable[[], bool] = lambda: False,
) -> FastAPI:
    app = FastAPI(
        title="Affidavit side API",
        version=VERSION,
        description="Recorded invocations and results of the Affidavit broker. See docs/api.md.",
        # A path with a trailing slash is not an endpoint: a 404 problem document, not a redirect
        # to another one (``/v1/invocations/%2F`` would have been sent to the listing).
        redirect_slashes=False,
        # No browsable documentation pages: they would be served to anyone without a token and
        # load their scripts from a CDN. The schema stays at /openapi.json (docs/api.md).
        docs_url=None,
        redoc_url=None,
        dependencies=[Depends(_each_once)],
    )
    app.add_middleware(BodyLimit)
    app.add_middleware(EncodedSlash)
    tokens = {token.encode(): name for name, token in agent_tokens.items()}
    operator = operator_token.encode() if operator_token else None
    stale_after = (broker.settings.recovery if broker is not None else RecoverySection()).stale_after
    outage_lines = LogThrottle(window=10.0)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return _problem(exc.status, exc.title, exc.detail, exc.headers)

    async def _token_refusal(request: Request) -> JSONResponse | None:
        """FastAPI reads and parses a body before it resolves the token: a malformed call from a
        caller without a valid token (or an agent's on an operator call) is refused for that,
        and learns nothing about how its body or parameters are malformed."""
        try:
            who = await principal(request)
            if _needs_operator(request.scope.get("route")):
                await operator_only(who)
        except ApiError as refused:
            return _problem(refused.status, refused.title, refused.detail, refused.headers)
        return None

    @app.exception_handler(RequestValidationError)
    async def _malformed(request: Request, exc: RequestValidationError) -> JSONResponse:
        if (refused := await _token_refusal(request)) is not None:
            return refused
        # FastAPI's own 422, except that a NaN or an Infinity in the body (Python's JSON reader takes
        # them, JSON has no such numbers) or a lone surrogate is echoed as the text it was, and so is
        # a body it did not read as JSON (no JSON Content-Type) whose bytes are not UTF-8: encoding
        # any of them failed the answer.
        errors = jsonable_encoder(exc.errors(), custom_encoder={bytes: lambda b: b.decode("utf-8", "backslashreplace")})
        return JSONResponse({"detail": _encodable(errors)}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # 400: FastAPI could not parse the body at all (not UTF-8, nested too deeply).
        if exc.status_code == 400 and (refused := await _token_refusal(request)) is not None:
            return refused
        if exc.status_code in (404, 405):  # only the router raises these; the handlers raise ApiError
            return _no_endpoint(request, exc)
        return await http_exception_handler(request, exc)

    async def _journal_error(_request: Request, exc: Exception) -> JSONResponse:
        if queries.damaged(exc):  # no bug of the broker's, so no traceback; nothing a retry cures
            log.error("side API: the journal's storage is damaged (%s): stop the broker, %s", brief(exc),
                      queries.DAMAGED_ADVICE)
            return _problem(500, "Internal Server Error", "The journal's storage is damaged, so this record cannot be "
                            "read; nothing was changed. Retrying will not help; operators: see the broker log.")
        if not queries.unreachable(exc):  # it answered: a bug or a damaged schema, which waiting will not cure
            log.error("side API: the journal answered with an error that is not an outage: %s", brief(exc), exc_info=exc)
            return _problem(500, "Internal Server Error", "The journal (database) answered this call with an error that "
                            "is not an outage (a bug, or a schema this version does not expect). Retrying will not "
                            "help; operators: see the broker log.")
        if (more := outage_lines.suffix("journal")) is not None:  # one line per call would flood the log
            log.warning("side API: the journal did not answer: %s%s", brief(exc), more)
        return _problem(503, "Unavailable", "The journal (database) did not answer, so nothing can be read or "
                        "changed right now; nothing was changed. Retry after a delay; operators: check the database.",
                        {"Retry-After": "1"})

    for kind in queries.DATABASE_ERRORS:
        app.add_exception_handler(kind, _journal_error)

    @app.exception_handler(UnreadableRecord)
    async def _newer_record(_request: Request, exc: UnreadableRecord) -> JSONResponse:
        if (more := outage_lines.suffix("format")) is not None:
            log.warning("side API: %s; upgrade this broker to the version that wrote it (docs/operations.md, "
                        "Upgrading)%s", exc, more)
        return _problem(503, "Unreadable record", f"This broker cannot show the record: {exc}. Nothing was changed. "
                        "Retry after a delay (an upgraded broker can answer it); operators: upgrade this broker.",
                        {"Retry-After": "5"})

    @app.exception_handler(DecryptError)
    async def _undecryptable(_request: Request, exc: DecryptError) -> JSONResponse:
        log.warning("side API: a record could not be decrypted: %s", exc)
        return _problem(500, "Unreadable record", f"The record cannot be read: {exc}. Nothing was changed. Operators: "
                        "put the key it was stored under back in [crypto] keys (docs/vault.md, key rotation).")

    async def principal(request: Request) -> Principal:  # async: no thread hop per request
        given_headers = request.headers.getlist("authorization")
        if len(given_headers) > 1:  # one field only (RFC 9110 11.6.2): which one counts is not the broker's guess
            raise ApiError(400, "Bad Request", f"The call carries {len(given_headers)} Authorization headers; send "
                           "exactly one: 'Authorization: Bearer <agent or operator token>'.")
        header = given_headers[0] if given_headers else ""
        scheme, _, credential = header.partition(" ")
        if scheme.lower() != "bearer" or not credential:
            raise ApiError(401, "Unauthorized", "Send 'Authorization: Bearer <agent or operator token>'.",
                           {"WWW-Authenticate": 'Bearer realm="affidavit"'})
        given = credential.strip().encode()
        if operator is not None and hmac.compare_digest(given, operator):
            return Principal(None)
        for token, name in tokens.items():
            if hmac.compare_digest(given, token):
                return Principal(name)
        raise ApiError(401, "Unauthorized", "The token is not valid for this broker.",
                       {"WWW-Authenticate": 'Bearer realm="affidavit", error="invalid_token"'})

    async def operator_only(who: Annotated[Principal, Depends(principal)]) -> Principal:
        if not who.operator:
            if operator is None:
                raise ApiError(403, "Forbidden", "This call needs the operator token, and this broker has none "
                               "configured ([api] operator_token), so no token can make it: operators set one and "
                               "restart the broker.")
            raise ApiError(403, "Forbidden", "This call needs the operator token.")
        return who

    def _needs_operator(route: Any) -> bool:
        dependant = getattr(route, "dependant", None)
        return dependant is not None and any(d.call is operator_only for d in dependant.dependencies)

    async def visible(invocation_id: str, who: Principal) -> dict[str, Any]:
        row = await queries.invocation(engine, invocation_id) if _storable(invocation_id) else None
        if row is None or (not who.operator and row["agent"] != who.agent):
            raise not_visible(invocation_id)
        return row

    @app.get("/healthz", tags=["health"], summary="Liveness: the process is serving")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], summary="Readiness: the journal answers and can write",
             responses=answers(503, meaning={503: "Not ready: the journal is unreachable, unwritable or damaged"}))
    async def readyz() -> Response:
        if broker is not None and broker.stop_begun:
            # The proxy no longer listens: a balancer that checks here sends new agents elsewhere.
            return JSONResponse({"status": "unavailable", "broker": "stopping"}, status_code=503)
        try:
            await asyncio.wait_for(queries.ping(engine), 3.0)
        except Exception:
            return JSONResponse({"status": "unavailable", "journal": "unreachable"}, status_code=503)
        if journal.damage is not None:  # every write is refused until a restart (see Journal.damage)
            return JSONResponse({"status": "unavailable", "journal": "damaged"}, status_code=503)
        if journal.write_problem is not None:  # reads work, but every write would be refused
            return JSONResponse({"status": "unavailable", "journal": "unwritable"}, status_code=503)
        if not journal.healthy and heartbeat_failing():
            # Reads work, but the last batch failed and so did the heartbeat since (a full disk, a
            # read-only database): requests would only be refused. Not the last batch alone: then
            # no traffic would come to prove the journal back; the heartbeat goes on trying.
            return JSONResponse({"status": "unavailable", "journal": "unwritable"}, status_code=503)
        last_write = "ok" if journal.healthy else "failed"
        return JSONResponse({"status": "ready", "journal": "ok", "last_write": last_write})

    # HEAD too, as GET without the body: load balancers and uptime checks often probe with it.
    # Not in the OpenAPI document, which would list each as an endpoint of its own.
    for path, probe in (("/healthz", healthz), ("/readyz", readyz)):
        app.add_api_route(path, probe, methods=["HEAD"], include_in_schema=False)

    @app.get("/metrics", tags=["health"], summary="Prometheus metrics (operator)", responses=answers(401, 403),
             response_class=PlainTextResponse)
    async def prometheus(_who: Annotated[Principal, Depends(operator_only)]) -> Response:
        body, content_type = metrics.exposition()
        return Response(content=body, media_type=content_type)

    @app.get("/v1/invocations/{invocation_id}", tags=["invocations"], summary="One invocation's record",
             responses=answers(401, 404, 503))
    async def get_invocation(invocation_id: str, who: Annotated[Principal, Depends(principal)]) -> dict[str, Any]:
        row = await visible(invocation_id, who)
        rows, events = await queries.events_of(engine, invocation_id, journal.decode_payload)
        owner = await queries.holder(engine, row, stale_after)
        return describe(row, events, operator=who.operator, event_times={r["seq"]: r["at"] for r in rows}, owner=owner,
                        holder_restarted=restarted(owner))

    def restarted(owner: dict[str, Any] | None) -> bool:
        """Whether an in-flight record's holder is this broker's earlier incarnation (see :func:`describe`)."""
        return owner is not None and broker is not None and broker.earlier_self(owner["broker"])

    @app.get(
        "/v1/invocations/{invocation_id}/result",
        tags=["invocations"],
        summary="The recorded final response, replayed exactly; never a partial body",
        responses={
            **answers(401, 404, 409, 422, 503, meaning={409: "No complete result exists; the body is the contract envelope"}),
            "default": {"description": "The recorded response, replayed: its stored status (200, 201, 404...), headers "
                                       "and body, of any type, with Affidavit-Replayed: true"},
        },
        response_class=Response,  # no type of its own: the recorded one
    )
    async def get_result(invocation_id: str, who: Annotated[Principal, Depends(principal)]) -> Response:
        if not _storable(invocation_id):
            raise not_visible(invocation_id)
        fast = await reader.fetch(invocation_id) if reader is not None else None
        if fast is not None and fast["stage"] != Stage.DELIVERY_FAILED.value:
            if not who.operator and fast["agent"] != who.agent:
                # The same reads as for an id that does not exist, so that the time of the 404
                # does not tell that it does (docs/api.md: ids cannot be probed).
                await queries.invocation_with_result(engine, invocation_id)
                raise not_visible(invocation_id)
            return await replayed(invocation_id, {**fast, "invocation_id": invocation_id}, fast)
        row, stored = await queries.invocation_with_result(engine, invocation_id)
        if row is None or (not who.operator and row["agent"] != who.agent):
            raise not_visible(invocation_id)
        if stored is None:
            _, events = await queries.events_of(engine, invocation_id, journal.decode_payload)
            view = describe(row, events)
            code = Code(view["code"]) if view["code"] else Code.REMOTE_OUTCOME_UNKNOWN
            if view["outcome"] in _DECIDED and code is not Code.RESULT_STORE_FAILED:
                code = Code.RESULT_UNAVAILABLE  # decided (by reconciliation), but no response was stored
            # Still in flight (the record has no hint yet): the result may yet come. The answer is to
            # fetch it again later, never a hint that reads as "send the request again".
            retry = Retry(view["retry"]) if view["retry"] else Retry.FETCH_RESULT
            body = envelope(
                invocation_id,
                code,
                Phase(view["phase"]),
                Outcome(view["outcome"]),
                retry,
                _no_result_message(view["outcome"], in_flight=view["retry"] is None),
                {k: view["evidence"][k] for k in ("dispatch_started", "request_complete", "response_headers_received", "response_complete")},
            )
            headers = {INVOCATION_HEADER: invocation_id, OUTCOME_HEADER: view["outcome"], CODE_HEADER: body["error"]["code"],
                       "x-should-retry": "true" if retry is Retry.BACKOFF else "false"}
            return JSONResponse(body, status_code=409, media_type=MEDIA_TYPE, headers=headers)
        return await replayed(invocation_id, row, stored)

    async def replayed(invocation_id: str, row: dict[str, Any], stored: dict[str, Any]) -> Response:
        body, stored_headers = queries.open_result(invocation_id, stored, journal.decode_result)
        await note_replay(journal, row, "side_api")
        response = Response(content=body, status_code=stored["status"])
        for k, v in stored_headers:
            if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                response.headers.append(k, v)
        response.headers[INVOCATION_HEADER] = invocation_id
        response.headers[OUTCOME_HEADER] = row["outcome"]
        response.headers[REPLAYED_HEADER] = "true"
        return response

    async def view(invocation_id: str) -> dict[str, Any]:
        row = await queries.invocation(engine, invocation_id)
        assert row is not None
        rows, events = await queries.events_of(engine, invocation_id, journal.decode_payload)
        owner = await queries.holder(engine, row, stale_after)
        return describe(row, events, operator=True, event_times={r["seq"]: r["at"] for r in rows}, owner=owner,
                        holder_restarted=restarted(owner))

    @app.post("/v1/invocations/{invocation_id}/reconcile", tags=["operators"],
              summary="Append what is known about the effect (operator); the original record stays",
              responses={**answers(400, 401, 403, 404, 409, 413, 503), 422: {
                  "description": "Malformed parameters or body (FastAPI's validation error, application/json); or "
                                 "the finding cannot be made: no outcome and no lookup, or the lookup cannot be done "
                                 "(problem+json)",
                  "content": {**_VALIDATION_ERROR, MEDIA_TYPE: {}}}})
    async def reconcile_invocation(
        invocation_id: str, body: ReconcileBody, who: Annotated[Principal, Depends(operator_only)]
    ) -> dict[str, Any]:
        if body.lookup and body.outcome is not None:
            raise ApiError(422, "Outcome and lookup", "Give an outcome, or lookup=true to have the remote's answer "
                                                      "decide it, not both; nothing was changed.")
        row = await visible(invocation_id, who)
        outcome, certainty, reference, note = body.outcome, body.certainty, body.reference, body.note
        lookup = None
        if body.lookup:
            _, events = await queries.events_of(engine, invocation_id, journal.decode_payload)
            try:  # a record no finding may follow is refused before the remote is asked anything
                decisions.refuse_unreconcilable(row, project(events))
            except decisions.DecisionRefused as exc:
                raise ApiError(exc.status, exc.title, exc.message, _retry_after(exc.status)) from None
            if broker is None:
                raise ApiError(503, "Unavailable", "This process cannot perform lookups.")
            try:
                lookup = await broker.lookup(row)
            except LookupUnavailable as exc:
                raise ApiError(422, "No lookup", str(exc)) from None
            if lookup["code"] == "RESULT_STORE_FAILED":
                raise ApiError(409, "No finding", f"The lookup (invocation {lookup['lookup_invocation_id']}) got the "
                                                  f"remote's answer ({lookup['status']}), but the broker could not "
                                                  "record it (RESULT_STORE_FAILED), so no finding rests on it. The "
                                                  "record is unchanged; look up again once the journal takes writes.")
            if lookup["finding"] is None and lookup["code"] is not None:
                asked = ("the remote was not asked (nothing was sent)" if lookup["lookup_outcome"] == "not_attempted"
                         else "no complete answer came back")
                raise ApiError(409, "No finding", f"The lookup (invocation {lookup['lookup_invocation_id']}) got no "
                                                  f"answer from the remote: the broker answered it {lookup['code']} "
                                                  f"({lookup['status']}): {asked}. The record is unchanged; see that "
                                                  "invocation for why, and look up again once it is cured.")
            if lookup["finding"] is None:
                raise ApiError(409, "No finding", f"The lookup (invocation {lookup['lookup_invocation_id']}) answered "
                                                  f"{lookup['status']}, which proves nothing; the record is unchanged.")
            outcome, certainty = lookup["finding"].value, "remote_query"
            reference = reference or lookup["lookup_invocation_id"]
        if outcome is None:
            raise ApiError(422, "Missing outcome", "Give an outcome (committed, rejected, partial_effect) or lookup=true.")
        try:
            await decisions.reconcile(journal, row, Outcome(outcome), certainty, reference, note, "operator", body.override)
        except decisions.DecisionRefused as exc:
            looked = (f" (The lookup, invocation {lookup['lookup_invocation_id']}, answered {lookup['status']}: "
                      f"{outcome}.)") if lookup is not None else ""
            raise ApiError(exc.status, exc.title, exc.message + looked, _retry_after(exc.status)) from None
        result = await view(invocation_id)
        if lookup is not None:
            result["lookup"] = {"lookup_invocation_id": lookup["lookup_invocation_id"], "status": lookup["status"],
                                "finding": lookup["finding"].value}
        return result

    @app.get("/v1/approvals", tags=["operators"], summary="Requests held for an operator's approval",
             responses=answers(401, 403, 503))
    async def list_approvals(
        _who: Annotated[Principal, Depends(operator_only)],
        after: Annotated[str | None, Query(pattern=_INVOCATION_ID, description="page: the `next` of the previous page "
                                           "(an invocation id); anything else is a 422")] = None,
        limit: Annotated[int, Query(ge=1, le=500)] = 200,
    ) -> dict[str, Any]:
        rows = await queries.held(engine, after=after, limit=limit)
        requests = await queries.approval_requests(engine, [r["invocation_id"] for r in rows], journal.decode_payload)
        cards = []
        holders: dict[str, dict[str, Any] | None] = {}  # one heartbeat read per broker, not per card
        for row in rows:
            card = requests.get(row["invocation_id"])
            if card is not None:
                if row["owner"] not in holders:
                    holders[row["owner"]] = await queries.holder(engine, row, stale_after)
                cards.append({"invocation_id": row["invocation_id"], "requested_at": iso(row["updated_at"]),
                              **dict.fromkeys(CARD_FIELDS), **card, "owner": holders[row["owner"]]})
        return {"items": cards, "next": rows[-1]["invocation_id"] if len(rows) == limit else None}

    @app.post("/v1/approvals/{invocation_id}", tags=["operators"], summary="Approve or deny a held request",
              responses=answers(400, 401, 403, 404, 409, 413, 503))
    async def decide(invocation_id: str, body: DecisionBody, who: Annotated[Principal, Depends(operator_only)]) -> dict[str, Any]:
        row = await visible(invocation_id, who)
        try:
            await decisions.decide_approval(journal, row, body.decision == "approve", body.note, "operator")
        except decisions.DecisionRefused as exc:
            raise ApiError(exc.status, exc.title, exc.message, _retry_after(exc.status)) from None
        return await view(invocation_id)

    @app.get("/v1/invocations", tags=["invocations"], summary="List invocations (operator)",
             responses=answers(401, 403, 503))
    async def list_invocations(
        _who: Annotated[Principal, Depends(operator_only)],
        outcome: Annotated[Outcome | None, Query(description="an outcome; anything else is a 422")] = None,
        phase: Annotated[Phase | None, Query(description="a phase; anything else is a 422")] = None,
        route: Annotated[str | None, Query(pattern=_NO_NUL)] = None,
        code: Annotated[Code | None, Query(description="a code; anything else is a 422")] = None,
        agent: Annotated[str | None, Query(pattern=_NO_NUL)] = None,
        since_hours: Annotated[float | None, Query(gt=0)] = None,
        before: Annotated[str | None, Query(pattern=_INVOCATION_ID, description="page: the last invocation_id of the previous "
                                            "page (the `next` of that page); anything else is a 422")] = None,
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
    ) -> dict[str, Any]:
        since = queries.window_start(since_hours * 3600) if since_hours else None
        rows = await queries.list_invocations(
            engine, agent=agent, outcome=outcome and outcome.value, phase=phase and phase.value, route=route,
            code=code and code.value, since=since, before=before, limit=limit,
        )
        items = [
            {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in row.items()
             if k in ("invocation_id", "created_at", "agent", "route", "method", "target", "phase", "outcome", "retry", "code", "caller_disposition", "status")}
            for row in rows
        ]
        return {"items": items, "next": items[-1]["invocation_id"] if len(items) == limit else None}

    return app


#: A text filter may hold anything but NUL: no stored name or id holds one, and PostgreSQL refuses
#: to compare one (a 500 instead of an answer).
_NO_NUL = r"^[^\x00]*$"
#: What the broker names invocations: ``act_`` and a ULID (Crockford base32, 26 characters).
_INVOCATION_ID = r"^act_[0-9A-HJKMNP-TV-Z]{26}$"


class _Repeated(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _Repeated(key)
        seen[key] = value
    return seen


async def _each_once(request: Request) -> None:
    """A query parameter or a JSON key given twice is a 422: FastAPI would keep one of them
    without a word (``{"decision": "approve", "decision": "deny"}`` is a denial to the broker,
    and an approval to a reader who stops at the first)."""
    names = [name for name, _ in request.query_params.multi_items()]
    problems = [{"type": "repeated", "loc": ["query", name], "msg": "given more than once; give it once",
                 "input": None} for name in sorted({n for n in names if names.count(n) > 1})]
    if request.method == "POST" and "json" in request.headers.get("content-type", "").lower():
        try:
            json.loads(await request.body(), object_pairs_hook=_no_repeated_keys)
        except _Repeated as exc:
            problems.append({"type": "repeated", "loc": ["body", exc.key], "msg": "given more than once; give it once",
                             "input": None})
        except (ValueError, RecursionError):
            pass  # not JSON at all, or nested too deeply: FastAPI's own reading says so
    if problems:
        raise RequestValidationError(problems)


def _encodable(value: Any) -> Any:
    """``value`` as JSON can carry it: every NaN and infinity replaced by its JavaScript spelling,
    and a lone UTF-16 surrogate (``"\\ud800"`` in JSON, which Python's reader takes) by its
    escape, both as text; in keys too."""
    if isinstance(value, float) and not math.isfinite(value):
        return json.dumps(value)  # 'NaN', 'Infinity', '-Infinity'
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8") if not value.isascii() else value
    if isinstance(value, dict):
        return {_encodable(k): _encodable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encodable(v) for v in value]
    return value


def not_visible(invocation_id: str) -> ApiError:
    """The one answer for an id that does not exist and for another agent's: ids cannot be probed."""
    return ApiError(404, "Not Found", f"No invocation '{shown(invocation_id, 100)}' is visible to this token.")


def _storable(invocation_id: str) -> bool:
    """Whether an invocation could have this id: none holds a NUL (which PostgreSQL refuses even
    to compare), so such an id is answered as unknown without asking the journal."""
    return "\x00" not in invocation_id


_DECIDED = frozenset({Outcome.COMMITTED.value, Outcome.REJECTED.value, Outcome.PARTIAL_EFFECT.value})


def _no_result_message(outcome: str, *, in_flight: bool = False) -> str:
    if in_flight:
        return ("The invocation is still in flight: no complete response has been recorded yet. Fetch the result "
                "again later (GET /v1/invocations/{id} says when it has ended); do not re-send the request.")
    if outcome in _DECIDED:
        return (f"The outcome is {outcome}, but no response was stored to replay: an operator's reconciliation "
                "decided it (its RECONCILED event in GET /v1/invocations/{id} says how), or the result could not be "
                "stored. The record is the answer; do not re-send.")
    if outcome == Outcome.NOT_ATTEMPTED.value:
        return "There is no result: the request was never sent."
    if outcome == Outcome.UNKNOWN.value:
        return ("There is no complete result: the request may have reached the remote, and no complete "
                "response was recorded. Follow the retry hint; do not re-send blindly.")
    return "No stored result exists for this invocation."
