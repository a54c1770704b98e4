"""The broker: one agent request in, one truthful answer out.

Framework-free orchestration between the contract, the journal, credentials and the upstream
exchange. The mitmproxy addon turns a flow into an :class:`AgentRequest` and the returned
:class:`Reply` back into a response; nothing here knows about mitmproxy.

Order of durable steps for a request that reaches the remote:

1. ``ACTION_ACCEPTED``, ``PREFLIGHT_VALIDATED``, ``CREDENTIAL_AUTHORIZED`` (write-behind);
2. connection setup (DNS, TCP, TLS) - a failure here is ``connection_setup/not_attempted``;
3. ``DISPATCH_STARTED`` committed, *then* the first request byte (see :mod:`proxy.upstream`);
4. a complete response: ``REMOTE_RESPONSE_COMPLETE`` + ``RESULT_COMMITTED`` and the stored
   result in one transaction, *then* delivery to the caller;
5. ``RESULT_DELIVERED`` once the response was handed to the caller's connection.

The exchange runs in its own task: if the caller leaves or its wait times out, the broker still
reads the response until ``result_horizon`` and records it, so the result can be fetched.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from urllib.parse import parse_qsl, quote, unquote, urlsplit
from typing import Any, Awaitable, Callable, Coroutine, TypeVar

from . import decisions, metrics
from .config import LOOKUP_PLACEHOLDERS, MAX_METHOD_LENGTH, Route, Settings, parse_listen
from .contract import (
    CallerDisposition,
    Certainty,
    Code,
    Event,
    EventKind,
    NextAction,
    Outcome,
    Phase,
    Record,
    Retry,
    Stage,
    UnreadableRecord,
    apply,
    classify_status,
    decide,
    is_idempotent,
    project,
    retry_after_seconds,
    retry_hint,
)
from .codings import NAMED_CODINGS, Undecodable, codings_of, decode_transfer
from .crypto import DecryptError
from .credentials import (
    CredentialUnavailable,
    Credentials,
    injected_header,
    redact,
    redact_body,
    redaction_needles,
)
from .envelope import MEDIA_TYPE, encode, envelope, status_for
from .logs import LogThrottle
from .fingerprint import approval_fingerprint, body_sha256, config_digest, fingerprint, normalized_target
from .invocation_log import Identity, InvocationLog, aware as _aware, identity_of, new_invocation_id, utcnow
from .routing import Refusal, fully_decoded, hides_a_dot_segment, match_route
from .failpoints import failpoint
from .invocation_view import operation_of, retention_open
from .recovery import closing_events
from .store import leases, queries
from .store.journal import IdempotencyConflict, Journal, JournalUnavailable, LeaseLost, brief
from ulid import ULID

from .upstream import (
    HOP_BY_HOP,
    MAX_RESPONSE_HEAD,
    DispatchRefused,
    ExchangeFailed,
    SetupFailed,
    Upstream,
    UpstreamRequest,
    UpstreamResponse,
    connection_options,
    end_to_end,
    list_tokens,
)

log = logging.getLogger("affidavit.broker")

INVOCATION_HEADER = "Affidavit-Invocation-Id"
OUTCOME_HEADER = "Affidavit-Outcome"
CODE_HEADER = "Affidavit-Code"
REPLAYED_HEADER = "Affidavit-Replayed"
IDEMPOTENCY_KEY_HEADER = "Affidavit-Idempotency-Key"

#: Response headers never stored with a result (they may carry session secrets).
_UNSTORED_HEADERS = frozenset({"set-cookie", "set-cookie2", "authorization", "proxy-authorization"})
#: Stages of a complete upstream answer whose result is being made durable.
_RECORDING = frozenset({Stage.RESPONSE_COMPLETE, Stage.COMMITTED})
#: An exchange's stages before its complete answer is on the record.
_BEFORE_COMPLETE = frozenset({Stage.DISPATCHED, Stage.SENT, Stage.RESPONDING})


class Flag:
    """A one-way signal with callbacks: cheaper than an Event plus a waiting task per request."""

    __slots__ = ("_set", "_callbacks")

    def __init__(self) -> None:
        self._set = False
        self._callbacks: list[Callable[[], None]] = []

    def set(self) -> None:
        if not self._set:
            self._set = True
            callbacks, self._callbacks = self._callbacks, []
            for callback in callbacks:
                callback()

    def is_set(self) -> bool:
        return self._set

    def add_callback(self, callback: Callable[[], None]) -> None:
        if self._set:
            callback()
        else:
            self._callbacks.append(callback)

    async def wait(self, timeout: float | None = None) -> bool:
        """True once set; False if ``timeout`` passed first."""
        if self._set:
            return True
        future = asyncio.get_running_loop().create_future()
        wake = lambda: future.done() or future.set_result(None)  # noqa: E731
        self._callbacks.append(wake)
        try:
            await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            return False
        finally:
            if not self._set:  # a wait that ended otherwise leaves nothing behind (a hold polls every 0.25 s)
                self._callbacks.remove(wake)
        return True


@dataclass(slots=True)
class AgentRequest:
    """An authenticated agent's request, as the proxy core parsed it."""

    agent: str
    scheme: str
    host: str
    port: int
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes
    #: Set by the adapter when the agent stops waiting (:meth:`leave`).
    caller_gone: Flag = field(default_factory=Flag)
    #: How it stopped: its connection went (``disconnected``), or it cancelled this one request
    #: and kept the connection (``cancelled``: an HTTP/2 stream reset).
    left_as: CallerDisposition = CallerDisposition.DISCONNECTED

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    def values_of(self, name: str) -> list[str] | None:
        """Every value of header ``name``, in order, or None when it is absent."""
        name = name.lower()
        return [v for k, v in self.headers if k.lower() == name] or None

    def leave(self, disposition: CallerDisposition) -> None:
        """The agent stopped waiting; the first way it did so is the one kept."""
        if not self.caller_gone.is_set():
            self.left_as = disposition
            self.caller_gone.set()


@dataclass(slots=True)
class Reply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    invocation_id: str | None = None
    reason: str = ""
    #: The headers already carry all the framing this answer should have (a recorded answer:
    #: see _length_fields; none at all on a 204); else the adapter adds the body's length.
    framed: bool = False
    #: Called by the adapter once the reply was handed to the caller's connection.
    delivered: Callable[[], None] | None = None
    #: Called by the adapter, with how the caller left, when it was gone before the reply could
    #: be handed over.
    undelivered: Callable[[CallerDisposition], None] | None = None


@dataclass(slots=True)
class _Settled:
    """How an exchange ended, before deciding what the caller is told."""

    response: UpstreamResponse | None = None
    setup: SetupFailed | None = None
    failure: ExchangeFailed | None = None
    refused: DispatchRefused | None = None
    store_failed: bool = False
    attempt: int = 1
    #: The result that could not be stored, kept to try again when the journal is back.
    result_row: dict[str, Any] | None = None
    #: What the caller is told, when the code's usual message would not be true of this end.
    message: str | None = None


#: An exchange still going this long (seconds) after its request left records its progress then
#: (``REQUEST_SENT``, then ``REMOTE_RESPONSE_STARTED`` as it comes): a quick one records only its
#: end, which implies both.
PROGRESS_AFTER = 0.25


class LookupUnavailable(Exception):
    """The route declares no lookup, or the invocation lacks what its template needs."""


#: How long the delivery repair waits for the adapter to confirm a RESULT_STORE_FAILED answer was
#: handed over (mitmproxy itself drops a connection idle for 600 s) before recording it undelivered.
DELIVERY_CONFIRM_WAIT = 600.0

#: How long a stopping broker waits for requests still being handled, and again for the exchanges
#: still recording late results (docs/cli.md, docs/operations.md).
CLOSE_WAIT = 5.0

#: A re-send's lease with less than this left at its dispatch write is renewed first (see
#: :meth:`_Exchange._commit_fenced`), so the lease does not lapse between the check and the commit.
LEASE_MARGIN = timedelta(seconds=1)


class _Exchange:
    """One upstream exchange for one invocation: what the upstream client tells at each step."""

    def __init__(self, broker: "Broker", entry: InvocationLog, request: UpstreamRequest, needles: list[bytes]):
        self.broker = broker
        self.entry = entry
        self.request = request
        self.needles = needles
        self.dispatched = Flag()
        self.caller_left = False
        self.request_written = False
        self.status_seen: int | None = None
        self.approval_check: Callable[[], str | None] | None = None
        self.connection: str | None = None
        self.attempt = max(entry.record.attempt_count, 1)
        self._clean: tuple[UpstreamResponse, bytes, bool, str | None] | None = None
        #: Until the exchange ends: the timer that records its progress if it is slow, and
        #: whether it does so now (each step as it comes).
        self._progress_timer: asyncio.TimerHandle | None = None
        self._publishing = False
        self._ended = False
        #: The upstream's complete answer is in hand and only its record is outstanding (the body's
        #: redaction, in a thread for a large one, then the commit): no timeout may call it missing.
        #: Set before the record's stage says so (RESPONSE_COMPLETE), which only this sets off.
        self.recording = False

    async def prepare_body(self, response: UpstreamResponse) -> None:
        """Work out :meth:`clean_body` in a thread when it means decoding a sizeable body, so a
        large or hostile one does not hold up every other request."""
        if self._clean is None and len(response.body) > _INLINE_DECODE and (self.needles or _transfer_codings(response)):
            await asyncio.to_thread(self.clean_body, response)

    def clean_body(self, response: UpstreamResponse) -> tuple[bytes, bool, str | None]:
        """(body, redacted, withheld): the response body with every echo of the injected
        credential replaced, also inside its content coding; worked out once per response (it
        is stored and delivered). A transfer coding other than chunked (the broker drops the
        hop-by-hop header) is undone first. A body the broker cannot look inside on a route
        that injects a credential is withheld (empty; ``withheld`` says why): it might hold
        the secret."""
        if self._clean is None or self._clean[0] is not response:
            limit = self.request.max_response_body
            body, problem = response.body, None
            transfer = _transfer_codings(response)
            if transfer and body:
                try:
                    body = decode_transfer(body, transfer, limit)
                except Undecodable as exc:
                    problem = f"Transfer-Encoding {_named_codings(transfer)}: {exc}"
            codings = response.all_of("Content-Encoding")
            if problem is None:
                body, changed, inside = redact_body(body, codings, self.needles, limit)
                problem = inside and f"Content-Encoding {_named_codings(codings_of(codings))}: {inside}"
            else:
                body, changed = redact(body, self.needles)
            withheld = None
            if problem is not None and not self.needles:
                problem = None  # nothing to look for: delivered as received
            if problem is not None:
                body, withheld = b"", problem
                log.warning(
                    "invocation %s: the response body was withheld (stored and delivered empty): the broker could not "
                    "look inside it for an echo of the injected credential (%s). The outcome stands; the status and "
                    "headers are kept. If this upstream's answers are needed, have it answer uncompressed or in "
                    "gzip, deflate or zstd.",
                    self.entry.invocation_id, withheld,
                )
            self._clean = (response, body, changed, withheld)
        return self._clean[1], self._clean[2], self._clean[3]

    async def dispatch(self, attempt: int, connection: str) -> None:
        """The boundary: nothing is written upstream until this returns."""
        await failpoint("during_tls")
        if self.broker.stop_begun:
            # The stop cuts exchanges soon: one dispatched now would end unknown with nothing sent.
            raise SetupFailed("request", Code.CONNECT_FAILED, "the broker is stopping; nothing was sent")
        if self.caller_left:
            raise DispatchRefused(Code.CALLER_CANCELLED, "the caller left before dispatch")
        if self.approval_check is not None and (why := self.approval_check()) is not None:
            raise DispatchRefused(Code.APPROVAL_STALE, why)
        if (why := self._resend_unprotected()) is not None:
            raise DispatchRefused(Code.RECONCILE_REQUIRED, why)
        self.connection = connection
        self.entry.append(EventKind.DISPATCH_STARTED, attempt=self.attempt, connection=connection)
        started = time.perf_counter()
        try:
            # A re-send is fenced: if its lease ran out or another broker took over, the
            # DISPATCH_STARTED write is refused and nothing is sent.
            await self._commit_fenced()
        except JournalUnavailable as exc:
            raise DispatchRefused(Code.JOURNAL_UNAVAILABLE, str(exc), unwritten=exc.unwritten) from None
        except LeaseLost:
            raise DispatchRefused(Code.LEASE_LOST, "the lease for this re-send was lost before dispatch") from None
        metrics.DISPATCH_RECORD.observe(time.perf_counter() - started)
        self.dispatched.set()
        await failpoint("after_dispatch_commit")

    def _resend_unprotected(self) -> str | None:
        """Why this re-send of an operation that may already have had its effect can no longer be
        sent: the remote contract's retention closed since the repeat was let through (while it
        waited for an approval, or for a connection). None when it may go."""
        entry = self.entry
        if entry.generation == 0 or entry.record.dispatch_count == 0 or entry.identity.idempotent:
            return None
        if entry.identity.retention_open(utcnow()):
            return None
        return ("the remote idempotency contract's retention for this key closed before the re-send could be "
                "dispatched, so the key no longer protects it")

    async def _commit_fenced(self) -> None:
        """Commit under the re-send's fence. A lease of this broker's own that lapsed (or is about
        to) before dispatch, say during an approval slower than ``retry_lease``, is renewed first
        if nobody took the invocation meanwhile; one that another broker took stays lost, and the
        fence refuses the write."""
        entry = self.entry
        if entry.generation > 0 and entry.lease_expires_at is not None:  # a re-send's: a first attempt has none
            await self._renew_a_lease_running_out(entry, entry.lease_expires_at)
        await entry.commit(fence=entry.fence(check_expiry=True))

    async def _renew_a_lease_running_out(self, entry: InvocationLog, expires: datetime) -> None:
        now = utcnow()
        if expires > now + LEASE_MARGIN:
            return
        until = now + timedelta(seconds=self.broker.settings.proxy.retry_lease)
        try:
            renewed = await leases.renew_lease(
                self.broker.journal.engine, entry.invocation_id, entry.generation, entry.owner, now, until)
        except queries.DATABASE_ERRORS:
            renewed = False  # the commit after it meets the same outage
        if renewed:
            entry.lease_expires_at = until
            log.info("invocation %s: this broker's lease was running out before dispatch and nobody had taken it; "
                     "renewed", entry.invocation_id)

    async def request_sent(self) -> None:
        self.request_written = True
        if self._publishing:
            self._publish_progress()
        elif not self._ended and self._progress_timer is None:
            self._progress_timer = asyncio.get_running_loop().call_later(PROGRESS_AFTER, self._publish_progress)
        await failpoint("after_request_sent")

    async def response_started(self, status: int) -> None:
        self.status_seen = status
        if self._publishing:
            self._publish_progress()
        await failpoint("mid_response_headers")

    def _publish_progress(self) -> None:
        """The exchange is slow: record how far it got (and, from now on, each step as it comes),
        so that the record read meanwhile, or recovered after a crash, says the request left."""
        self._progress_timer = None
        if self._ended:
            return
        self._publishing = True
        before = self.entry.record.last_seq
        self.record_progress()
        if self.entry.record.last_seq != before:
            self.entry.submit_quietly()

    def _stop_publishing(self) -> None:
        self._ended = True
        if self._progress_timer is not None:
            self._progress_timer.cancel()
            self._progress_timer = None

    def record_progress(self) -> None:
        """Append how far a dispatched exchange got (REQUEST_SENT, REMOTE_RESPONSE_STARTED).

        Recorded when something ends without a complete response, or once the exchange is slow
        (:meth:`_publish_progress`): a quick complete response implies both facts, so they live in
        memory until then, like the bytes they describe. Each is appended once (by stage).
        """
        if self.request_written and self.entry.record.stage is Stage.DISPATCHED:
            self.entry.append(EventKind.REQUEST_SENT, attempt=self.attempt)
        if self.status_seen is not None and self.entry.record.stage in (Stage.DISPATCHED, Stage.SENT):
            self.entry.append(EventKind.REMOTE_RESPONSE_STARTED, attempt=self.attempt, status=self.status_seen)

    async def body_started(self) -> None:
        await failpoint("mid_response_body")

    async def run(self) -> _Settled:
        try:
            try:
                response = await self.broker.upstream.exchange(self.request, self, attempt=self.attempt)
            finally:
                self._stop_publishing()
        except DispatchRefused as exc:
            return _Settled(refused=exc, attempt=self.attempt)
        except SetupFailed as exc:
            self.entry.append(
                EventKind.CONNECTION_ATTEMPT,
                attempt=self.attempt,
                stage=exc.stage,
                code=exc.code.value,
                diagnostic=exc.diagnostic,
            )
            # Cut by this broker's own stop: nothing about the upstream's reachability is known.
            own = _STOPPING if self.broker.stop_begun else _OUT_OF_FILES if exc.out_of_files else None
            return _Settled(setup=exc, attempt=self.attempt, message=own)
        except ExchangeFailed as exc:
            if not exc.request_complete:
                self.request_written = False  # the transport's word only counts when complete
            self.record_progress()
            if self.broker.stopping and exc.code is Code.REMOTE_RESULT_INCOMPLETE:
                # The stop cut the response, not the upstream: its record ends as the stop's cuts do.
                exc = ExchangeFailed(Code.REMOTE_OUTCOME_UNKNOWN, exc.diagnostic, request_complete=exc.request_complete,
                                     headers_received=exc.headers_received)
            if self.broker.stopping and exc.code is Code.REMOTE_OUTCOME_UNKNOWN:
                return _Settled(failure=exc, attempt=self.attempt, message=_STOPPED_MID_EXCHANGE)
            head_too_large = exc.code is Code.RESULT_TOO_LARGE and not exc.headers_received
            return _Settled(failure=exc, attempt=self.attempt, message=_HEAD_TOO_LARGE if head_too_large else None)
        try:
            return await self._record_result(response)
        except Exception as exc:
            if self.entry.record.stage not in _BEFORE_COMPLETE:
                raise
            return self._unrecordable(response, exc)

    def _unrecordable(self, response: UpstreamResponse, exc: Exception) -> _Settled:
        """A fault of the broker's own while it read a complete answer's evidence, before any of
        it was recorded: the record ends ``unknown`` (the broker holds no result it can vouch
        for) rather than stay in flight for ever, and the agent is told so with its id."""
        log.error(
            "invocation %s: the upstream's complete answer (status %d) could not be recorded: the broker failed "
            "reading it (%s: %s), a bug. Nothing of it was stored and the agent was told the effect is unknown. "
            "Reconcile the invocation with the remote (affidavit reconcile), and report this line.",
            self.entry.invocation_id, response.status, type(exc).__name__, exc, exc_info=exc,
        )
        self.record_progress()
        return _Settled(
            failure=ExchangeFailed(
                Code.REMOTE_OUTCOME_UNKNOWN,
                f"the upstream answered completely (status {response.status}), but the broker failed recording the "
                f"answer ({type(exc).__name__}); see the broker's log",
                request_complete=response.request_complete,
                headers_received=True,
            ),
            attempt=self.attempt,
            message=(
                f"The upstream answered completely (status {response.status}), but the broker failed recording its "
                "answer (an internal error, in the broker's log), so it holds no result it can vouch for: the effect "
                "is unknown. Do not blindly re-send; an operator must reconcile it."
            ),
        )

    async def _record_result(self, response: UpstreamResponse) -> _Settled:
        """Steps (1)-(3) of contract section 6: the outcome, its hash, the stored result."""
        self.recording = True
        await failpoint("after_response_complete")
        stored_headers = [(k, v) for k, v in _passable(response.headers) if k.lower() not in _UNSTORED_HEADERS]
        # A bodiless answer's length (a HEAD's, a 304's) is a fact about the representation; a
        # replay of it through the proxy says the same (see _length_fields).
        if response.framing == "none":
            stored_headers += _length_fields(response.status, response.framing, b"", response.headers)
        await self.prepare_body(response)
        stored_body, redacted, withheld = self.clean_body(response)
        stored_headers, headers_redacted = _redact_headers(_withheld_headers(stored_headers, withheld), self.needles)
        # The hash and length of a body that held (or may hold) the secret would let anyone who
        # reads the record test a guess of it offline: those are left out, and the stored body's
        # hash (RESULT_COMMITTED) stands for it.
        held_secret = redacted or withheld is not None
        self.entry.append(
            EventKind.REMOTE_RESPONSE_COMPLETE,
            attempt=self.attempt,
            status=response.status,
            framing=response.framing,
            body_sha256=None if held_secret else response.body_sha256,
            body_bytes=None if held_secret else len(response.body),
            peer_certificate=response.peer_certificate_sha256,
            retry_after=retry_after_seconds(response.header("Retry-After")),
            location=_redacted_text(response.header("Location"), self.needles),
            job_ref=_redacted_text(_job_reference(response), self.needles),
            http_version=response.http_version,
            # Only when false (an early answer, the body not all taken): the usual case adds nothing.
            request_complete=None if response.request_complete else False,
        )
        self.entry.append(
            EventKind.RESULT_COMMITTED,
            result_id=self.entry.invocation_id,
            stored_body_sha256=body_sha256(stored_body),
            redacted=(redacted or headers_redacted) or None,
            withheld=withheld,
        )
        body, headers, key_id = self.entry.journal.encode_result(self.entry.invocation_id, stored_body, _json_headers(stored_headers))
        row = {
            "invocation_id": self.entry.invocation_id,
            "stored_at": utcnow(),
            "status": response.status,
            "headers": headers,
            "body": body,
            # The hash of the bytes stored here (encrypted, when keys are configured), so the table
            # never lets anyone confirm a guess of a plaintext body; the original body's hash is
            # in the (encrypted) REMOTE_RESPONSE_COMPLETE payload, unless it held the secret.
            "body_sha256": hashlib.sha256(body).hexdigest(),
            "framing": response.framing,
            "key_id": key_id,
        }
        try:
            await self.entry.commit(result=row)
        except (JournalUnavailable, LeaseLost):
            return _Settled(response=response, store_failed=True, attempt=self.attempt, result_row=row)
        await failpoint("after_result_commit")
        return _Settled(response=response, attempt=self.attempt)


