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
import json
import logging
import time
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any, Callable

from .config import Route, Settings
from .contract import (
    Code,
    EventKind,
    Outcome,
    Phase,
    Retry,
    apply,
    Event,
    is_idempotent,
    retry_hint,
)
from .credentials import (
    CredentialUnavailable,
    Credentials,
    injected_header,
    redact,
    redaction_needles,
)
from .envelope import MEDIA_TYPE, encode, envelope, status_for
from .fingerprint import body_sha256, fingerprint, normalized_target
from .invocation_log import Identity, InvocationLog, new_invocation_id, utcnow
from .routing import Refusal, match_route
from .store.journal import Journal, JournalUnavailable
from .upstream import (
    HOP_BY_HOP,
    DispatchRefused,
    ExchangeFailed,
    SetupFailed,
    Upstream,
    UpstreamRequest,
    UpstreamResponse,
)

log = logging.getLogger("affidavit.broker")

INVOCATION_HEADER = "Affidavit-Invocation-Id"
OUTCOME_HEADER = "Affidavit-Outcome"
CODE_HEADER = "Affidavit-Code"

#: Response headers never stored with a result (they may carry session secrets).
_UNSTORED_HEADERS = frozenset({"set-cookie", "set-cookie2", "authorization", "proxy-authorization"})


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
    #: Set by the adapter when the agent's connection goes away.
    caller_gone: asyncio.Event = field(default_factory=asyncio.Event)

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)


@dataclass(slots=True)
class Reply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    invocation_id: str | None = None
    reason: str = ""
    #: Called by the adapter once the reply was handed to the caller's connection.
    delivered: Callable[[], None] | None = None
    #: Called by the adapter when the caller was gone before the reply could be handed over.
    undelivered: Callable[[], None] | None = None


@dataclass(slots=True)
class _Settled:
    """How an exchange ended, before deciding what the caller is told."""

    response: UpstreamResponse | None = None
    setup: SetupFailed | None = None
    failure: ExchangeFailed | None = None
    refused: DispatchRefused | None = None
    store_failed: bool = False
    attempt: int = 1