class Broker:
    def __init__(
        self,
        settings: Settings,
        journal: Journal,
        upstream: Upstream,
        credentials: Credentials,
        owner: str,
    ):
        self.settings = settings
        self.journal = journal
        self.upstream = upstream
        self.credentials = credentials
        self.owner = owner
        self._background: set[asyncio.Task[Any]] = set()
        self._handling: set[asyncio.Task[Any]] = set()  # requests being handled right now
        self._behind: set[asyncio.Task[Any]] = set()  # records written until the journal takes them (_in_background)
        self._closing = False
        self._outage_lines = LogThrottle(window=10.0)
        #: The broker is stopping (a signal): connections it cuts are not their callers leaving.
        self.stopping = False
        #: A stop has begun with ``[proxy] drain``: nothing new is dispatched, and the exchanges
        #: in flight may end as they would (see :meth:`drained`); ``stopping`` follows.
        self.draining = False
        #: Whether an owner named as this broker's earlier incarnation is dead (recovery's view:
        #: not once it has seen that owner's heartbeat move, a live twin).
        self.earlier_incarnation_dead: Callable[[str], bool] = lambda owner: True
        for route in settings.routes:
            if route.connect_to:
                host, _, port = route.connect_to.rpartition(":")
                if not route.host.startswith("*."):
                    upstream.pin(route.host, route.port, (host.strip("[]"), int(port)))

    async def close(self) -> None:
        """Wait (bounded) for requests still ending and exchanges still recording late results,
        so that what they learnt is written before the journal closes."""
        self._closing = True  # no new write-behind resends: the journal closes after this
        for task in self._behind:
            task.cancel()
        loop = asyncio.get_running_loop()
        for waiting in (self._handling, self._background):
            deadline = loop.time() + CLOSE_WAIT
            # Again while new ones joined: requests accepted just before the proxy stopped
            # listening start after the first look.
            while waiting and (left := deadline - loop.time()) > 0:
                await asyncio.wait(set(waiting), timeout=left)
        if self._handling:
            log.warning("%d request(s) were still being handled after %g s and are left as they are: their records "
                        "stay in flight until recovery closes them (at the next start, or by another broker)",
                        len(self._handling), CLOSE_WAIT)

    @property
    def stop_begun(self) -> bool:
        """A stop has begun (draining, or past it): nothing new is dispatched."""
        return self.draining or self.stopping

    def _stopping_refusal(self) -> Reply:
        """A request that arrives once a stop has begun (on a connection still open: the proxy no
        longer listens) is refused before anything is read, recorded or sent; the adapter closes
        its connection, so a retry goes to a broker that runs."""
        log.info("refused a request that arrived after the stop began: 503 %s, nothing recorded or sent",
                 Code.BROKER_RESTARTED.value)
        return unrecorded_refusal(status_for(Code.BROKER_RESTARTED), Code.BROKER_RESTARTED, _STOPPING, [("Retry-After", "1")],
                                  retry=Retry.BACKOFF, evidence={"dispatch_started": False})

    async def drained(self, timeout: float) -> int:
        """Wait (up to ``timeout`` s) until no request is being handled; how many still are.
        Called with :attr:`draining` set: what is not yet dispatched is refused at its boundary
        and what is held is answered, so only exchanges already sent are waited for."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        # Also the exchanges whose caller left or timed out, which go on in the background until
        # their result_horizon (and the records written behind): the stop would cut them next.
        while (waiting := self._handling | self._background) and (left := deadline - loop.time()) > 0:
            await asyncio.wait(waiting, timeout=left)
        return len(self._handling | self._background)

    # -- the request path -------------------------------------------------------------------

    async def handle(self, req: AgentRequest) -> Reply:
        metrics.IN_FLIGHT.inc()
        task = asyncio.current_task()
        if task is not None:
            self._handling.add(task)
        try:
            return await self._handle(req)
        finally:
            metrics.IN_FLIGHT.dec()
            self._handling.discard(task)  # type: ignore[arg-type]

    async def _handle(self, req: AgentRequest) -> Reply:
        if self.stop_begun:
            return self._stopping_refusal()
        if self.journal.damage is not None:
            # Refused before anything touches the journal (a key's lookup, a lease, a replay's read):
            # its storage is damaged, and nothing is recorded in it until a restart.
            return self._journal_unavailable(message=(
                "The broker's journal is damaged, so it records nothing and sent nothing (it never forwards without a "
                "durable record). No invocation was recorded. Retry after a delay, to a broker that runs on a sound "
                "journal; operators: see the broker log."), unwritten=True)
        matched = match_route(self.settings.routes, req.agent, req.scheme, req.host, req.port, req.method, req.path)
        route = matched if not isinstance(matched, Refusal) else None
        target = normalized_target(req.scheme, req.host, req.port, req.path)
        request_fingerprint = fingerprint(req.method, target, req.body, req.headers)
        refusal = self._preflight(matched, req)
        if refusal is not None or route is None:
            # A method refusal is recorded (and counted) under the route the agent was using.
            recorded_under = matched.route if isinstance(matched, Refusal) else route
            entry = self._new_entry(req, recorded_under, target, request_fingerprint)
            code, message = refusal if refusal is not None else (Code.INVALID_TARGET, "")
            return await self._refuse(entry, Phase.VALIDATION, code, message)

        key, generated = self._idempotency_key(req, route)
        scope = route.idempotency.scope if route.idempotency else route.name
        if key is not None and not generated:
            try:
                existing = await self._read(leases.find_keyed(self.journal.engine, req.agent, scope, key))
            except _Unreadable as exc:
                return self._unreadable(exc)
            if existing is not None:
                return await self._repeat(existing, req, route, request_fingerprint, key)
        entry = self._new_entry(req, route, target, request_fingerprint, key, scope)
        entry.append(EventKind.PREFLIGHT_VALIDATED, route=route.name, idempotency_key=key if not generated else None)
        if key is not None:
            await failpoint("before_claim")
            # Bind the key before anything else happens, so two concurrent first requests with
            # one key (on any brokers) become one invocation and one repeat.
            try:
                await entry.commit(claim=True)
            except IdempotencyConflict:
                try:
                    existing = await self._read(leases.find_keyed(self.journal.engine, req.agent, scope, key))
                except _Unreadable as exc:
                    return self._unreadable(exc)
                if existing is None:
                    return self._journal_unavailable()
                return await self._repeat(existing, req, route, request_fingerprint, key)
            except JournalUnavailable as exc:
                # The binding may have landed unconfirmed: then its record, which names the key, is
                # closed once the journal answers (else every repeat is IDEMPOTENCY_IN_PROGRESS
                # for as long as this broker runs).
                return self._journal_unavailable(entry, unwritten=exc.unwritten)
        else:
            entry.submit_quietly()
        await failpoint("before_credential")
        return await self._attempt(entry, req, route, key, generated)

    def _is_side_api(self, req: AgentRequest) -> bool:
        """Whether ``req`` is for this broker's side API (an agent that proxies its calls there)."""
        host, port = parse_listen(self.settings.api.listen)
        here = {host.strip("[]").lower()}
        if host in ("0.0.0.0", "::", "") or host.startswith("127.") or host in ("::1", "localhost"):
            here |= {"127.0.0.1", "localhost", "::1"}
        return req.port == port and req.host.strip("[]").lower() in here

    def _preflight(self, matched: Route | Refusal, req: AgentRequest) -> tuple[Code, str] | None:
        """Checks that need no secret and no I/O; a refusal is ``validation/not_attempted``."""
        if (malformed := malformed_request(req, *self._key_headers(matched))) is not None:
            return Code.MALFORMED_REQUEST, malformed
        if isinstance(matched, Refusal):
            if matched.code is Code.INVALID_TARGET and self._is_side_api(req):
                return matched.code, (
                    f"{req.scheme}://{req.host}:{req.port} is this broker's own side API, which agents call directly, "
                    "not through the proxy. Nothing was sent. Exempt it from the proxy (NO_PROXY, as `affidavit env` "
                    "prints it) and call it again.")
            return matched.code, matched.message
        route = matched
        if _asks_for_websocket(req):
            return (
                Code.UNSUPPORTED_ACTION,
                f"The request asks to open a WebSocket (Upgrade: websocket) through route '{route.name}'. The broker "
                "relays HTTP requests and their responses, one recorded exchange each, and does not relay WebSocket "
                "connections. Nothing was sent. Use the service's HTTP API instead.",
            )
        if (override := _override(req, route.name)) is not None:
            return Code.UNSUPPORTED_ACTION, override
        limit = int(route.max_body if route.max_body is not None else self.settings.proxy.max_body)
        if len(req.body) > limit:
            return (
                Code.PAYLOAD_LIMIT,
                f"The request body is {len(req.body)} bytes; route '{route.name}' accepts at most {limit}. Nothing was sent. "
                "Send a smaller body, or ask an operator to raise the route's max_body if this size is legitimate.",
            )
        sent = req.values_of(route.inject.target_header) if route.inject is not None else None
        if route.inject is not None and sent is not None and sent != [route.inject.placeholder]:
            return (
                Code.FORBIDDEN_HEADER_OVERRIDE,
                f"The request sets {route.inject.target_header}, which the broker injects for route "
                f"'{route.name}'. Remove it; nothing was sent.",
            )
        return None

    def _key_headers(self, route: Route | Refusal) -> tuple[str, ...]:
        """The headers an agent may name its operation's key in: ``[proxy] idempotency_header``
        and, on a route with a remote contract, the contract's own header (an SDK of that API
        sends its key there, and a repeat with that key must stay one operation)."""
        ours = self.settings.proxy.idempotency_header
        if isinstance(route, Route) and route.idempotency is not None and route.idempotency.header.lower() != ours.lower():
            return ours, route.idempotency.header
        return (ours,)

    def _idempotency_key(self, req: AgentRequest, route: Route) -> tuple[str | None, bool]:
        """(key, generated). A route with a declared remote contract always gets a key: the
        agent's own (in either of :meth:`_key_headers`; two different ones are refused by
        :func:`malformed_request`), or a new one."""
        for name in self._key_headers(route):
            if key := req.header(name):
                return key.strip(), False  # at most MAX_KEY_LENGTH: longer ones are refused (malformed_request)
        if route.idempotency is not None:
            return f"afk_{ULID()}", True
        return None, False

    def _new_entry(
        self,
        req: AgentRequest,
        route: Route | None,
        target: str,
        request_fingerprint: str,
        key: str | None = None,
        scope: str | None = None,
    ) -> InvocationLog:
        now = utcnow()
        contract = route.idempotency if route else None
        identity = Identity(
            invocation_id=new_invocation_id(),
            agent=req.agent,
            route=route.name if route else None,
            method=req.method.upper(),
            target=target,
            fingerprint=request_fingerprint,
            idempotent=is_idempotent(req.method, route.idempotent if route else None),
            remote_contract=contract is not None,
            idempotency_key=key,
            idempotency_scope=scope if key else None,
            idempotency_expires_at=now + timedelta(seconds=contract.retention) if contract and key else None,
            retry_budget=route.retry_budget if route else 0,
        )
        entry = InvocationLog(self.journal, identity, self.owner)
        entry.append(
            EventKind.ACTION_ACCEPTED,
            agent=req.agent,
            route=identity.route,
            method=identity.method,
            target=target,
            fingerprint=identity.fingerprint,
            body_bytes=len(req.body),
        )
        return entry

    async def _attempt(self, entry: InvocationLog, req: AgentRequest, route: Route, key: str | None, generated: bool) -> Reply:
        """One attempt (:meth:`_one_attempt`); its key is bound by now, so every answer names it
        (a denial, an approval's timeout and a credential refusal included)."""
        dispatched_before = entry.record.dispatch_count  # a re-send's earlier attempts
        try:
            reply = await self._one_attempt(entry, req, route, key, generated)
        except queries.DATABASE_ERRORS as exc:
            if entry.record.dispatch_count > dispatched_before or entry.record.ended or not queries.unreachable(exc):
                raise  # an error the database answered with (a damaged schema) is a 500, as elsewhere
            # A read of the database before dispatch (the vault's secret, an approval's state)
            # failed: nothing was sent, and the record, bound to its key, must not stay open.
            log.warning("invocation %s: a database read before dispatch failed (%s); nothing was sent",
                        entry.invocation_id, brief(exc))
            reply = await self._refuse(
                entry, Phase.VALIDATION, Code.JOURNAL_UNAVAILABLE,
                "The broker could not read its database while preparing this request, so it sent nothing. "
                "Retry after a delay" + (" with the same key" if key is not None else "") +
                "; operators: check the database.",
                diagnostic=brief(exc),
            )
        if key is not None and not any(name == IDEMPOTENCY_KEY_HEADER for name, _ in reply.headers):
            reply.headers.append((IDEMPOTENCY_KEY_HEADER, key))
        return reply

    async def _one_attempt(self, entry: InvocationLog, req: AgentRequest, route: Route, key: str | None, generated: bool) -> Reply:
        """Approval (if the route wants one), credential, then the exchange: one attempt."""
        approval: dict[str, Any] | None = None
        if route.approval:
            held = await self._hold(entry, req, route, resumable=key is not None and not generated)
            if isinstance(held, Reply):
                return held
            approval = held
            await failpoint("after_approval")
        attempt = max(entry.record.attempt_count, 1)
        forbidden = {h.lower() for h in (self.settings.proxy.idempotency_header,)} if route.idempotency else set()
        if route.idempotency is not None:
            forbidden.add(route.idempotency.header.lower())
        if route.inject is not None:
            forbidden.add(route.inject.target_header.lower())  # a placeholder, replaced below
        headers = [(k, v) for k, v in req.headers if k.lower() not in HOP_BY_HOP and k.lower() not in forbidden]
        needles: list[bytes] = []
        if route.credential is not None and route.inject is not None:
            # Which secret the route uses is on the record even when it cannot be had (no version then).
            entry.credential = (route.credential, None, route.inject.method)
            try:
                credential = await self.credentials.get(route.credential)
            except CredentialUnavailable as exc:
                return await self._refuse(
                    entry,
                    Phase.CREDENTIAL_INJECTION,
                    exc.code,
                    f"The credential for route '{route.name}' could not be used ({exc.code.value}). "
                    "Nothing was sent. An operator must fix the secret source.",
                    diagnostic=exc.message,
                )
            name, value = injected_header(route.inject, credential)
            if _SPLITTER.search(value):  # the upstream client refuses it: not a connection failure
                return await self._refuse(
                    entry,
                    Phase.CREDENTIAL_INJECTION,
                    Code.CREDENTIAL_MISSING,
                    f"The credential for route '{route.name}' could not be used ({Code.CREDENTIAL_MISSING.value}): "
                    f"the secret holds a line break or another control character, which the {name} header cannot "
                    "carry. Nothing was sent. An operator must fix the secret's value.",
                    diagnostic=f"secret {credential.id} version {credential.version}: a control character in the value",
                )
            headers.append((name, value))
            needles = redaction_needles(credential, value)
            headers = _inspectable_codings(headers)
            entry.credential = (credential.id, credential.version, route.inject.method)
            entry.append(
                EventKind.CREDENTIAL_AUTHORIZED,
                attempt=attempt,
                credential_id=credential.id,
                credential_version=credential.version,
                injection=route.inject.method,
            )
        else:
            entry.append(EventKind.CREDENTIAL_AUTHORIZED, attempt=attempt, credential_id=None, injection="none")
        if route.idempotency is not None and key is not None:
            # The declared remote contract: the same key on every dispatch of this invocation.
            headers.append((route.idempotency.header, key))
        request = UpstreamRequest(
            method=entry.identity.method,
            scheme=req.scheme,
            host=req.host,
            port=req.port,
            target=req.path or "/",
            headers=headers,
            body=req.body,
            connect_timeout=route.connect_timeout or self.settings.upstream.connect_timeout,
            max_response_body=int(self.settings.upstream.max_response_body),
            pool=f"{req.agent}\n{route.name}",
            reuse=route.reuse_connections,
        )
        exchange = _Exchange(self, entry, request, needles)
        if approval is not None:
            exchange.approval_check = lambda: self._approval_still_valid(approval, entry, req, route)
        return await self._run(entry, exchange, req, route)

    # -- repeats of a keyed operation -------------------------------------------------------

    async def _repeat(self, row: dict[str, Any], req: AgentRequest, route: Route, request_fingerprint: str, key: str) -> Reply:
        """The agent sent a key this broker (or another) has seen: replay, re-send or refuse."""
        try:
            return await self._repeat_checked(row, req, route, request_fingerprint, key)
        except _Unreadable as exc:  # only reads before anything is sent raise it
            return self._unreadable(exc)
        except UnreadableRecord as exc:  # read before anything is sent, and a newer broker's record
            return self._unreadable(_Unreadable(str(exc), "format"))

    async def _read(self, awaitable: Awaitable[T]) -> T:
        """``await awaitable``, a journal read bounded by the journal's timeout in all (a wait for a
        pooled connection, a new connection, the query: a stalled database gets no more time by
        stalling each in turn); any failure of it becomes :class:`_Unreadable`."""
        try:
            async with asyncio.timeout(self.journal.timeout):
                return await awaitable
        except DecryptError as exc:
            raise _Unreadable(f"the record cannot be decrypted: {exc}", "decrypt") from exc
        except UnreadableRecord as exc:
            raise _Unreadable(str(exc), "format") from exc
        except Exception as exc:  # nothing has been sent yet, whatever went wrong: the answer can say so
            raise _Unreadable(brief(exc), "unreachable" if queries.unreachable(exc) else "error") from exc

    def _unreadable(self, exc: "_Unreadable") -> Reply:
        if exc.why == "error":
            log.error("a request with an idempotency key could not be checked against the journal: the read failed "
                      "on an error that is not an outage (%s); answered 500, nothing sent", exc, exc_info=exc.__cause__)
            return internal_error(
                "The broker hit an internal error while checking this request's idempotency key against its journal, "
                "so it sent nothing. It cannot say what became of the operation the key names: do not re-send it "
                "under a new key; operators: see the broker log.")
        if exc.why == "format":
            if (more := self._outage_lines.suffix("format")) is not None:  # every repeat of such a key, in a rolling upgrade
                log.error("a request with an idempotency key could not be checked against its invocation's record: %s; "
                          "refused as JOURNAL_UNAVAILABLE, nothing sent. Upgrade this broker to the version that wrote "
                          "it (docs/operations.md, Upgrading)%s", exc, more)
            return self._journal_unavailable(message=(
                "The record this idempotency key is bound to was written by a newer version of the broker than this "
                "one, which cannot read it, so it sent nothing. Retry after a delay with the same key, never a new "
                "one (an upgraded broker can answer it); operators: upgrade this broker."))
        if exc.why == "decrypt":
            log.warning("a request with an idempotency key could not be checked against its invocation's record: %s; "
                        "refused as JOURNAL_UNAVAILABLE, nothing sent. Put the key back in [crypto] keys.", exc)
            return self._journal_unavailable(message=(
                "The broker cannot read the record this idempotency key is bound to (it was encrypted under a key "
                "this broker no longer has), so it sent nothing. Retry after a delay with the same key, never a new "
                "one (the operation it names may have had its effect); operators: put the old key back in [crypto] keys."))
        # One line per request would flood the log in an outage under load (the journal's own
        # failure lines are throttled the same way).
        if (more := self._outage_lines.suffix("keyed check")) is not None:
            log.warning("a request with an idempotency key could not be checked against the journal, which did not "
                        "answer (%s); refused as JOURNAL_UNAVAILABLE, nothing sent%s", exc, more)
        return self._journal_unavailable(message=(
            "The broker could not check this request's idempotency key against its journal (the database did not "
            "answer), so it sent nothing and recorded nothing. It cannot say whether the key names an earlier "
            "operation, which may have had its effect: retry after a delay with the same key, never a new one; "
            "operators: check the database."))

    async def _repeat_checked(
        self, row: dict[str, Any], req: AgentRequest, route: Route, request_fingerprint: str, key: str
    ) -> Reply:
        for _ in range(3):
            _, events = await self._read(queries.events_of(self.journal.engine, row["invocation_id"], self.journal.decode_payload))
            record = project(events)
            if record.stage in (Stage.HELD, Stage.APPROVED):
                return await self._repeat_held(row, record, req, route, request_fingerprint, key)
            if row["fingerprint"] != request_fingerprint:
                return self._repeat_envelope(
                    row, None, Code.IDEMPOTENCY_MISMATCH,
                    f"The key {key!r} belongs to invocation {row['invocation_id']}, which has a different request "
                    "fingerprint. Nothing was sent. Use a new key for a new operation, or repeat the original request exactly.",
                    request_fingerprint,
                )
            now = utcnow()
            operation = operation_of(row)
            retry = retry_hint(record, operation, retention_open=retention_open(row, now))
            action = decide(record, retry, operation, request_fingerprint)
            leased = row["lease_expires_at"] is not None and _aware(row["lease_expires_at"]) > now
            if record.result_stored and action in (NextAction.FETCH_RESULT, NextAction.RETURN_RECORDED_RESULT, NextAction.WAIT):
                return await self._replay(row, record)
            if record.ended and leased:
                # Between attempts: a broker took it for one more, and has not written that
                # attempt's first event yet (or stopped before it could: nothing says which).
                until = _aware(row["lease_expires_at"]).strftime("%H:%M:%S UTC")
                return self._repeat_envelope(
                    row, record, Code.IDEMPOTENCY_IN_PROGRESS,
                    f"Invocation {row['invocation_id']} with this key ended {record.outcome.value}, and a broker "
                    f"process ({row['owner']}) holds a lease on it until {until} for one more attempt. Nothing was "
                    "sent for this request. If that process stopped before sending, the lease runs out then and a "
                    "repeat with this key may take the attempt over: ask again after it, or GET /v1/invocations/{id}.",
                )
            if not record.ended:
                return self._repeat_envelope(
                    row, record, Code.IDEMPOTENCY_IN_PROGRESS,
                    f"Invocation {row['invocation_id']} with this key is still in progress. Nothing was sent. "
                    "Ask again later, or GET /v1/invocations/{id}.",
                )
            # A complete refusal with Retry-After is this key's answer, before and after the delay:
            # the key names one recorded exchange, and the refusal proves nothing happened, so
            # the agent tries again later as a new operation (a new key). Never re-sent from here.
            if action in (NextAction.FETCH_RESULT, NextAction.RETURN_RECORDED_RESULT, NextAction.RETRY_WHEN_ALLOWED):
                return await self._replay(row, record)
            if action is NextAction.RECONCILE:
                reason = "its idempotency retention has run out" if row["remote_contract"] else "the route declares no remote idempotency contract"
                return self._repeat_envelope(
                    row, record, Code.RECONCILE_REQUIRED,
                    f"Invocation {row['invocation_id']} may already have had its effect, and {reason}, so it cannot be "
                    "re-sent safely. Nothing was sent. Reconcile it (the remote's records, or an operator).",
                )
            if row["generation"] >= row["retry_budget"]:
                if record.dispatch_count == 0:  # nothing to reconcile: no attempt of it was ever sent
                    advice = ("None of its attempts was sent either, so nothing happened under this key: once the cause "
                              "is fixed (GET /v1/invocations/{id} says what ended them), send the operation again with "
                              "a new key.")
                elif record.outcome is Outcome.UNKNOWN:
                    advice = "Its effect is unknown: reconcile it (the remote's records) or ask an operator."
                else:
                    advice = f"Its outcome is {record.outcome.value}: GET /v1/invocations/{{id}} says what is known."
                return self._repeat_envelope(
                    row, record, Code.RETRY_BUDGET_EXHAUSTED,
                    f"Invocation {row['invocation_id']} used its retry budget ({row['retry_budget']}), so this repeat "
                    f"with its key was not sent. {advice}",
                )
            until = now + timedelta(seconds=self.settings.proxy.retry_lease)
            if await self._read(leases.take_lease(self.journal.engine, row["invocation_id"], row["generation"], self.owner, now, until)):
                return await self._reattempt(row, record, req, route, key, until)
            row = await self._read(queries.invocation(self.journal.engine, row["invocation_id"])) or row
        return self._repeat_envelope(
            row, None, Code.IDEMPOTENCY_IN_PROGRESS,
            f"Invocation {row['invocation_id']} is being retried elsewhere. Nothing was sent. Ask again later.",
        )

    def earlier_self(self, holder: str) -> bool:
        """Whether ``holder`` is an earlier incarnation of this broker, and so dead (this one holds
        its port), however fresh its last heartbeat; any other holder is alive until its
        heartbeat goes stale."""
        return (holder != self.owner and holder.rpartition("/")[0] == self.owner.rpartition("/")[0]
                and self.earlier_incarnation_dead(holder))

    async def _repeat_held(
        self, row: dict[str, Any], record: Record, req: AgentRequest, route: Route, request_fingerprint: str, key: str
    ) -> Reply:
        """A repeat of an operation that is waiting for (or has) an operator's approval."""
        if row["fingerprint"] != request_fingerprint:
            return self._repeat_envelope(
                row, None, Code.APPROVAL_STALE,
                f"The key {key!r} belongs to invocation {row['invocation_id']}, held for an approval of a different "
                "request; the approval authorises nothing new. Nothing was sent.",
                request_fingerprint,
            )
        holder = row["owner"] or ""
        earlier_self = self.earlier_self(holder)
        holder_alive = not earlier_self and await self._read(
            leases.owner_alive(self.journal.engine, holder, self.settings.recovery.stale_after))
        now = utcnow()
        until = now + timedelta(seconds=max(self.settings.proxy.retry_lease, route.approval_timeout))
        if holder_alive or not await self._read(
                leases.take_lease(self.journal.engine, row["invocation_id"], row["generation"], self.owner, now, until)):
            if record.stage is Stage.APPROVED and holder_alive:
                message = (f"Invocation {row['invocation_id']} is approved, and the broker process that holds it "
                           f"({holder}, alive by its heartbeat) is about to send it; had it stopped, a repeat takes "
                           f"the approval over once its heartbeat is {self.settings.recovery.stale_after:g} s old. "
                           "Nothing was sent for this request. Ask again later, or GET /v1/invocations/{id}.")
            elif record.stage is Stage.APPROVED:  # its holder had stopped, and another repeat took it over first
                message = (f"Invocation {row['invocation_id']} is approved, and another broker process took it over "
                           "just now to send it. Nothing was sent for this request. Ask again later, or GET "
                           "/v1/invocations/{id}.")
            else:
                message = (f"Invocation {row['invocation_id']} is waiting for an operator's approval. Nothing was "
                           "sent. Ask again later.")
            return self._repeat_envelope(row, record, Code.APPROVAL_REQUIRED, message)
        # The broker that held it stopped: continue its attempt here, under a lease.
        entry = InvocationLog(self.journal, identity_of(row), self.owner, record=record, persisted=True,
                              generation=row["generation"] + 1)
        entry.lease_expires_at = until
        return await self._attempt(entry, req, route, key, generated=False)

    async def _reattempt(
        self, row: dict[str, Any], record: Record, req: AgentRequest, route: Route, key: str, until: datetime
    ) -> Reply:
        """One more attempt of an existing invocation, under the lease this broker just took."""
        identity = identity_of(row)
        entry = InvocationLog(
            self.journal, identity, self.owner, record=record, persisted=True, generation=row["generation"] + 1
        )
        entry.lease_expires_at = until
        await failpoint("after_lease")
        entry.append(
            EventKind.PREFLIGHT_VALIDATED,
            route=route.name,
            attempt=record.attempt_count + 1,
            generation=entry.generation,
            retry_of=record.outcome.value,
        )
        return await self._attempt(entry, req, route, key, generated=False)

    async def _replay(self, row: dict[str, Any], record: Record) -> Reply:
        """Serve the recorded result again; the upstream is not contacted."""
        stored = await self._read(queries.stored_result(self.journal.engine, row["invocation_id"], self.journal.decode_result))
        if stored is None and record.reconciled_outcome is not None:
            return self._repeat_envelope(
                row, record, Code.RESULT_UNAVAILABLE,
                f"Invocation {row['invocation_id']} was reconciled as {record.reconciled_outcome.value}; there is no "
                "recorded response to replay. Nothing was sent; GET /v1/invocations/{id} has the reconciliation.",
            )
        if stored is None:
            return self._repeat_envelope(
                row, record, Code.RESULT_STORE_FAILED,
                f"Invocation {row['invocation_id']} completed, but its result was not stored. Nothing was sent. "
                "An operator must reconcile it; do not re-send.",
            )
        self._spawn(note_replay(self.journal, row, "replay"))
        headers = [(k, v) for k, v in stored["headers"] if k.lower() not in HOP_BY_HOP]
        headers += _length_fields(stored["status"], stored["framing"], stored["body"], stored["headers"])
        headers += [
            (INVOCATION_HEADER, row["invocation_id"]),
            (OUTCOME_HEADER, record.outcome.value),
            (REPLAYED_HEADER, "true"),
        ]
        if row["idempotency_key"]:
            headers.append((IDEMPOTENCY_KEY_HEADER, row["idempotency_key"]))
        return Reply(stored["status"], headers, bytes(stored["body"]), row["invocation_id"], framed=True)

    def _repeat_envelope(
        self, row: dict[str, Any], record: Record | None, code: Code, message: str, request_fingerprint: str | None = None
    ) -> Reply:
        """An answer about a repeat of a keyed operation. ``record`` None: this request itself was
        refused before anything (its own fingerprint given, next to the one the key is bound to)."""
        identity = identity_of(row)
        phase = Phase.VALIDATION
        if code is Code.IDEMPOTENCY_IN_PROGRESS:
            # An attempt of the operation this key names is running (here or on another broker):
            # it may cross the dispatch boundary at any moment, if it has not already, so its
            # effect is unknown, whatever its record said when it was read (`not_attempted`
            # would tell the agent nothing will happen, and invite a new key: a second effect).
            # What is safe is this very request, key and all, again: it is answered from the
            # record, once there is one, and never sent twice.
            outcome, retry = Outcome.UNKNOWN, Retry.SAME_IDEMPOTENCY_KEY
        elif record is None:  # this request itself was not attempted
            outcome, retry = Outcome.NOT_ATTEMPTED, Retry.AFTER_CORRECTION
        else:
            outcome = record.outcome
            retry = retry_hint(record, identity.operation, retention_open=identity.retention_open(utcnow())) or Retry.BACKOFF
            if code is Code.RETRY_BUDGET_EXHAUSTED:
                retry = Retry.RECONCILE if outcome is Outcome.UNKNOWN else Retry.AFTER_CORRECTION
        evidence = evidence_from(record, identity)
        if request_fingerprint is not None:
            evidence["fingerprint"] = request_fingerprint
            evidence.setdefault("idempotency", {})["bound_fingerprint"] = identity.fingerprint
        body = envelope(row["invocation_id"], code, phase, outcome, retry, message, evidence)
        headers = [
            ("Content-Type", MEDIA_TYPE),
            (INVOCATION_HEADER, row["invocation_id"]),
            (OUTCOME_HEADER, outcome.value),
            (CODE_HEADER, code.value),
            # A client's own retry loop (an SDK's) repeats this request with the agent's key,
            # which is what is safe here; it should wait a moment first.
            *([("x-should-retry", "true"), ("Retry-After", "1")] if code is Code.IDEMPOTENCY_IN_PROGRESS
              else should_retry(retry)),
        ]
        if row["idempotency_key"]:
            headers.append((IDEMPOTENCY_KEY_HEADER, row["idempotency_key"]))
        return Reply(status_for(code), headers, encode(body), row["invocation_id"])

    # -- reconciliation by lookup ------------------------------------------------------------

    async def lookup(self, row: dict[str, Any]) -> dict[str, Any]:
        """Ask the remote what became of an invocation, through the broker itself: the lookup is
        its own recorded invocation, on behalf of the same agent, matched against the routes.

        A complete 2xx means the remote has the operation (committed); a complete 404 or 410 means
        it has none (rejected: no effect claimed). Anything else is no finding.
        """
        route = next((r for r in self.settings.routes if r.name == row["route"]), None)
        if route is None or route.lookup is None:
            raise LookupUnavailable(f"route {row['route']!r} declares no lookup: give the outcome yourself "
                                    "(--outcome, or outcome in the body), or declare a lookup on the route "
                                    "(docs/configuration.md#lookup)")
        _, events = await queries.events_of(self.journal.engine, row["invocation_id"], self.journal.decode_payload)
        job_ref = next((e.get("job_ref") for e in reversed(events) if e.kind is EventKind.REMOTE_RESPONSE_COMPLETE), None)
        values = dict(zip(LOOKUP_PLACEHOLDERS, (row["idempotency_key"], row["invocation_id"], job_ref)))
        path = route.lookup.path
        for name, value in values.items():
            if "{" + name + "}" in path:
                if not value:
                    raise LookupUnavailable(f"the lookup needs {{{name}}}, which invocation {row['invocation_id']} does not have")
                path = path.replace("{" + name + "}", quote(str(value), safe=""))
        target = urlsplit(row["target"])
        req = AgentRequest(
            agent=row["agent"],
            scheme=target.scheme,
            host=target.hostname or route.host,
            port=target.port or route.port,
            method=route.lookup.method,
            path=path,
            headers=[("Accept", "application/json")],
            body=b"",
        )
        reply = await self.handle(req)
        if reply.delivered is not None:
            reply.delivered()  # the broker itself consumed the answer
        code = next((v for k, v in reply.headers if k == CODE_HEADER), None)  # the broker's own answer, not the remote's
        outcome = next((v for k, v in reply.headers if k == OUTCOME_HEADER), None)
        finding = None
        if code is None and 200 <= reply.status < 300:
            finding = Outcome.COMMITTED
        elif code is None and reply.status in (404, 410):
            finding = Outcome.REJECTED
        # (RESULT_STORE_FAILED: the remote answered, completely, but the lookup's own record of it
        # failed; a finding resting on an unrecorded answer is not made.)
        return {"lookup_invocation_id": reply.invocation_id, "status": reply.status, "finding": finding,
                "code": code, "lookup_outcome": outcome}

    # -- approvals (contract section 12) -------------------------------------------------------

    async def _card(self, entry: InvocationLog, req: AgentRequest, route: Route) -> dict[str, Any]:
        """What the operator sees and approves, computed before any secret is touched."""
        credential_id = route.credential
        version = await self.credentials.version(credential_id) if credential_id else None
        injection = route.inject.method if route.inject else "none"
        body_hash = body_sha256(req.body)
        return {
            "agent": entry.identity.agent,
            "route": route.name,
            "method": entry.identity.method,
            "target": entry.identity.target,
            "body_sha256": body_hash,
            "body_bytes": len(req.body),
            "credential_id": credential_id,
            "credential_version": version,
            "injection": injection,
            "approves": approval_fingerprint(entry.identity.method, entry.identity.target, body_hash, credential_id, version, injection),
            "config_digest": config_digest(route.model_dump_json()),
            "retry_of_uncertain_action": entry.record.dispatch_started or None,
        }

    async def _hold(self, entry: InvocationLog, req: AgentRequest, route: Route, *, resumable: bool) -> dict[str, Any] | Reply:
        """Hold the request, durably, until an operator decides, the route's timeout passes, or
        the caller leaves. Returns the grant, or the reply that ends the attempt. ``resumable``:
        the agent's own key names it, so its repeat can take the hold over after a stop."""
        if entry.record.stage is Stage.APPROVED and entry.record.approval is not None:
            return dict(entry.record.approval)  # decided while no broker held it (a taken-over record)
        if entry.record.stage is not Stage.HELD:
            entry.append(EventKind.APPROVAL_REQUESTED, **await self._card(entry, req, route))
            try:
                await entry.commit()
            except JournalUnavailable as exc:
                return self._journal_unavailable(entry, unwritten=exc.unwritten)
            except LeaseLost:
                return self._lease_lost(entry)
        deadline = time.monotonic() + route.approval_timeout
        while True:
            try:
                later = await queries.events_after(self.journal.engine, entry.invocation_id,
                                                   entry.record.last_seq or 0, self.journal.decode_payload)
            except queries.DATABASE_ERRORS as exc:
                if not queries.unreachable(exc) or time.monotonic() >= deadline:
                    raise
                later = []  # a moment's outage: the card stays held, and the next poll looks again
                log.debug("invocation %s: could not read its approval state (%s); polling on", entry.invocation_id,
                          brief(exc))
            if later:
                entry.adopt(later)
            if entry.record.stage is Stage.APPROVED and entry.record.approval is not None:
                return dict(entry.record.approval)
            if entry.record.code is Code.APPROVAL_DENIED:
                entry.append(EventKind.CALLER_ANSWERED)
                try:
                    await entry.commit()
                except (JournalUnavailable, LeaseLost):
                    pass  # the denial stands whatever this fact's fate; the agent is told either way
                # A re-send's denial: this attempt sent nothing, but an earlier one was sent, and
                # the invocation's outcome stays what the record says (unknown).
                outcome = entry.record.outcome or Outcome.NOT_ATTEMPTED
                return self._envelope_reply(
                    entry, Code.APPROVAL_DENIED, Phase.CREDENTIAL_INJECTION, outcome, Retry.AFTER_CORRECTION,
                    "An operator denied this request. Nothing was sent and no secret was touched." if outcome is
                    Outcome.NOT_ATTEMPTED else "An operator denied this repeat, so this attempt sent nothing and "
                    "touched no secret. An earlier attempt of this invocation was sent, so its effect is unknown: do "
                    "not send it again as a new operation; have it reconciled (GET /v1/invocations/{id}).",
                )
            if self.stop_begun:
                # The request stays held, for the agent's repeat to a broker that runs (held
                # approvals survive restarts), not ended as the caller's leaving; a caller still
                # connected is told so at once, rather than cut without an answer at the end of
                # the stop's wait.
                if not resumable:  # no key of the agent's names it: no repeat could take it over
                    log.info("invocation %s: the broker stops while it is held for approval; without a key of the "
                             "agent's own no repeat can take it over, so it ends (APPROVAL_REQUIRED)", entry.invocation_id)
                    return await self._refuse(
                        entry, Phase.VALIDATION, Code.APPROVAL_REQUIRED,
                        "The broker is stopping (a restart or a scale-down) while this request was held for an "
                        "operator's approval. Nothing was sent. Without an Idempotency-Key of the agent's own the "
                        "hold cannot be taken over by a repeat, so it ends here and its card is withdrawn. Send the "
                        "request again to a running broker (with an Idempotency-Key, a held request survives a restart).",
                    )
                log.info("invocation %s: the broker stops while it is held for approval; it stays held for the agent's "
                         "repeat with its key", entry.invocation_id)
                if req.caller_gone.is_set():
                    return Reply(499, [], b"", entry.invocation_id)
                return self._held_at_stop(entry)
            if req.caller_gone.is_set():
                entry.append(EventKind.CALLER_CANCELLED, disposition=req.left_as.value)
                entry.append(EventKind.FAILED, phase=Phase.VALIDATION, code=Code.CALLER_CANCELLED)
                entry.submit_quietly()
                return Reply(499, [], b"", entry.invocation_id)
            if time.monotonic() >= deadline:
                return await self._refuse(
                    entry, Phase.VALIDATION, Code.APPROVAL_REQUIRED,
                    f"Route '{route.name}' needs an operator's approval and none came within "
                    f"{route.approval_timeout:g} s. Nothing was sent, and the request no longer waits. "
                    "Repeat it (with the same Idempotency-Key) to hold it again, and have an operator "
                    "approve it while it waits (GET /v1/approvals).",
                )
            await req.caller_gone.wait(0.25)

    def _held_at_stop(self, entry: InvocationLog) -> Reply:
        """The answer to a caller whose request is held for approval when the broker stops: it
        stays held, and a repeat with its key continues the wait on a broker that runs."""
        sent_before = entry.record.dispatch_count > 0  # a held re-send of an unknown outcome
        outcome = Outcome.UNKNOWN if sent_before else Outcome.NOT_ATTEMPTED
        retry = Retry.SAME_IDEMPOTENCY_KEY if sent_before else Retry.BACKOFF
        effect = ("This attempt sent nothing, but an earlier attempt of this invocation was sent, so its effect is "
                  "unknown: repeat it only with the same Idempotency-Key, never as a new operation."
                  if sent_before else "Nothing was sent.")
        return self._envelope_reply(
            entry, Code.APPROVAL_REQUIRED, Phase.VALIDATION, outcome, retry,
            "The broker is stopping (a restart or a scale-down) while this request was held for an operator's "
            f"approval. {effect} The request stays held and its card stays listed: repeat it with the same "
            "Idempotency-Key to a running broker (or this one once it is back), where it waits for the decision and "
            "is sent once approved.",
        )

    def _approval_still_valid(self, approval: dict[str, Any], entry: InvocationLog, req: AgentRequest, route: Route) -> str | None:
        """Right before the dispatch write: does the approval cover exactly what is about to be
        sent, under the configuration it was given under? Returns why not, or None."""
        credential_id, credential_version, injection = entry.credential
        now = approval_fingerprint(
            entry.identity.method, entry.identity.target, body_sha256(req.body), credential_id, credential_version,
            injection or "none",
        )
        if now != approval.get("approves"):
            return "the request or its credential version differs from the one approved"
        if config_digest(route.model_dump_json()) != approval.get("config_digest"):
            return "the route's configuration changed since the approval"
        return None

    def _horizon(self, route: Route) -> float:
        return route.result_horizon or self.settings.upstream.result_horizon

    async def _run(self, entry: InvocationLog, exchange: _Exchange, req: AgentRequest, route: Route) -> Reply:
        """Run the exchange in its own task; give the caller its answer, or let it go."""
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        task = loop.create_task(exchange.run())
        # Until dispatch, connection setup is bounded by its own timeouts; after it, the caller
        # waits at most the response timeout.
        timeout = route.response_timeout or self.settings.upstream.response_timeout
        await _settled_or_released(loop, task, req.caller_gone, exchange.dispatched, timeout)
        if not task.done() and not req.caller_gone.is_set() and exchange.recording:
            # The upstream's complete answer is in hand and only its record is on the way: the
            # response timeout is the upstream's, not the journal's. That commit is bounded by the
            # journal's own timeout; then the caller gets the answer (flagged RESULT_STORE_FAILED
            # if it could not be stored), never a 504 that calls a complete answer missing.
            now = Flag()
            now.set()  # the clock starts at once: a bound beyond the journal's own (a batch ahead, then this one)
            await _settled_or_released(loop, task, req.caller_gone, now, 2 * self.journal.timeout)
        if task.done():
            return await self._answer(exchange, task.result())
        disposition = req.left_as.value if req.caller_gone.is_set() else "timed_out"
        return await self._release_caller(entry, exchange, task, disposition, started, self._horizon(route))

    async def _release_caller(
        self,
        entry: InvocationLog,
        exchange: _Exchange,
        task: asyncio.Task[_Settled],
        disposition: str,
        started: float,
        horizon: float,
    ) -> Reply:
        """The caller stopped waiting; the exchange goes on in the background until the horizon."""
        exchange.caller_left = True
        exchange.record_progress()
        entry.append(EventKind.CALLER_CANCELLED, disposition=disposition)
        horizon = horizon - (time.monotonic() - started)
        self._spawn(self._finish_unanswered(entry, exchange, task, max(horizon, 0.1)))
        if disposition != "timed_out":
            entry.submit_quietly()
            return Reply(499, [], b"", entry.invocation_id)
        try:
            await entry.commit()
        except (JournalUnavailable, LeaseLost):  # another broker closed the record: the answer is still this one
            pass
        provisional = _provisional_end(entry, exchange.recording)
        if exchange.recording:
            message = ("The upstream's complete response arrived, but the journal did not make it durable in time, "
                       "so the broker cannot hand it over yet; it keeps trying to record it. The effect is unknown "
                       "until then: fetch the result later (GET /v1/invocations/{id}/result); do not re-send.")
        else:
            message = ("No complete response arrived within the response timeout. The request was sent, so the "
                       "effect is unknown. The broker keeps listening; ask GET /v1/invocations/{id} before any retry.")
        return self._envelope_reply(
            entry, Code.REMOTE_OUTCOME_UNKNOWN, Phase.REMOTE_EXECUTION, provisional[0], provisional[1], message,
            timed_out=True,
        )

    async def _finish_unanswered(
        self, entry: InvocationLog, exchange: _Exchange, task: asyncio.Task[_Settled], horizon: float
    ) -> None:
        settled: _Settled | None = None
        try:
            try:
                settled = await asyncio.wait_for(asyncio.shield(task), horizon)
            except asyncio.TimeoutError:
                if exchange.recording:
                    # The complete answer came within the horizon; only its record is slow to commit
                    # (bounded by the journal's timeout). It ends as that commit does, never as unknown.
                    settled = await asyncio.shield(task)
        except Exception:  # pragma: no cover - the exchange task itself never raises
            log.exception("exchange %s crashed", entry.invocation_id)
            return
        refused = settled.refused.code if settled is not None and settled.refused is not None else None
        if refused is Code.JOURNAL_UNAVAILABLE:
            # Its DISPATCH_STARTED write failed and may have landed: as for a caller still waiting
            # (:meth:`_answer`), the record is closed once the journal answers, by what it holds.
            self._in_background(self._close_when_journal_returns(entry, answered=False))
            return
        if refused is Code.LEASE_LOST:
            return  # another broker owns the record now: this one can write nothing to it (see _lease_lost)
        if settled is None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            settled = _Settled(
                failure=ExchangeFailed(
                    Code.REMOTE_OUTCOME_UNKNOWN,
                    "no complete response within result_horizon",
                    request_complete=entry.record.request_complete,
                    headers_received=entry.record.response_headers_received,
                )
            )
        self._end(entry, settled, answered=False)
        try:
            await entry.commit()
        except JournalUnavailable:
            self._resend_in_background(entry, "its end")
        except LeaseLost:
            pass  # another broker closed the record meanwhile: it says what that broker knew

    def _end(self, entry: InvocationLog, settled: _Settled, *, answered: bool) -> None:
        """Append the event that ends the record, given how the exchange settled."""
        answered_flag = answered or None
        if settled.refused is not None:
            entry.append(
                EventKind.FAILED, phase=Phase.VALIDATION, code=settled.refused.code, answered=answered_flag,
                diagnostic=str(settled.refused) or None,
            )
        elif settled.setup is not None:
            entry.append(
                EventKind.FAILED,
                phase=Phase.CONNECTION_SETUP,
                code=settled.setup.code,
                stage=settled.setup.stage,
                attempt=settled.attempt,
                answered=answered_flag,
            )
        elif settled.failure is not None:
            entry.append(
                EventKind.FAILED,
                phase=Phase.REMOTE_EXECUTION,
                code=settled.failure.code,
                diagnostic=settled.failure.diagnostic,
                request_complete=settled.failure.request_complete,
                answered=answered_flag,
            )
        elif settled.store_failed:
            self._spawn(self._repair(entry, settled.response.status if settled.response else 0, None))
        elif not answered:
            entry.append(EventKind.FAILED, phase=Phase.RESULT_DELIVERY, code=Code.CALLER_CANCELLED)

    async def _answer(self, exchange: _Exchange, settled: _Settled) -> Reply:
        entry = exchange.entry
        if settled.response is not None and not settled.store_failed:
            return self._result_reply(exchange, settled.response)
        if settled.response is not None:
            # Complete and authentic, but not stored: the caller gets the truth now, flagged; the
            # broker keeps trying to record it and never re-sends.
            reply = self._result_reply(exchange, settled.response, code=Code.RESULT_STORE_FAILED)
            # None once delivered; else how the caller left.
            handed: asyncio.Future[CallerDisposition | None] = asyncio.get_running_loop().create_future()
            reply.delivered = lambda: handed.done() or handed.set_result(None)
            reply.undelivered = lambda left: handed.done() or handed.set_result(left)
            self._spawn(self._repair(entry, settled.response.status, handed))
            return reply
        if settled.refused is not None and settled.refused.code is Code.JOURNAL_UNAVAILABLE:
            return self._journal_unavailable(entry, unwritten=settled.refused.unwritten)
        if settled.refused is not None and settled.refused.code is Code.LEASE_LOST:
            return self._lease_lost(entry, refused_dispatch=True)  # only dispatch() refuses so: its own write
        self._end(entry, settled, answered=True)
        try:
            await entry.commit()
        except JournalUnavailable as exc:
            if not entry.record.dispatch_started:
                return self._journal_unavailable(entry, unwritten=exc.unwritten)
            # The caller gets what this broker knows; the record gets it once the journal is back.
            self._resend_in_background(entry, "its end")
        except LeaseLost:
            if not entry.record.dispatch_started:
                return self._lease_lost(entry)
            # After dispatch: another broker closed the record meanwhile; what this broker saw is
            # still the truth of this attempt, and the caller gets it.
        record = entry.record
        code = record.code or Code.REMOTE_OUTCOME_UNKNOWN
        retry = entry.retry_for(record) or Retry.BACKOFF
        message = settled.message or _message(code, record.outcome)
        if settled.message is _STOPPING or settled.message is _OUT_OF_FILES:
            message = _message(code, record.outcome, settled.message)
        if retry is Retry.AFTER_CORRECTION:  # this attempt used the key's last: "retrying later" is not safe with it
            message = _RETRYING_IS_SAFE.sub(_BUDGET_USED, message)
        return self._envelope_reply(entry, code, record.phase, record.outcome, retry, message)

    async def _close_when_journal_returns(self, refused: InvocationLog, *, answered: bool = True) -> None:
        """End, by appending, the record of ``refused``, whose dispatch write (or the end after
        it) the journal refused; this broker sent nothing. If DISPATCH_STARTED did land (an
        ambiguous commit), the record says unknown. ``answered``: the caller got the 503 (else it
        had left, and the record says so if it does not yet)."""
        invocation_id = refused.invocation_id
        # For as long as this broker runs: while it beats no other broker closes its records, and
        # a key bound to one in flight answers every repeat with IDEMPOTENCY_IN_PROGRESS.
        pause, patience = 1.0, time.monotonic() + self.settings.upstream.result_horizon
        while True:
            await asyncio.sleep(pause)
            pause = min(pause * 2, 30.0)
            if time.monotonic() > patience:
                patience = math.inf
                if refused.durable:
                    log.warning("invocation %s: its record is still not closed (the journal does not take the write); "
                                "it says the request is in flight until it is. The broker keeps trying while it runs; "
                                "if it stops first, recovery closes the record at the next start", invocation_id)
                else:  # its first write was the one refused: the journal may hold nothing of it
                    log.warning("invocation %s: the journal still does not answer, so the broker cannot tell whether "
                                "its refused first write landed (the agent was told none was recorded, and nothing "
                                "was sent). If it did, the record says the request is in flight until the broker "
                                "closes it; it keeps trying while it runs, and recovery closes it at the next start",
                                invocation_id)
            try:
                await self.journal.settle()  # a refused write still on its way cannot land after this read
                row = await queries.invocation(self.journal.engine, invocation_id)
                if row is None:
                    return  # nothing of it was ever durable, nor can be now
                _, events = await queries.events_of(self.journal.engine, invocation_id, self.journal.decode_payload)
                record = project(events)
                if record.ended:
                    # The refused write may have been the end itself, landed unconfirmed: reported
                    # now, as any end the journal holds. Or a re-send refused so ends with the
                    # earlier attempt's end on the record; its lease would keep repeats at
                    # IDEMPOTENCY_IN_PROGRESS until it ran out.
                    await refused.settle_landed()
                    await leases.release_lease(self.journal.engine, invocation_id, row["generation"], self.owner)
                    return
                if record.stage is Stage.HELD:
                    return
                entry = InvocationLog(self.journal, identity_of(row), self.owner, record=record, persisted=True,
                                      generation=row["generation"])
                entry.credential = (row["credential_id"], row["credential_version"], row["injection"])
                for kind, data in closing_events(
                    record, cause="the journal did not confirm a write", code=Code.JOURNAL_UNAVAILABLE, answered=answered,
                    after_dispatch="the journal took DISPATCH_STARTED but did not confirm it, so this broker sent "
                                   "nothing; the record cannot prove that (reconcile it)"):
                    entry.append(kind, **data)
                await entry.commit()
                return
            except (JournalUnavailable, LeaseLost):
                continue
            except UnreadableRecord:
                return  # a newer broker wrote to it since: left to one that can read it
            except Exception as exc:  # the database is still away; try again
                log.debug("closing %s later: %s", invocation_id, exc)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _reconcile_from_what_was_seen(
        self, entry: InvocationLog, status: int, handed: asyncio.Future[CallerDisposition | None] | None
    ) -> None:
        """Another broker closed this record (its owner looked dead: cut off from the database
        longer than ``stale_after``) while this one held the upstream's complete answer. The
        events of the exchange can no longer be written, but what this broker saw can be
        appended as a finding: the outcome that status proves, certainty ``remote_response``.
        Without it the record would say unknown, and invite a re-send of a completed operation.
        It is appended at once, so the note says what is known of the hand-over now (``handed``,
        as for :meth:`_repair`), without waiting for a slow reader."""
        outcome = classify_status(status)
        if handed is not None and not handed.done():
            caller = "the answer was being handed to the caller, flagged RESULT_STORE_FAILED, not yet confirmed"
        elif (left := handed.result() if handed is not None else _recorded_leaving(entry)) is None:
            caller = "the answer was handed to the caller flagged RESULT_STORE_FAILED"
        else:
            caller = f"the caller was no longer waiting ({left.value}), so nobody received the answer"
        note = (f"the broker that sent it ({self.owner}) received the upstream's complete answer, status {status}, "
                "after another broker had closed the record as unknown (this broker could not reach the journal "
                f"meanwhile); {caller}, and its body is not stored")
        try:
            row = await queries.invocation(self.journal.engine, entry.invocation_id)
            if row is None:
                raise decisions.DecisionRefused(404, "the record is gone")
            _, events = await queries.events_of(self.journal.engine, entry.invocation_id, self.journal.decode_payload)
            record = project(events)
            # Only over the close of this very attempt: not after a later attempt (a re-send
            # under a new generation, whose effect this answer says nothing about), and never
            # over a finding someone has already made.
            if row["generation"] != entry.generation:
                raise decisions.DecisionRefused(409, f"another attempt (generation {row['generation']}) has been made "
                                                     "since, and this answer is about an earlier one")
            if record.reconciled_outcome is not None:
                raise decisions.DecisionRefused(409, f"it was already reconciled as {record.reconciled_outcome.value}")
            if record.stage is not Stage.ENDED_UNKNOWN:
                raise decisions.DecisionRefused(409, f"it ended otherwise (stage {record.stage.value})")
            await decisions.reconcile(self.journal, row, outcome, Certainty.REMOTE_RESPONSE.value, None, note,
                                      f"broker {self.owner}")
        except Exception as exc:  # refused (decided, or re-sent, since), or the journal is away again
            log.error("operator attention: invocation %s: while its result waited to be recorded, another broker "
                      "closed its record (its owner looked dead), and this broker did not append what it saw (%s). "
                      "Its attempt %d was answered %s (%s, as far as that attempt goes); this broker re-sent nothing. "
                      "Check the record (GET /v1/invocations/{id}) before reconciling.",
                      entry.invocation_id, getattr(exc, "message", None) or brief(exc), entry.generation + 1, status,
                      outcome.value)
            return
        log.error("operator attention: invocation %s: while its result waited to be recorded, another broker closed "
                  "its record as unknown (its owner looked dead); this broker appended what it saw instead: "
                  "reconciled as %s (the upstream answered %s, certainty remote_response). Nothing was re-sent; "
                  "the response body is not stored.", entry.invocation_id, outcome.value, status)

    @staticmethod
    async def _how_it_was_handed(
        entry: InvocationLog, handed: asyncio.Future[CallerDisposition | None] | None
    ) -> CallerDisposition | None:
        """Whether the caller got an answer the journal refused (None), or how it left."""
        if handed is None:
            return _recorded_leaving(entry)
        try:  # the adapter settles it once the answer's last byte has left, or the caller is gone
            return await asyncio.wait_for(asyncio.shield(handed), DELIVERY_CONFIRM_WAIT)
        except TimeoutError:  # a reader slower than that: unconfirmed, so the record says fetch it
            log.warning("invocation %s: the hand-over of its answer was not confirmed within %.0f s; recorded as "
                        "not delivered (the result is stored: the caller can fetch it)",
                        entry.invocation_id, DELIVERY_CONFIRM_WAIT)
            return CallerDisposition.DISCONNECTED

    async def _repair(self, entry: InvocationLog, status: int, handed: asyncio.Future[CallerDisposition | None] | None) -> None:
        """Record a complete result the journal refused, once the journal takes writes again.

        It tries for as long as this broker runs (the answer is in its memory, and only requests
        in flight when the journal went away have one: new ones are refused before dispatch).
        Until then the record shows the request dispatched and unfinished; if the broker stops
        first, recovery closes it as ``unknown`` (the broker cannot prove the result it saw).
        """
        log.error(
            "operator attention: invocation %s: the upstream answered %s but the result could not be stored; "
            "nothing will be re-sent; retrying to record it",
            entry.invocation_id, status,
        )
        patience: float | None = time.monotonic() + self.settings.upstream.result_horizon
        pause = 1.0
        while True:
            await asyncio.sleep(pause)
            try:
                await entry.resubmit()  # every failed write, in order (one that had landed counts as done)
                break
            except LeaseLost:
                await self._reconcile_from_what_was_seen(entry, status, handed)
                return
            except JournalUnavailable:
                if patience is not None and time.monotonic() > patience:
                    patience = None
                    log.error("invocation %s: its result is still not recorded (the journal does not take writes); "
                              "the broker keeps it and keeps trying while it runs. If it stops first, recovery "
                              "closes the record as unknown: reconcile it then (the upstream answered %s).",
                              entry.invocation_id, status)
                pause = min(pause * 2, 30.0)  # alone in its batch: a write that keeps failing fails nothing else
        left = await self._how_it_was_handed(entry, handed)
        if left is None:
            entry.append(EventKind.RESULT_DELIVERED, channel="proxy", recorded_after_delivery=True)
        else:
            if entry.record.caller_disposition is CallerDisposition.WAITING:  # else it is on the record already
                entry.append(EventKind.CALLER_CANCELLED, disposition=left.value)
            entry.append(EventKind.FAILED, phase=Phase.RESULT_DELIVERY, code=Code.CALLER_CANCELLED)
        try:
            await entry.commit()
        except LeaseLost:
            # The result's write had landed unconfirmed, and another broker, taking this one for
            # stopped, closed the record after it: its events hold the sequence numbers these need.
            log.warning("recorded the result of %s after the journal recovered, but not what became of its delivery "
                        "(%s): another broker closed the record meanwhile, taking this one for stopped, and the record "
                        "says what that broker knew (the result is stored: the caller may fetch it)",
                        entry.invocation_id, "handed to the caller" if left is None else f"the caller {left.value}")
        except Exception as exc:
            log.warning("recorded the result of %s after the journal recovered, but not what became of its delivery: %s",
                        entry.invocation_id, exc)
        else:
            log.warning("recorded the result of %s after the journal recovered", entry.invocation_id)

    def _result_reply(self, exchange: _Exchange, response: UpstreamResponse, code: Code | None = None) -> Reply:
        """The upstream's response, unchanged but for hop-by-hop headers, framing and any echo
        of the injected credential (the agent must never see it)."""
        entry = exchange.entry
        body, _, withheld = exchange.clean_body(response)
        headers, _ = _redact_headers(_withheld_headers(_passable(response.headers), withheld), exchange.needles)
        headers += _length_fields(response.status, response.framing, body, response.headers)
        headers.append((INVOCATION_HEADER, entry.invocation_id))
        headers.append((OUTCOME_HEADER, entry.record.outcome.value))
        if code is not None:
            headers.append((CODE_HEADER, code.value))
        if (response.status >= 500 and entry.record.outcome is Outcome.COMMITTED and not entry.identity.idempotent
                and not any(name.lower() == "x-should-retry" for name, _ in headers)):
            # A 500 the remote answered a non-idempotent request with is a result (committed: it ran
            # far enough to answer); an SDK's own loop would send the request again blindly, as a new
            # invocation. The remote's own x-should-retry, when it sends one, is left as it is.
            headers += should_retry(Retry.NEVER)
        reason = _redacted_text(response.reason, exchange.needles) or ""
        reply = Reply(response.status, headers, body, entry.invocation_id, reason=reason, framed=True)
        reply.delivered = lambda: self._delivered(entry)
        reply.undelivered = lambda left: self._undelivered(entry, left)
        return reply

    def _delivered(self, entry: InvocationLog) -> None:
        # Whether the answer left is known now (the adapter looked); its record is nobody's wait,
        # so it is made while the journal next waits on the database, not while the agent's next
        # request would wait behind it.
        self.journal.defer(self._record_delivered, entry)

    def _record_delivered(self, entry: InvocationLog) -> None:
        if entry.broken:
            return
        entry.append(EventKind.RESULT_DELIVERED, channel="proxy")
        self._write_behind(entry)

    def _undelivered(self, entry: InvocationLog, left: CallerDisposition) -> None:
        if entry.broken:
            return
        entry.append(EventKind.CALLER_CANCELLED, disposition=left.value)
        entry.append(EventKind.FAILED, phase=Phase.RESULT_DELIVERY, code=Code.CALLER_CANCELLED)
        self._write_behind(entry)

    def _write_behind(self, entry: InvocationLog) -> None:
        """What became of the delivery, written without anyone waiting; a failed write is sent
        again in the background (:meth:`_resend_in_background`)."""
        def landed(future: asyncio.Future[None]) -> None:
            if future.cancelled() or future.exception() is None or isinstance(future.exception(), LeaseLost):
                return  # done; or another broker closed the record, which then says what it knows
            self._resend_in_background(entry, "what became of its delivery")

        entry.submit(lazy=True).add_done_callback(landed)

    def _resend_in_background(self, entry: InvocationLog, what: str) -> None:
        """Send ``entry``'s writes the journal refused (``what`` they record) again until they land.

        No later write of the invocation would resend them, and while this broker beats no other
        broker's recovery closes its records: given up on, the record would say the request is in
        flight (a keyed repeat: IDEMPOTENCY_IN_PROGRESS) until a restart."""
        self._in_background(self._resend_behind(entry, what))

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work``, which writes a record until the journal takes it, until it is done or this
        broker stops (then recovery at the next start closes the record)."""
        if self._closing:
            work.close()
            return
        task = asyncio.create_task(work)
        self._behind.add(task)
        task.add_done_callback(self._behind.discard)

    async def _resend_behind(self, entry: InvocationLog, what: str) -> None:
        pause, patience = 1.0, time.monotonic() + self.settings.upstream.result_horizon
        while True:
            await asyncio.sleep(pause)
            try:
                await entry.resubmit()
            except LeaseLost:
                return  # another broker closed the record meanwhile: it says what that broker knew
            except JournalUnavailable:
                if time.monotonic() > patience:
                    patience = math.inf
                    log.warning("invocation %s: %s is still not recorded (the journal does not take the write); the "
                                "record says the request is in flight until it is. The broker keeps trying while it "
                                "runs; if it stops first, recovery closes the record at the next start",
                                entry.invocation_id, what)
                pause = min(pause * 2, 30.0)  # alone in its batch: a write that keeps failing fails nothing else
                continue
            if patience == math.inf:
                log.warning("invocation %s: %s is recorded after all", entry.invocation_id, what)
            return

    # -- refusals and envelopes -------------------------------------------------------------

    async def _refuse(
        self, entry: InvocationLog, phase: Phase, code: Code, message: str, diagnostic: str | None = None
    ) -> Reply:
        entry.append(EventKind.FAILED, phase=phase, code=code, answered=True, diagnostic=diagnostic)
        try:
            await entry.commit()
        except JournalUnavailable as exc:
            return self._journal_unavailable(entry, unwritten=exc.unwritten)
        except LeaseLost:
            return self._lease_lost(entry)
        retry = entry.retry_for(entry.record) or Retry.AFTER_CORRECTION  # a re-attempt's: its retention and budget count
        # This attempt sent nothing; a re-send's invocation was sent before, and stays unknown.
        return self._envelope_reply(entry, code, phase, entry.record.outcome, retry, message)

    def _lease_lost(self, entry: InvocationLog, *, refused_dispatch: bool = False) -> Reply:
        """A stale re-send was fenced before dispatch; another broker owns the invocation now.

        Nothing can be written to the record by this broker (the fence refuses it), and nothing
        was sent; what is known about the effect is what the record said before this attempt.
        ``refused_dispatch``: the write the fence refused was this attempt's DISPATCH_STARTED,
        which the in-memory record counts but proves nothing; only earlier dispatches do.
        """
        earlier = entry.record.dispatch_count - (1 if refused_dispatch else 0)
        outcome = Outcome.UNKNOWN if earlier > 0 else Outcome.NOT_ATTEMPTED
        body = envelope(
            entry.invocation_id,
            Code.LEASE_LOST,
            Phase.VALIDATION,
            outcome,
            Retry.BACKOFF,
            "This broker's lease on the invocation ran out, or another broker took the invocation over (this one "
            "was silent too long), before it could dispatch, so it sent nothing; another attempt may be running "
            "elsewhere. Ask GET /v1/invocations/{id} before trying again.",
            {"dispatch_started": earlier > 0},  # of the invocation, as its outcome: this attempt sent nothing
        )
        headers = [("Content-Type", MEDIA_TYPE), (INVOCATION_HEADER, entry.invocation_id), (CODE_HEADER, Code.LEASE_LOST.value),
                   (OUTCOME_HEADER, outcome.value), *should_retry(Retry.BACKOFF)]
        return Reply(status_for(Code.LEASE_LOST), headers, encode(body), entry.invocation_id)

    def _journal_unavailable(self, entry: InvocationLog | None = None, message: str | None = None, *,
                             unwritten: bool = False) -> Reply:
        """Nothing was sent because the journal refused a write. ``entry``: the invocation, if
        part of its record is already durable (a bound key): the answer names it, and the broker
        ends that record once the journal takes writes again. ``unwritten``: the refused write
        (and any earlier one of the invocation that failed) is known not written; otherwise it
        may have landed unconfirmed, and the answer says what follows if it did."""
        invocation_id = entry.invocation_id if entry is not None and entry.durable else None
        if entry is not None:  # even a failed commit may have landed: look once the journal answers
            self._in_background(self._close_when_journal_returns(entry))
        maybe_landed = entry is not None and not unwritten
        # This attempt's DISPATCH_STARTED was the write refused.
        refused_dispatch = entry is not None and entry.record.stage is Stage.DISPATCHED
        unconfirmed = refused_dispatch and maybe_landed
        # A re-send's earlier attempts were dispatched: this one sent nothing, but the invocation
        # stays unknown (as with _lease_lost: only earlier dispatches count, never the refused one).
        earlier = entry.record.dispatch_count - (1 if refused_dispatch else 0) if entry is not None else 0
        outcome = Outcome.UNKNOWN if earlier > 0 and invocation_id is not None else Outcome.NOT_ATTEMPTED
        # A stop closes the journal last, and it then refuses what comes after: no database trouble.
        closed = self.journal.closing
        cannot, check = (("The broker is stopping (a restart or a scale-down) and its journal takes no more writes", "")
                         if closed else ("The broker cannot write its journal", "; operators: check the database"))
        if closed and message is None:
            log.info("a request reached its journal write after the stop had closed the journal: 503 %s, nothing sent",
                     Code.JOURNAL_UNAVAILABLE.value)
        if message is None and outcome is Outcome.UNKNOWN:
            message = (f"{cannot}, so this attempt sent nothing (it never forwards without a "
                       f"durable record). An earlier attempt of invocation {invocation_id} was sent, so its outcome "
                       "stays unknown. Retry after a delay with the same key (GET /v1/invocations/{id} says what a "
                       f"repeat may do){check}.")
        elif message is None and invocation_id is None:
            if unconfirmed and entry is not None:
                landed = (f", unless its write reached the database unconfirmed: then invocation {entry.invocation_id} "
                          "is closed as unknown once the database answers (nothing was sent, but its record cannot "
                          "prove it; an operator reconciles it)")
            elif maybe_landed and entry is not None:
                landed = (f", unless its write reached the database unconfirmed: then invocation {entry.invocation_id} "
                          "is closed as not attempted once the database answers")
            else:
                landed = ""
            message = (f"{cannot}, so it sent nothing (it never forwards without a durable "
                       f"record). No invocation was recorded{landed}. Retry after a delay{check}.")
        elif message is None:
            message = (f"{cannot}, so it sent nothing (it never forwards without a durable "
                       f"record). Invocation {invocation_id} stays open until the database answers, then it is "
                       "closed as not attempted" + (
                           ", or as unknown if its DISPATCH_STARTED reached the database unconfirmed (nothing was "
                           "sent, but the record cannot prove it: its retry hint then says what a repeat may do, "
                           "GET /v1/invocations/{id})" if unconfirmed else "") +
                       f". Retry after a delay with the same key{check}.")
        body = envelope(invocation_id, Code.JOURNAL_UNAVAILABLE, Phase.VALIDATION, outcome, Retry.BACKOFF,
                        message, {"dispatch_started": outcome is Outcome.UNKNOWN})
        headers = [("Content-Type", MEDIA_TYPE), ("Retry-After", "1"), (CODE_HEADER, Code.JOURNAL_UNAVAILABLE.value),
                   (OUTCOME_HEADER, outcome.value), *should_retry(Retry.BACKOFF)]
        if invocation_id is not None:
            headers.append((INVOCATION_HEADER, invocation_id))
        return Reply(503, headers, encode(body), invocation_id)

    def _envelope_reply(
        self,
        entry: InvocationLog,
        code: Code,
        phase: Phase,
        outcome: Outcome,
        retry: Retry,
        message: str,
        *,
        timed_out: bool = False,
    ) -> Reply:
        body = envelope(entry.invocation_id, code, phase, outcome, retry, message, evidence_of(entry, timed_out=timed_out))
        headers = [
            ("Content-Type", MEDIA_TYPE),
            (INVOCATION_HEADER, entry.invocation_id),
            (OUTCOME_HEADER, outcome.value),
            (CODE_HEADER, code.value),
            *should_retry(retry),
        ]
        return Reply(status_for(code, timed_out=timed_out), headers, encode(body), entry.invocation_id)


async def note_replay(journal: Journal, row: dict[str, Any], channel: str) -> None:
    """Count a served replay; if the original delivery had failed, this one is the delivery.

    The disposition of the original wait stays as it was. Both are courtesies: the replay itself
    already succeeded, so a failure here is logged, not raised.
    """
    metrics.REPLAYS.labels(channel).inc()
    journal.replays.add(row["invocation_id"])
    if row["stage"] != Stage.DELIVERY_FAILED.value:
        return
    try:
        _, events = await queries.events_of(journal.engine, row["invocation_id"], journal.decode_payload)
        record = project(events)
        if record.stage is Stage.DELIVERY_FAILED:
            entry = InvocationLog(journal, identity_of(row), row["owner"], record=record, persisted=True,
                                  generation=row["generation"])
            entry.append(EventKind.RESULT_DELIVERED, channel=channel)
            await entry.commit()
    except Exception as exc:
        log.info("could not record a replay of %s: %s", row["invocation_id"], exc)


async def _settled_or_released(
    loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any], caller_gone: Flag, dispatched: Flag, timeout: float
) -> None:
    """Wait until the exchange task ends, the caller is gone, or ``timeout`` has passed since
    ``dispatched`` was set, whichever is first. One wait for all three: the caller's coroutine
    is not woken at dispatch only to wait again."""
    wake = loop.create_future()
    timer: asyncio.TimerHandle | None = None

    def poke(*_: Any) -> None:
        if not wake.done():
            wake.set_result(None)

    def start_the_clock() -> None:
        nonlocal timer
        if not wake.done():
            timer = loop.call_later(timeout, poke)

    task.add_done_callback(poke)
    caller_gone.add_callback(poke)
    dispatched.add_callback(start_the_clock)
    try:
        await wake
    finally:
        task.remove_done_callback(poke)
        if timer is not None:
            timer.cancel()


#: What may not appear anywhere in a header line: a line break or a NUL would split the request
#: written upstream, and any other control character but HTAB (which HTTP/2 can carry, RFC 9113
#: 8.2.1 notwithstanding) be read differently by the upstream than by the broker.
_SPLITTER = re.compile("[\0-\x08\n-\x1f\x7f]")

#: What may not appear in the request target (RFC 9112 3.2, RFC 3986 appendix A): anything but
#: visible ASCII, which an HTTP/2 agent can send in ``:path`` and which, written into the
#: HTTP/1.1 request line upstream, would end the target early (a space), be read differently by
#: each parser (a control byte, bytes that are not ASCII), or cut the path short (``#``, which
#: begins a fragment, never sent). The visible characters RFC 3986 leaves out (``|``, ``{``,
#: ``"``, ...) are let through: common clients send them as they are and servers accept them.
_NOT_IN_A_TARGET = re.compile("[^!-~]|#")

#: What a record's text cannot hold: PostgreSQL takes no NUL, and bytes that are not UTF-8 reach
#: Python as lone surrogates, which no encoder takes. (Other control characters are recorded, and
#: refused as malformed.)
_UNRECORDABLE = re.compile("[\0\ud800-\udfff]")


def unrecordable(req: AgentRequest) -> str | None:
    """Why the request's method, host or target cannot go into a record, or None. Such a request
    is refused before anything is recorded: written into a record, it would fail the journal's
    write, and with it the writes of other requests batched alongside (on PostgreSQL), or the
    broker's own encoding of the record."""
    if _UNRECORDABLE.search(req.method):
        return (f"The request method {shown(req.method)!r} holds a NUL byte or bytes that are not text, so it names "
                "no method a route could allow. Nothing was sent and nothing was recorded. Send the method's "
                "own name.")
    if len(req.method) > MAX_METHOD_LENGTH:
        return (f"The request method {shown(req.method)!r} is {len(req.method)} characters long; the broker records "
                f"methods of at most {MAX_METHOD_LENGTH} (every method HTTP defines is shorter), so no route can allow "
                "it. Nothing was sent and nothing was recorded.")
    for what, text, fix in (("host", req.host, "Send the host's name"), ("target", req.path, "Percent-encode them")):
        if _UNRECORDABLE.search(text):
            return (f"The request {what} {shown(text)!r} holds a NUL byte or bytes that are not text, which may not "
                    f"appear in a request {what}. Nothing was sent and nothing was recorded. {fix}.")
    return None

#: The longest idempotency key stored (the column's width); a longer one is refused, never cut.
MAX_KEY_LENGTH = 255


#: A method is a token (RFC 9110 9.1, 5.6.2): ASCII only, so no Unicode case mapping ('PO\u017fT'
#: upper-cases to 'POST') can make another method of it.
_METHOD = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def malformed_request(req: AgentRequest, idempotency_header: str, contract_header: str | None = None) -> str | None:
    """Why the request cannot be checked against the routes or sent as it is, or None.

    * A line break or NUL in a header, or in the request target anything but visible ASCII
      (``#`` included), would split or change the request written upstream.
    * A ``.`` or ``..`` path segment (also percent-encoded, once or more, in another form a
      server reads as a dot, behind an encoded slash or backslash, with parameters ``..;x``, an
      encoded NUL or trailing spaces after it: :func:`proxy.routing.hides_a_dot_segment`) is
      resolved by many upstreams (RFC 3986 section 5.2.4) to a path the route's ``path`` glob
      never saw: ``/allowed/../admin`` would carry the route's credential to ``/admin``.
    * An idempotency key must be one visible-ASCII value (a structured-field string): a second,
      different key (in ``idempotency_header`` or the route's ``contract_header``), or bytes that
      are not text, would bind the operation to something the agent did not mean.
    """
    if not _METHOD.fullmatch(req.method):
        return (f"The request method {shown(req.method)!r} is not an HTTP token (letters, digits and "
                "!#$%&'*+-.^_`|~ only; RFC 9110 9.1), so it names no method a route could allow: read as the method "
                "it resembles, it would be sent as one the agent did not write. Nothing was sent and no secret was "
                "touched. Send the method's own name.")
    if _SPLITTER.search("".join([name + value for name, value in req.headers])):
        for name, value in req.headers:
            if _SPLITTER.search(name + value):
                folded = " (here a continuation line: HTTP/1's obsolete line folding)" if "\r\n " in value else ""
                return (f"The request header {shown(name)!r} holds a control character{folded or ' (a line break, a NUL byte, ...)'}, "
                        "which would split the request sent upstream or be read differently there. "
                        "Nothing was sent and no secret was touched. Send each header on one line, as text.")
    if not req.path.startswith("/"):
        return (f"The request target {shown(req.path)!r} is not a path beginning with '/' (origin-form, RFC 9112 "
                "3.2.1; an HTTP/2 ':path' must be one too, RFC 9113 8.3.1, and the asterisk-form of 'OPTIONS *' is "
                "not relayed), so no route's path can be checked against it. Nothing was sent and no secret was "
                "touched. Send the path, '/' at least.")
    if found := _NOT_IN_A_TARGET.search(req.path):
        return (f"The request target {shown(req.path)!r} holds {ascii(found.group())}, which may not appear "
                "unencoded in a request target (only visible ASCII may, and '#' begins a fragment, never sent). "
                "Nothing was sent and no secret was touched. Percent-encode it.")
    path = req.path.split("?", 1)[0]
    low = path.lower()
    if "%2525" in low or ("%" in path and _decodes_further(path)):
        return (f"The request path {shown(path)!r} is percent-encoded three times or more over ('%2525'), which "
                "upstreams read in as many ways as they decode it. Nothing was sent and no secret was touched. "
                "Encode the path once.")
    # Only a path with a dot at a segment's start, a dot after a backslash, or any percent sign
    # can hold a dot-segment: the common path is not taken apart. Any '%', not only escapes that
    # already spell a dot, slash or percent sign: the escapes themselves may be escaped
    # ('%%32%65' and '%2%65' are '%2e' after one decoding, '.' after two).
    if path.startswith(".") or "/." in path or "\\." in path or "%" in path:
        for segment in path.split("/"):
            if hides_a_dot_segment(segment):
                return (f"The request path {shown(path)!r} has a '.' or '..' segment (perhaps percent-encoded, in "
                        "another form a server reads as a dot, with ';' parameters or trailing spaces), which the "
                        "upstream may resolve to a path no route allows. Nothing was sent and no secret was "
                        "touched. Send the path with those segments resolved.")
    if (transfer := req.values_of("transfer-encoding")) and codings_of(", ".join(transfer)) != ["chunked"]:
        return (f"The request's Transfer-Encoding is {', '.join(transfer)!r}: the broker undoes chunked only, and would "
                "send the body still coded but described as plain. Nothing was sent and no secret was touched. Send "
                "the body chunked or with a Content-Length, compressed (if at all) under Content-Encoding.")
    hop_only = connection_options(req.headers)
    for header in (idempotency_header, contract_header):
        if header is not None and header.lower() in hop_only:
            return (f"The request's Connection header names {header}, the header of its idempotency key, as an option "
                    "of the agent's hop only, which a proxy removes: taken so, the key would be dropped and the "
                    "request sent as a new operation each time. Nothing was sent. Send the key without naming it in "
                    "Connection.")
    keys = req.values_of(idempotency_header) or []
    if len(set(k.strip() for k in keys)) > 1:
        return (f"The request has {len(keys)} different {idempotency_header} headers. Nothing was sent. Send one key: "
                "it names one operation.")
    if contract_header is not None and (theirs := req.values_of(contract_header)):
        if len(set(k.strip() for k in [*keys, *theirs])) > 1:
            named = f"{idempotency_header} and {contract_header}" if keys else f"{len(theirs)} {contract_header}"
            return (f"The request has different idempotency keys in {named} headers. Nothing was sent. Send one "
                    f"key (in either header, or the same in both): it names one operation.")
        idempotency_header, keys = (idempotency_header, keys) if keys else (contract_header, theirs)
    key = keys[0].strip() if keys else None
    if key is not None and not all(" " <= c <= "~" for c in key):
        return (f"The {idempotency_header} header holds characters other than visible ASCII (or bytes that are not "
                "text). Nothing was sent. Use a key of letters, digits and punctuation, such as a UUID.")
    if key == "":
        return (f"The {idempotency_header} header is empty. Nothing was sent. Send a key that names the operation "
                "(a UUID, say), or no header at all.")
    if key is not None and len(key) > MAX_KEY_LENGTH:
        # Cut to the length stored, two different keys would name one operation: the second would
        # be answered with the first one's result as if it were its own.
        return (f"The {idempotency_header} header is {len(key)} characters long; the broker keeps keys of at most "
                f"{MAX_KEY_LENGTH}. Nothing was sent. Use a shorter key (a UUID is 36).")
    return None