class _Exchange:
    """One upstream exchange for one invocation: the observer aiohttp's trace signals call."""

    def __init__(self, broker: "Broker", entry: InvocationLog, request: UpstreamRequest, needles: list[bytes]):
        self.broker = broker
        self.entry = entry
        self.request = request
        self.needles = needles
        self.dispatched = asyncio.Event()
        self.caller_left = False
        self.connection: str | None = None
        self.attempt = entry.record.dispatch_count + 1

    async def dispatch(self, attempt: int, connection: str) -> None:
        if self.caller_left:
            raise DispatchRefused(Code.CALLER_CANCELLED, "the caller left before dispatch")
        self.connection = connection
        self.entry.append(EventKind.DISPATCH_STARTED, attempt=self.attempt, connection=connection)
        try:
            await self.entry.commit()
        except JournalUnavailable as exc:
            raise DispatchRefused(Code.JOURNAL_UNAVAILABLE, str(exc)) from None
        self.dispatched.set()

    def request_sent(self) -> None:
        self.entry.append(EventKind.REQUEST_SENT, attempt=self.attempt)

    def response_started(self, status: int) -> None:
        self.entry.append(EventKind.REMOTE_RESPONSE_STARTED, attempt=self.attempt, status=status)

    async def run(self) -> _Settled:
        try:
            response = await self.broker.upstream.exchange(self.request, self, attempt=self.attempt)
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
            return _Settled(setup=exc, attempt=self.attempt)
        except ExchangeFailed as exc:
            return _Settled(failure=exc, attempt=self.attempt)
        return await self._record_result(response)

    async def _record_result(self, response: UpstreamResponse) -> _Settled:
        """Steps (1)-(3) of contract section 6: the outcome, its hash, the stored result."""
        stored_headers = [(k, v) for k, v in response.headers if k.lower() not in _UNSTORED_HEADERS]
        stored_body, redacted = redact(response.body, self.needles)
        stored_headers, headers_redacted = _redact_headers(stored_headers, self.needles)
        self.entry.append(
            EventKind.REMOTE_RESPONSE_COMPLETE,
            attempt=self.attempt,
            status=response.status,
            framing=response.framing,
            body_sha256=response.body_sha256,
            body_bytes=len(response.body),
            peer_certificate=response.peer_certificate_sha256,
            retry_after=_retry_after(response),
            location=response.header("Location"),
            job_ref=_job_reference(response),
            http_version=response.http_version,
        )
        self.entry.append(
            EventKind.RESULT_COMMITTED,
            result_id=self.entry.invocation_id,
            stored_body_sha256=body_sha256(stored_body),
            redacted=(redacted or headers_redacted) or None,
        )
        row = {
            "invocation_id": self.entry.invocation_id,
            "stored_at": utcnow(),
            "status": response.status,
            "headers": _json_headers(stored_headers),
            "body": stored_body,
            "body_sha256": response.body_sha256,
            "framing": response.framing,
            "key_id": None,
        }
        try:
            await self.entry.commit(result=row)
        except JournalUnavailable:
            return _Settled(response=response, store_failed=True, attempt=self.attempt)
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
        for route in settings.routes:
            if route.connect_to:
                host, _, port = route.connect_to.rpartition(":")
                if not route.host.startswith("*."):
                    upstream.pin(route.host, route.port, (host.strip("[]"), int(port)))

    async def close(self) -> None:
        """Wait (bounded) for exchanges still recording late results."""
        if self._background:
            await asyncio.wait(self._background, timeout=5)

    # -- the request path -------------------------------------------------------------------

    async def handle(self, req: AgentRequest) -> Reply:
        matched = match_route(self.settings.routes, req.agent, req.scheme, req.host, req.port, req.method, req.path)
        route = matched if not isinstance(matched, Refusal) else None
        target = normalized_target(req.scheme, req.host, req.port, req.path)
        identity = Identity(
            invocation_id=new_invocation_id(),
            agent=req.agent,
            route=route.name if route else None,
            method=req.method.upper(),
            target=target,
            fingerprint=fingerprint(req.method, target, req.body, req.headers),
            idempotent=is_idempotent(req.method, route.idempotent if route else None),
            remote_contract=bool(route and route.idempotency),
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
        if isinstance(matched, Refusal):
            return await self._refuse(entry, Phase.VALIDATION, matched.code, matched.message)
        route = matched
        limit = int(route.max_body if route.max_body is not None else self.settings.proxy.max_body)
        if len(req.body) > limit:
            return await self._refuse(
                entry,
                Phase.VALIDATION,
                Code.PAYLOAD_LIMIT,
                f"The request body is {len(req.body)} bytes; route '{route.name}' accepts at most {limit}. "
                "Nothing was sent.",
            )
        if route.inject is not None and req.header(route.inject.target_header) is not None:
            return await self._refuse(
                entry,
                Phase.VALIDATION,
                Code.FORBIDDEN_HEADER_OVERRIDE,
                f"The request sets {route.inject.target_header}, which the broker injects for route "
                f"'{route.name}'. Remove it; nothing was sent.",
            )
        entry.append(EventKind.PREFLIGHT_VALIDATED, route=route.name)
        entry.submit_quietly()

        headers = [(k, v) for k, v in req.headers if k.lower() not in HOP_BY_HOP]
        needles: list[bytes] = []
        if route.credential is not None and route.inject is not None:
            try:
                credential = self.credentials.get(route.credential)
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
            headers.append((name, value))
            needles = redaction_needles(credential, value)
            entry.credential = (credential.id, credential.version, route.inject.method)
            entry.append(
                EventKind.CREDENTIAL_AUTHORIZED,
                credential_id=credential.id,
                credential_version=credential.version,
                injection=route.inject.method,
            )
        else:
            entry.append(EventKind.CREDENTIAL_AUTHORIZED, credential_id=None, injection="none")

        request = UpstreamRequest(
            method=identity.method,
            url=f"{req.scheme}://{_authority(req.host, req.port, req.scheme)}{req.path or '/'}",
            headers=headers,
            body=req.body,
            connect_timeout=route.connect_timeout or self.settings.upstream.connect_timeout,
            max_response_body=int(self.settings.upstream.max_response_body),
        )
        exchange = _Exchange(self, entry, request, needles)
        return await self._run(entry, exchange, req, route)

    def _horizon(self, route: Route) -> float:
        return route.result_horizon or self.settings.upstream.result_horizon

    async def _run(self, entry: InvocationLog, exchange: _Exchange, req: AgentRequest, route: Route) -> Reply:
        started = time.monotonic()
        task = asyncio.create_task(exchange.run(), name=f"exchange {entry.invocation_id}")
        gone = asyncio.create_task(req.caller_gone.wait())
        try:
            # Until dispatch, connection setup is bounded by its own timeouts.
            dispatched = asyncio.create_task(exchange.dispatched.wait())
            done, _ = await asyncio.wait({task, gone, dispatched}, return_when=asyncio.FIRST_COMPLETED)
            dispatched.cancel()
            if task not in done and gone not in done:
                timeout = route.response_timeout or self.settings.upstream.response_timeout
                done, _ = await asyncio.wait({task, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return await self._answer(exchange, task.result())
            disposition = "disconnected" if gone in done else "timed_out"
        finally:
            gone.cancel()
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
        entry.append(EventKind.CALLER_CANCELLED, disposition=disposition)
        horizon = horizon - (time.monotonic() - started)
        background = asyncio.create_task(self._finish_unanswered(entry, task, max(horizon, 0.1)))
        self._background.add(background)
        background.add_done_callback(self._background.discard)
        if disposition != "timed_out":
            entry.submit_quietly()
            return Reply(499, [], b"", entry.invocation_id)
        try:
            await entry.commit()
        except JournalUnavailable:
            pass
        provisional = _provisional_end(entry)
        return self._envelope_reply(
            entry,
            Code.REMOTE_OUTCOME_UNKNOWN,
            Phase.REMOTE_EXECUTION,
            provisional[0],
            provisional[1],
            "No complete response arrived within the response timeout. The request was sent, so the "
            "effect is unknown. The broker keeps listening; ask GET /v1/invocations/{id} before any retry.",
            timed_out=True,
        )

    async def _finish_unanswered(self, entry: InvocationLog, task: asyncio.Task[_Settled], horizon: float) -> None:
        try:
            settled = await asyncio.wait_for(asyncio.shield(task), horizon)
        except asyncio.TimeoutError:
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
        except Exception:  # pragma: no cover - the exchange task itself never raises
            log.exception("exchange %s crashed", entry.invocation_id)
            return
        self._end(entry, settled, answered=False)
        try:
            await entry.commit()
        except Exception as exc:
            log.warning("could not record the end of %s: %s", entry.invocation_id, exc)

    def _end(self, entry: InvocationLog, settled: _Settled, *, answered: bool) -> None:
        """Append the event that ends the record, given how the exchange settled."""
        answered_flag = answered or None
        if settled.refused is not None:
            phase = Phase.VALIDATION
            entry.append(EventKind.FAILED, phase=phase, code=settled.refused.code, answered=answered_flag)
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
            entry.append(EventKind.FAILED, phase=Phase.RESULT_DELIVERY, code=Code.RESULT_STORE_FAILED, answered=answered_flag)
        elif not answered:
            entry.append(EventKind.FAILED, phase=Phase.RESULT_DELIVERY, code=Code.CALLER_CANCELLED)

    async def _answer(self, exchange: _Exchange, settled: _Settled) -> Reply:
        entry = exchange.entry
        if settled.response is not None and not settled.store_failed:
            return self._result_reply(exchange, settled.response)
        if settled.refused is not None and settled.refused.code is Code.JOURNAL_UNAVAILABLE:
            return self._journal_unavailable()
        self._end(entry, settled, answered=True)
        try:
            await entry.commit()
        except JournalUnavailable:
            if not entry.record.dispatch_started:
                return self._journal_unavailable()
        if settled.response is not None:  # complete, but the result could not be stored
            return self._result_reply(exchange, settled.response, code=Code.RESULT_STORE_FAILED)
        record = entry.record
        code = record.code or Code.REMOTE_OUTCOME_UNKNOWN
        retry = retry_hint(record, entry.identity.operation) or Retry.BACKOFF
        return self._envelope_reply(entry, code, record.phase, record.outcome, retry, _message(code, record.outcome))

    def _result_reply(self, exchange: _Exchange, response: UpstreamResponse, code: Code | None = None) -> Reply:
        """The upstream's response, unchanged but for hop-by-hop headers, framing and any echo
        of the injected credential (the agent must never see it)."""
        entry = exchange.entry
        body, _ = redact(response.body, exchange.needles)
        headers, _ = _redact_headers(
            [(k, v) for k, v in response.headers if k.lower() not in HOP_BY_HOP], exchange.needles
        )
        if response.framing != "none":
            headers.append(("Content-Length", str(len(body))))
        else:
            headers.extend((k, v) for k, v in response.headers if k.lower() == "content-length")
        headers.append((INVOCATION_HEADER, entry.invocation_id))
        headers.append((OUTCOME_HEADER, entry.record.outcome.value))
        if code is not None:
            headers.append((CODE_HEADER, code.value))
        reply = Reply(response.status, headers, body, entry.invocation_id, reason=response.reason)
        if code is None:
            reply.delivered = lambda: self._delivered(entry)
            reply.undelivered = lambda: self._undelivered(entry)
        return reply

    def _delivered(self, entry: InvocationLog) -> None:
        if entry.broken:
            return
        entry.append(EventKind.RESULT_DELIVERED, channel="proxy")
        entry.submit_quietly()

    def _undelivered(self, entry: InvocationLog) -> None:
        if entry.broken:
            return
        entry.append(EventKind.CALLER_CANCELLED, disposition="disconnected")
        entry.append(EventKind.FAILED, phase=Phase.RESULT_DELIVERY, code=Code.CALLER_CANCELLED)
        entry.submit_quietly()

    # -- refusals and envelopes -------------------------------------------------------------

    async def _refuse(
        self, entry: InvocationLog, phase: Phase, code: Code, message: str, diagnostic: str | None = None
    ) -> Reply:
        entry.append(EventKind.FAILED, phase=phase, code=code, answered=True, diagnostic=diagnostic)
        try:
            await entry.commit()
        except JournalUnavailable:
            return self._journal_unavailable()
        retry = retry_hint(entry.record, entry.identity.operation) or Retry.AFTER_CORRECTION
        return self._envelope_reply(entry, code, phase, Outcome.NOT_ATTEMPTED, retry, message)

    def _journal_unavailable(self) -> Reply:
        body = envelope(
            None,
            Code.JOURNAL_UNAVAILABLE,
            Phase.VALIDATION,
            Outcome.NOT_ATTEMPTED,
            Retry.BACKOFF,
            "The broker cannot write its journal, so it sent nothing (it never forwards without a durable "
            "record). No invocation was recorded. Retry after a delay; operators: check the database.",
            {"dispatch_started": False},
        )
        return Reply(503, [("Content-Type", MEDIA_TYPE), ("Retry-After", "1")], encode(body), None)

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
        ]
        return Reply(status_for(code, timed_out=timed_out), headers, encode(body), entry.invocation_id)


def evidence_of(entry: InvocationLog, *, timed_out: bool = False) -> dict[str, Any]:
    record = entry.record
    evidence: dict[str, Any] = {
        "dispatch_started": record.dispatch_started,
        "request_complete": record.request_complete,
        "response_headers_received": record.response_headers_received,
        "response_complete": record.response_complete,
        "fingerprint": entry.identity.fingerprint,
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
    if entry.identity.remote_contract or entry.identity.idempotency_key:
        evidence["idempotency"] = {
            "key": entry.identity.idempotency_key,
            "scope": entry.identity.idempotency_scope,
            "fingerprint": entry.identity.fingerprint,
            "remote_contract": "configured" if entry.identity.remote_contract else "none",
        }
    return evidence


def _provisional_end(entry: InvocationLog) -> tuple[Outcome, Retry]:
    """What the record would say if the exchange ended now without a result."""
    record = entry.record
    if record.dispatch_started and not record.ended:
        record = apply(record, Event(EventKind.FAILED, {"phase": Phase.REMOTE_EXECUTION, "code": Code.REMOTE_OUTCOME_UNKNOWN}))
    retry = retry_hint(record, entry.identity.operation) or Retry.RECONCILE
    return record.outcome, retry


_MESSAGES = {
    Code.DNS_FAILED: "The upstream host name did not resolve. Nothing was sent.",
    Code.CONNECT_REFUSED: "The upstream refused the connection. Nothing was sent.",
    Code.CONNECT_FAILED: "The upstream could not be reached. Nothing was sent.",
    Code.CONNECT_TIMEOUT: "The connection to the upstream was not established in time. Nothing was sent.",
    Code.TLS_HANDSHAKE_FAILED: "The TLS handshake with the upstream failed. Nothing was sent.",
    Code.TLS_CERT_INVALID: "The upstream's certificate failed verification. Nothing was sent.",
    Code.TLS_CERT_UNTRUSTED: "The upstream's certificate is not issued by a trusted CA. Nothing was sent.",
    Code.TLS_CERT_EXPIRED: "The upstream's certificate has expired or is not yet valid. Nothing was sent.",
    Code.TLS_HOSTNAME_MISMATCH: "The upstream's certificate is not valid for this host name. Nothing was sent.",
    Code.REMOTE_OUTCOME_UNKNOWN: "The connection ended before a complete response was recorded. The request was "
    "sent, so the effect is unknown: do not blindly re-send; follow the retry hint.",
    Code.REMOTE_RESULT_INCOMPLETE: "The response ended before its framing was complete; the partial body is not a "
    "result. The effect is unknown: do not blindly re-send; follow the retry hint.",
    Code.RESULT_TOO_LARGE: "The response body is larger than the broker stores. The effect is unknown.",
    Code.CALLER_CANCELLED: "The caller stopped waiting.",
}


def _message(code: Code, outcome: Outcome) -> str:
    return _MESSAGES.get(code, f"The request ended with {code.value}; the outcome is {outcome.value}.")


def _redact_headers(headers: list[tuple[str, str]], needles: list[bytes]) -> tuple[list[tuple[str, str]], bool]:
    changed = False
    out = []
    for k, v in headers:
        data, hit = redact(v.encode("latin-1", "replace"), needles)
        changed |= hit
        out.append((k, data.decode("latin-1")))
    return out, changed


def _json_headers(headers: list[tuple[str, str]]) -> str:
    return json.dumps(headers, separators=(",", ":"))


def _retry_after(response: UpstreamResponse) -> float | None:
    value = response.header("Retry-After")
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max((when - utcnow()).total_seconds(), 0.0)


_JOB_KEYS = ("job_id", "operation_id", "task_id", "id")


def _job_reference(response: UpstreamResponse) -> str | None:
    """For a 202: the id of the accepted job, so the record says what to poll (not "done")."""
    if response.status != 202:
        return None
    try:
        body = json.loads(response.body) if response.body else None
    except ValueError:
        return None
    if isinstance(body, dict):
        for key in _JOB_KEYS:
            value = body.get(key)
            if isinstance(value, (str, int)) and len(str(value)) <= 200:
                return str(value)
    return None


def _authority(host: str, port: int, scheme: str) -> str:
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    default = 443 if scheme == "https" else 80
    return host if port == default else f"{host}:{port}"