def _decodes_further(path: str) -> bool:
    """Whether ``path`` still holds an escape after every decoding the broker reads it through
    (:func:`proxy.routing.fully_decoded`): encoded more deeply than the broker looks, whether
    as ``%2525...`` or with its escapes' own characters escaped (``%%32%35`` is ``%25``)."""
    decoded = fully_decoded(path)
    return "%" in decoded and unquote(decoded, errors="surrogateescape") != decoded


def shown(text: str, limit: int = 200) -> str:
    r"""``text`` for a message: control characters and anything beyond ASCII escaped (as Python
    writes them: ``\n``, ``\x00``, ``\u20ac``), long values cut."""
    shown = _ASCII_CONTROL.sub(lambda m: repr(m[0])[1:-1], text.encode("ascii", "backslashreplace").decode("ascii"))
    return shown if len(shown) <= limit else shown[:limit] + "..."


_ASCII_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _asks_for_websocket(req: AgentRequest) -> bool:
    """An HTTP/1.1 WebSocket opening handshake (RFC 6455 4.1). Other upgrade offers (``h2c``,
    say) are dropped with the other hop-by-hop fields and the request goes on as HTTP/1.1; a
    WebSocket handshake without its ``Upgrade`` would reach the service as a plain GET."""
    return "websocket" in list_tokens(req.headers, "upgrade")


#: Headers with which a client asks a server to perform another method than the request's own
#: (Google's APIs, Express's and Rails' method-override middleware, and others honour them).
METHOD_OVERRIDE_HEADERS = ("x-http-method-override", "x-http-method", "x-method-override")
PATH_OVERRIDE_HEADERS = ("x-original-url", "x-rewrite-url", "x-override-url")


def _override(req: AgentRequest, route: str) -> str | None:
    """The refusal (its message) of the first header that asks the service
    for another method or another path than the request's own: the broker routes, records and
    judges retries by the request's, and cannot know whether the service acts on the header.
    Naming the request's own (a method in any case; the path and query as sent) is harmless; an
    empty value asks for nothing."""
    method = req.method.upper()
    for name, value in req.headers:
        lower, asked = name.lower(), value.strip()
        if not asked:
            continue
        if lower in METHOD_OVERRIDE_HEADERS and asked.upper() != method:
            return (f"The request is a {method}, but its {name} header asks the service for {asked!r}. Many services "
                    f"honour that header and perform the other method, which route '{route}' was not checked against "
                    "and which the record would misstate (its method, and whether a repeat is safe). Nothing was "
                    "sent. Send the request with the method it means, and without the header.")
        if lower in PATH_OVERRIDE_HEADERS and asked != req.path:
            return (f"The request is for {shown(req.path)!r}, but its {name} header asks the service for "
                    f"{shown(asked)!r}. Some servers (IIS URL Rewrite, frameworks behind it) serve that path instead, "
                    f"which route '{route}' was not checked against and which the record would misstate. Nothing was "
                    "sent. Request the path you mean, without the header.")
    if method == "POST" and (asked := _method_field(req)) is not None and asked.strip().upper() not in ("", "POST"):
        return (f"The request is a POST, but its {METHOD_FIELD} field asks the service for {shown(asked)!r}. Rails, "
                "Laravel, Symfony and Express's method-override honour that field in a POST and perform the other "
                f"method, which route '{route}' was not checked against and which the record would misstate. Nothing "
                f"was sent. Send the request with the method it means, and without the {METHOD_FIELD} field.")
    return None


#: The form field (also a query parameter, or a JSON body's member, for Laravel) through which
#: frameworks let a POST stand for another method.
METHOD_FIELD = "_method"
_MULTIPART_METHOD = re.compile(
    rb'content-disposition:[^\r\n]*\bname="?_method"?(?:[;\s][^\r\n]*)?\r\n(?:[^\r\n]+\r\n)*\r\n([^\r\n]*)', re.IGNORECASE)

#: A JSON string "_method", any of its characters perhaps written as a \\u escape.
_JSON_METHOD_NAME = re.compile(
    b'"' + b"".join(b"(?:%s|\\\\u00%x)" % (re.escape(bytes([c])), c) for c in b"_method") + b'"', re.IGNORECASE)


def _method_field(req: AgentRequest) -> str | None:
    """The value of a ``_method`` field the POST carries: in its query, or in its body read as a
    form, multipart form or JSON object (by the body's own shape, whatever its Content-Type says:
    frameworks differ in which they trust). None without one; looked for only where the name is."""
    _, _, query = req.path.partition("?")
    if "method" in query:  # '%5Fmethod' too: frameworks decode a name before they look it up
        for name, value in parse_qsl(query, keep_blank_values=True):
            if name == METHOD_FIELD:
                return value
    body = req.body
    named = b"method" in body
    if named and (found := _MULTIPART_METHOD.search(body)) is not None:
        return found.group(1).decode("latin-1")
    if (named or b"\\u" in body) and _JSON_METHOD_NAME.search(body) is not None:
        try:  # parsed only when a member may be named so: most JSON bodies are not
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            value = parsed.get(METHOD_FIELD)
            return value if isinstance(value, str) else None
    if named:
        for name, value in parse_qsl(body.decode("latin-1"), keep_blank_values=True):
            if name == METHOD_FIELD:
                return value
    return None


def unrecorded_refusal(status: int, code: Code, message: str, extra_headers: list[tuple[str, str]] | None = None, *,
                       retry: Retry = Retry.AFTER_CORRECTION, evidence: dict[str, Any] | None = None) -> Reply:
    """A refusal before anything is recorded (``invocation_id`` null): validation, not attempted."""
    body = envelope(None, code, Phase.VALIDATION, Outcome.NOT_ATTEMPTED, retry, message, evidence)
    headers = [("Content-Type", MEDIA_TYPE), (CODE_HEADER, code.value), (OUTCOME_HEADER, Outcome.NOT_ATTEMPTED.value),
               *should_retry(retry), *(extra_headers or [])]
    return Reply(status, headers, encode(body))


def internal_error(message: str) -> Reply:
    """The answer to a bug: HTTP 500, ``REMOTE_OUTCOME_UNKNOWN``, ``retry: reconcile``, naming no
    record and with no ``Affidavit-*`` header (it vouches for nothing). ``message`` says what the
    broker does know, such as that this request sent nothing."""
    body = envelope(None, Code.REMOTE_OUTCOME_UNKNOWN, Phase.REMOTE_EXECUTION, Outcome.UNKNOWN, Retry.RECONCILE, message)
    return Reply(500, [("Content-Type", MEDIA_TYPE), *should_retry(Retry.RECONCILE)], encode(body))


def should_retry(retry: Retry) -> list[tuple[str, str]]:
    """``x-should-retry``: SDKs that retry on their own (OpenAI's and Anthropic's, among others)
    obey it. Only ``backoff`` lets a client's blind retry loop repeat the request; anything else
    needs the record (same key, a fetch, reconciliation), which such a loop cannot do."""
    return [("x-should-retry", "true" if retry is Retry.BACKOFF else "false")]


def evidence_of(entry: InvocationLog, *, timed_out: bool = False) -> dict[str, Any]:
    return evidence_from(entry.record, entry.identity, timed_out=timed_out)


def evidence_from(record: Record | None, identity: Identity, *, timed_out: bool = False) -> dict[str, Any]:
    """How the broker knows: the envelope's evidence, from the record (none for a refused repeat)."""
    record = record or Record()
    evidence: dict[str, Any] = {
        "dispatch_started": record.dispatch_started,
        "request_complete": record.request_complete,
        "response_headers_received": record.response_headers_received,
        "response_complete": record.response_complete,
        "fingerprint": identity.fingerprint,
        "attempts": [
            {k: v for k, v in {"n": a.number, "stage": a.stage, "connection": a.connection, "code": a.code and a.code.value}.items() if v}
            for a in record.attempts
        ],
    }
    if record.dispatch_seq is not None:
        evidence["dispatch_seq"] = record.dispatch_seq
    if record.status is not None:
        evidence["status"] = record.status
    if timed_out:
        evidence["timeout"] = "response"
    if identity.remote_contract or identity.idempotency_key:
        evidence["idempotency"] = {
            "key": identity.idempotency_key,
            "scope": identity.idempotency_scope,
            "fingerprint": identity.fingerprint,
            "remote_contract": "configured" if identity.remote_contract else "none",
        }
    return evidence


def _provisional_end(entry: InvocationLog, recording: bool) -> tuple[Outcome, Retry]:
    """What the record would say if the exchange ended now without a result (``recording``: the
    complete answer is in hand, only its record is outstanding)."""
    record = entry.record
    if recording:
        # The complete answer is in hand but not yet durable: unknown until it is; then it is fetched.
        return Outcome.UNKNOWN, Retry.FETCH_RESULT
    if record.dispatch_started and not record.ended:
        record = apply(record, Event(EventKind.FAILED, {"phase": Phase.REMOTE_EXECUTION, "code": Code.REMOTE_OUTCOME_UNKNOWN}))
    retry = entry.retry_for(record) or Retry.RECONCILE
    return record.outcome, retry


#: What a failure before dispatch says of trying again, and what it says instead once the attempt
#: used the last of its key's retry budget (a repeat with that key is then refused).
_RETRYING_IS_SAFE = re.compile(r"Retrying (?:later|in a moment) is safe")
_BUDGET_USED = ("This attempt used the last of its Idempotency-Key's retry budget, so a repeat with that key is refused; "
                "once the cause is fixed, send it as a new operation with a new key")
_RETRY_LATER = " Retrying later is safe; if it persists, an operator should check the route's host, port or connect_to."
_STOPPING = ("The broker is stopping (a restart or a scale-down), so it did not send this request. Nothing was sent. "
             "Retrying in a moment is safe (another broker, or this one once it is back, takes it).")
_STOPPED_MID_EXCHANGE = ("The broker is stopping (a restart or a scale-down) and cut this exchange once its dispatch was "
                         "recorded, before the whole response arrived. The effect is unknown: do not blindly re-send; "
                         "follow the retry hint.")
_OUT_OF_FILES = ("The broker has no file descriptor left for a connection to the upstream (too many connections are "
                 "open to it). Nothing was sent. Retrying later is safe; operators: raise the broker's open-files "
                 "limit (LimitNOFILE, ulimit -n) or find who holds so many connections open.")
_CERTIFICATE = " Do not retry until an operator has checked the upstream's certificate, or the broker's trust in its CA ([upstream] ca_bundle)."

_MESSAGES = {
    Code.DNS_FAILED: "The upstream host name did not resolve. Nothing was sent." + _RETRY_LATER,
    Code.CONNECT_REFUSED: "The upstream refused the connection. Nothing was sent." + _RETRY_LATER,
    Code.CONNECT_FAILED: "The upstream could not be reached. Nothing was sent." + _RETRY_LATER,
    Code.CONNECT_TIMEOUT: "The connection to the upstream was not established in time. Nothing was sent." + _RETRY_LATER,
    Code.TLS_HANDSHAKE_FAILED: "The TLS handshake with the upstream failed. Nothing was sent." + _RETRY_LATER,
    Code.TLS_CERT_INVALID: "The upstream's certificate failed verification. Nothing was sent." + _CERTIFICATE,
    Code.TLS_CERT_UNTRUSTED: "The upstream's certificate is not issued by a trusted CA. Nothing was sent." + _CERTIFICATE,
    Code.TLS_CERT_EXPIRED: "The upstream's certificate has expired or is not yet valid. Nothing was sent." + _CERTIFICATE,
    Code.TLS_HOSTNAME_MISMATCH: "The upstream's certificate is not valid for this host name. Nothing was sent." + _CERTIFICATE,
    Code.REMOTE_OUTCOME_UNKNOWN: "No complete response was recorded: the connection ended first, or what came back "
    "was not valid HTTP. The request was sent, so the effect is unknown: do not blindly re-send; follow the retry hint.",
    Code.REMOTE_RESULT_INCOMPLETE: "The response ended before its framing was complete; the partial body is not a "
    "result. The effect is unknown: do not blindly re-send; follow the retry hint.",
    Code.RESULT_TOO_LARGE: "The response body is larger than the broker stores. The effect is unknown.",
    Code.CALLER_CANCELLED: "The caller stopped waiting.",
    Code.APPROVAL_STALE: "The approval does not cover this request any more (its body, target, credential version or "
    "the route's configuration changed). Nothing was sent. Ask for a new approval.",
}


_HEAD_TOO_LARGE = (
    f"The upstream's response head (its status line and header fields) is larger than the broker reads "
    f"({MAX_RESPONSE_HEAD} bytes), so no result was recorded. The request was sent, so the effect is unknown: do not "
    "blindly re-send; follow the retry hint. The same request will likely meet the same answer: ask the upstream's "
    "operators why it sends such headers."
)


def _message(code: Code, outcome: Outcome, message: str | None = None) -> str:
    """The envelope's message for ``code`` (or ``message``), said of a re-send when ``outcome``
    is unknown: this attempt sent nothing, an earlier one was sent."""
    message = message or _MESSAGES.get(code, f"The request ended with {code.value}; the outcome is {outcome.value}.")
    if outcome is Outcome.UNKNOWN and " Nothing was sent." in message:
        # A re-send that failed before its own dispatch: the invocation was sent by an earlier attempt.
        cause = message.split(" Nothing was sent.", 1)[0]
        message = (f"{cause} This attempt sent nothing, but an earlier attempt of this invocation was sent, so the "
                   "effect is unknown: do not blindly re-send; follow the retry hint.")
    return message


T = TypeVar("T")


def _recorded_leaving(entry: InvocationLog) -> CallerDisposition:
    """How the caller left, when no one was waiting for an answer the journal refused: its wait
    ended before, and is recorded."""
    left = entry.record.caller_disposition
    return CallerDisposition.DISCONNECTED if left is CallerDisposition.WAITING else left


class _Unreadable(Exception):
    """A read the broker needs before it may send anything failed. ``why``: ``unreachable`` (the
    database did not answer), ``decrypt`` (the record is under a key this broker does not have),
    ``format`` (a newer broker wrote the record) or ``error`` (the read failed otherwise: a bug, a
    damaged schema; not an outage)."""

    def __init__(self, reason: str, why: str):
        super().__init__(reason)
        self.why = why


WITHHELD_HEADER = "Affidavit-Withheld"
_INLINE_DECODE = 256 * 1024  # bodies above this are decoded in a thread


def _named_codings(codings: list[str]) -> str:
    """The codings as the reason a body was withheld may name them: the ones the broker knows, by
    name; any other is the upstream's own text (an echo of the secret, say) and is not repeated."""
    return ", ".join(c if c in NAMED_CODINGS else "(unknown)" for c in codings) or "(none)"


def _transfer_codings(response: UpstreamResponse) -> list[str]:
    """Transfer codings the parser did not undo, in the order applied: all but a final chunked.
    A chunked before another coding (a close-delimited body, RFC 9112 6.1) is still on the body."""
    codings = codings_of(response.all_of("Transfer-Encoding"))
    return codings[:-1] if codings and codings[-1] == "chunked" else codings


def _inspectable_codings(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """On a route that injects a credential, ask only for codings the broker can look inside:
    ``br`` is dropped from Accept-Encoding (a br answer would be withheld)."""
    out = []
    for k, v in headers:
        if k.lower() == "accept-encoding":
            kept = [part.strip() for part in v.split(",") if part.strip() and part.split(";")[0].strip().lower() != "br"]
            if not kept:
                continue
            v = ", ".join(kept)
        out.append((k, v))
    return out


def _withheld_headers(headers: list[tuple[str, str]], withheld: str | None) -> list[tuple[str, str]]:
    """A withheld body is empty: it has no content coding, and the answer says why it is empty."""
    if withheld is None:
        return headers
    return [(k, v) for k, v in headers if k.lower() != "content-encoding"] + [(WITHHELD_HEADER, withheld)]


def _redact_headers(headers: list[tuple[str, str]], needles: list[bytes]) -> tuple[list[tuple[str, str]], bool]:
    """Echoes of the credential replaced in header values; a header whose *name* holds one is
    dropped (a name cannot carry ``[REDACTED]``: brackets are not allowed in a field name)."""
    changed = False
    out = []
    for k, v in headers:
        if _redacted_text(k, needles) != k:
            changed = True
            continue
        data, hit = redact(v.encode("latin-1", "replace"), needles)
        changed |= hit
        out.append((k, data.decode("latin-1")))
    return out, changed


def _redacted_text(text: str | None, needles: list[bytes]) -> str | None:
    """A piece of the upstream's answer kept outside the body and headers (the reason phrase, a
    ``Location`` or job id in the record) with any echo of the credential replaced."""
    if not text or not needles:
        return text
    # Header text is decoded as latin-1, a job id from JSON as UTF-8: look at the bytes of either.
    for encoding in ("latin-1", "utf-8"):
        try:
            data = text.encode(encoding)
        except UnicodeEncodeError:
            continue
        data, found = redact(data, needles)
        if found:
            text = data.decode(encoding)
    return text


def _passable(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """An upstream's headers minus hop-by-hop ones (those its ``Connection`` names too) and any ``Affidavit-*`` header: only the broker
    speaks for the broker (a remote must not be able to forge an outcome or a replay mark)."""
    return [(k, v) for k, v in end_to_end(headers) if not k.lower().startswith("affidavit-")]


def _length_fields(status: int, framing: str, body: bytes, upstream: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The ``Content-Length`` of an answer to the agent, live or replayed through the proxy.

    A body is sent with its own length. A HEAD's or a 304's Content-Length describes the
    representation it did not send: the upstream's is kept. A 204 has none (RFC 9110 8.6), and an
    HTTP/2 agent refuses the answer if it has one.
    """
    if framing != "none":
        return [("Content-Length", str(len(body)))]
    if status == 204:
        return []
    return [(k, v) for k, v in upstream if k.lower() == "content-length"]


def _json_headers(headers: list[tuple[str, str]]) -> str:
    return json.dumps(headers, separators=(",", ":"))


_JOB_KEYS = ("job_id", "operation_id", "task_id", "id")


def _job_reference(response: UpstreamResponse) -> str | None:
    """For a 202: the id of the accepted job, so the record says what to poll (not "done")."""
    if response.status != 202:
        return None
    try:
        body = json.loads(response.body) if response.body else None
    except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than the parser goes
        return None
    if isinstance(body, dict):
        for key in _JOB_KEYS:
            value = body.get(key)
            if isinstance(value, (str, int)) and len(str(value)) <= 200:
                # JSON may escape a lone surrogate (\ud800), which no text encoding can store.
                return _LONE_SURROGATE.sub("\ufffd", str(value))
    return None


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")

