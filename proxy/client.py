"""The agent side of the evidence contract: what an agent framework does after a failed call.

An agent sends its requests through the broker with whatever HTTP library it likes. When an
answer is a broker envelope (``docs/contract.md``) instead of the remote's own response, the agent
must not guess from the status code or the message: it asks the side API what the record proves
and follows ``next_action`` (``docs/retries.md``). This module is that loop, small enough to copy:

* :class:`Envelope`, :class:`Invocation`, :class:`RecordedResult` mirror the wire formats, with
  ``code``, ``phase``, ``outcome``, ``retry`` and ``next_action`` as the contract's own enums;
* :class:`SideAPI` reads ``GET /v1/invocations/{id}`` and ``.../result``;
* :func:`after_failure` turns an envelope or a record into one :class:`What` to do;
* :func:`call_with_recovery` sends with an ``Idempotency-Key`` and recovers, never with a new key.

Decisions branch only on the closed enums, never on ``message`` (text for humans that may change).

Why the standard library for the side API: the package's runtime dependencies have no synchronous
HTTP client (httpx and requests are test dependencies only), and an agent should
not need one to recover. ``http.client`` also never reads ``HTTP(S)_PROXY``; ``urllib.request``
would, and in an agent configured by ``affidavit env`` (everything through the broker) it would
send side API calls to the proxy, which refuses them as ``INVALID_TARGET``.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Callable, Iterable, Literal, Mapping, Protocol
from urllib.parse import quote, unquote, urlsplit

from .contract import CallerDisposition, Code, NextAction, Outcome, Phase, Retry, retry_after_seconds

INVOCATION_HEADER = "Affidavit-Invocation-Id"
OUTCOME_HEADER = "Affidavit-Outcome"
CODE_HEADER = "Affidavit-Code"
REPLAYED_HEADER = "Affidavit-Replayed"
IDEMPOTENCY_KEY_HEADER = "Affidavit-Idempotency-Key"
PROBLEM_JSON = "application/problem+json"

#: Seconds before a retry the broker allows but gives no delay for (``backoff`` without Retry-After).
DEFAULT_BACKOFF = 1.0
#: Seconds between two questions about an invocation that is still in flight.
DEFAULT_POLL = 0.5
#: The longest socket timeout :class:`SideAPI` accepts: a recovery must not hang an agent.
MAX_TIMEOUT = 60.0

Headers = Mapping[str, str] | Iterable[tuple[str, str]]


# -- errors -------------------------------------------------------------------------------------


class AffidavitError(Exception):
    """Base class of everything this module raises."""


class NotAnEnvelope(AffidavitError, ValueError):
    """The body is not a broker envelope (wrong shape, or an enum value this client does not know)."""


class SideAPIError(AffidavitError):
    """The side API answered, but not with what was asked for (401, 5xx, a body that does not parse)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class SideAPIUnavailable(SideAPIError):
    """The side API could not be reached within the timeout. Nothing is known; ask again later.
    ``sent``: the request had been sent whole when the answer failed to come (the broker may act
    on it); False when the connection itself failed."""

    sent: bool = False


class InvocationNotFound(SideAPIError):
    """404: no such invocation, or it belongs to another agent (the API answers both alike)."""


class ResultUnavailable(SideAPIError):
    """409: the invocation has no complete recorded result. ``envelope`` says what is known."""

    def __init__(self, message: str, envelope: Envelope):
        super().__init__(message, 409)
        self.envelope = envelope


class RecoveryStopped(AffidavitError):
    """Automatic recovery must stop here. Carries the last envelope and record, for a human or a log."""

    def __init__(self, message: str, envelope: Envelope | None = None, invocation: Invocation | None = None):
        super().__init__(message)
        self.envelope = envelope
        self.invocation = invocation

    @property
    def invocation_id(self) -> str | None:
        if self.invocation is not None:
            return self.invocation.invocation_id
        return self.envelope.invocation_id if self.envelope is not None else None


class ReconcileRequired(RecoveryStopped):
    """The effect may have happened and a re-send is not safe: find out (remote records, an operator)."""


class CorrectionRequired(RecoveryStopped):
    """Nothing to recover: the request, route, token or credential must change first."""


class AttemptsExhausted(RecoveryStopped):
    """The caller's own ``max_attempts`` (or ``max_wait``) ran out while a retry was still allowed."""


# -- wire formats -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Envelope:
    """A broker-originated failure, as sent to the caller (contract section 10)."""

    invocation_id: str | None
    code: Code
    phase: Phase
    outcome: Outcome
    retry: Retry
    message: str  # for humans; never branch on it
    evidence: Mapping[str, Any] = field(default_factory=dict)
    #: The key the invocation is bound to (the agent's, or the one the broker made for it).
    idempotency_key: str | None = None
    #: Seconds from a ``Retry-After`` header, if the broker sent one.
    retry_after: float | None = None


@dataclass(frozen=True, slots=True)
class Invocation:
    """``GET /v1/invocations/{id}``: what the record proves now. ``next_action`` is the answer."""

    invocation_id: str
    phase: Phase
    outcome: Outcome
    retry: Retry | None  # None while the invocation is still in flight
    code: Code | None
    next_action: NextAction
    caller_disposition: CallerDisposition
    result_available: bool
    idempotency_key: str | None
    idempotency_scope: str | None
    remote_contract: bool
    retry_after: float | None
    route: str | None
    method: str
    target: str
    fingerprint: str
    evidence: Mapping[str, Any]
    raw: Mapping[str, Any]  # the whole answer, events included


@dataclass(frozen=True, slots=True)
class RecordedResult:
    """A complete response: delivered through the proxy, or fetched from the side API."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    source: Literal["proxy", "side_api"] = "proxy"

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    @property
    def invocation_id(self) -> str | None:
        return self.header(INVOCATION_HEADER)

    @property
    def replayed(self) -> bool:
        return self.header(REPLAYED_HEADER) == "true"

    def json(self) -> Any:
        return json.loads(self.body)


def header_pairs(headers: Headers | None) -> list[tuple[str, str]]:
    """Headers of any HTTP library (a mapping, ``.items()``, or pairs) as a list of pairs."""
    if headers is None:
        return []
    items = headers.items() if hasattr(headers, "items") else headers
    return [(str(k), str(v)) for k, v in items]


def _get(headers: list[tuple[str, str]], name: str) -> str | None:
    name = name.lower()
    return next((v for k, v in headers if k.lower() == name), None)


def _load(body: bytes | str | Mapping[str, Any]) -> Any:
    if isinstance(body, Mapping):
        return body
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise NotAnEnvelope(f"not JSON: {exc}") from None


def _enum(kind: type[StrEnum], value: Any, what: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        raise NotAnEnvelope(f"{what}={value!r} is not a known {kind.__name__}") from None


def parse_envelope(body: bytes | str | Mapping[str, Any], headers: Headers | None = None) -> Envelope:
    """Parse an envelope body (and optionally its headers). Raises :class:`NotAnEnvelope`."""
    data = _load(body)
    error = data.get("error") if isinstance(data, Mapping) else None
    if not isinstance(error, Mapping) or "invocation_id" not in data:
        raise NotAnEnvelope("no 'invocation_id' and 'error' members")
    evidence = data.get("evidence")
    evidence = evidence if isinstance(evidence, Mapping) else {}
    idempotency = evidence.get("idempotency")
    idempotency = idempotency if isinstance(idempotency, Mapping) else {}
    pairs = header_pairs(headers)
    return Envelope(
        invocation_id=data["invocation_id"],
        code=_enum(Code, error.get("code"), "code"),
        phase=_enum(Phase, error.get("phase"), "phase"),
        outcome=_enum(Outcome, error.get("outcome"), "outcome"),
        retry=_enum(Retry, error.get("retry"), "retry"),
        message=str(error.get("message", "")),
        evidence=evidence,
        idempotency_key=idempotency.get("key") or _get(pairs, IDEMPOTENCY_KEY_HEADER),
        retry_after=retry_after_seconds(_get(pairs, "Retry-After")),
    )


def envelope_of(headers: Headers, body: bytes) -> Envelope | None:
    """The envelope, if this response is a broker failure; ``None`` if it is the remote's answer.

    A remote may answer ``application/problem+json`` itself, so the shape is not enough: a broker
    envelope about a record also carries ``Affidavit-Code`` equal to its code, and one without a
    record (``PROXY_AUTH_REQUIRED``, ``JOURNAL_UNAVAILABLE``) carries no invocation id at all,
    while every proxied response has ``Affidavit-Invocation-Id``.
    """
    pairs = header_pairs(headers)
    if not (_get(pairs, "Content-Type") or "").lower().startswith(PROBLEM_JSON):
        return None
    try:
        envelope = parse_envelope(body, pairs)
    except NotAnEnvelope:
        return None
    if _get(pairs, CODE_HEADER) == envelope.code.value:
        return envelope
    if envelope.invocation_id is None and _get(pairs, INVOCATION_HEADER) is None:
        return envelope
    return None


def parse_invocation(body: bytes | str | Mapping[str, Any]) -> Invocation:
    """Parse ``GET /v1/invocations/{id}``. Raises :class:`NotAnEnvelope` on an unknown enum value."""
    data = _load(body)
    if not isinstance(data, Mapping) or "invocation_id" not in data:
        raise NotAnEnvelope("not an invocation record")
    evidence = data.get("evidence") or {}
    idempotency = data.get("idempotency") or {}
    retry_after = evidence.get("retry_after")
    return Invocation(
        invocation_id=data["invocation_id"],
        phase=_enum(Phase, data.get("phase"), "phase"),
        outcome=_enum(Outcome, data.get("outcome"), "outcome"),
        retry=_enum(Retry, data["retry"], "retry") if data.get("retry") else None,
        code=_enum(Code, data["code"], "code") if data.get("code") else None,
        next_action=_enum(NextAction, data.get("next_action"), "next_action"),
        caller_disposition=_enum(CallerDisposition, data.get("caller_disposition"), "caller_disposition"),
        result_available=bool(data.get("result_available")),
        idempotency_key=idempotency.get("key"),
        idempotency_scope=idempotency.get("scope"),
        remote_contract=idempotency.get("remote_contract") == "configured",
        retry_after=float(retry_after) if retry_after is not None else None,
        route=data.get("route"),
        method=str(data.get("method", "")),
        target=str(data.get("target", "")),
        fingerprint=str(data.get("fingerprint", "")),
        evidence=evidence,
        raw=data,
    )


# -- the side API -------------------------------------------------------------------------------


class SideAPI:
    """A client of the broker's side API, authenticated with the agent's own token.

    Every socket operation is bounded by ``timeout`` (at most :data:`MAX_TIMEOUT`). It never
    re-executes anything: both calls are reads of the journal.
    """

    def __init__(self, base_url: str, token: str, *, timeout: float = 10.0, ssl_context: ssl.SSLContext | None = None):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the side API URL must be http(s)://host:port, not {base_url!r}")
        if not 0 < timeout <= MAX_TIMEOUT:
            raise ValueError(f"timeout must be in (0, {MAX_TIMEOUT}] seconds")
        if not token:
            raise ValueError("the side API needs the agent's token")
        self.base_url = base_url.rstrip("/")
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._prefix = parts.path.rstrip("/")
        self._token = token
        self.timeout = timeout
        self._ssl = ssl_context

    @classmethod
    def from_proxy_url(cls, base_url: str, proxy_url: str | None = None, **kwargs: Any) -> SideAPI:
        """Take the token from the proxy URL ``affidavit env`` exports (``HTTPS_PROXY``): the side
        API accepts the same agent token as a bearer token."""
        proxy_url = proxy_url if proxy_url is not None else os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
        token = unquote(urlsplit(proxy_url or "").password or "")
        if not token:
            raise ValueError("no agent token in the proxy URL (expected http://AGENT:TOKEN@host:port)")
        return cls(base_url, token, **kwargs)

    def _request(self, path: str, method: str = "GET", body: Any = None) -> tuple[int, list[tuple[str, str]], bytes]:
        if self._https:
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                self._host, self._port, timeout=self.timeout, context=self._ssl
            )
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)
        sent = False
        try:
            headers = {"Authorization": f"Bearer {self._token}", "Accept": "application/json"}
            payload = None
            if body is not None:
                payload = json.dumps(body).encode()
                headers["Content-Type"] = "application/json"
            conn.request(method, self._prefix + path, body=payload, headers=headers)
            sent = True
            response = conn.getresponse()
            return response.status, response.getheaders(), response.read()
        except (OSError, http.client.HTTPException) as exc:
            failed = SideAPIUnavailable(f"side API at {self.base_url} did not answer: {exc.__class__.__name__}")
            failed.sent = sent
            raise failed from exc
        finally:
            conn.close()

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """Any side API call (operators: approvals, reconciliation); returns (status, parsed JSON)."""
        status, _, raw = self._request(path, method, body)
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")

    @staticmethod
    def _path(invocation_id: str) -> str:
        return "/v1/invocations/" + quote(invocation_id, safe="")

    def invocation(self, invocation_id: str) -> Invocation:
        status, headers, body = self._request(self._path(invocation_id))
        if status == 404:
            raise InvocationNotFound(f"no invocation {invocation_id!r} visible to this token", 404)
        if status != 200:
            raise SideAPIError(f"GET invocation answered {status}", status)
        try:
            return parse_invocation(body)
        except NotAnEnvelope as exc:
            raise SideAPIError(f"unreadable invocation record: {exc}", status) from None

    def result(self, invocation_id: str) -> RecordedResult:
        """The recorded final response. :class:`ResultUnavailable` (409, with the envelope) when
        there is no complete result; :class:`InvocationNotFound` (404, no envelope) when the id is
        unknown to this token."""
        status, headers, body = self._request(self._path(invocation_id) + "/result")
        if status == 404:
            raise InvocationNotFound(f"no invocation {invocation_id!r} visible to this token", 404)
        if status == 409:
            try:
                envelope = parse_envelope(body, headers)
            except NotAnEnvelope as exc:
                raise SideAPIError(f"409 without an envelope: {exc}", 409) from None
            raise ResultUnavailable(f"invocation {invocation_id} has no complete result", envelope)
        if status in (401, 403) and _get(headers, INVOCATION_HEADER) is None:
            raise SideAPIError(f"the side API refused the token ({status})", status)
        return RecordedResult(status, tuple(headers), body, source="side_api")


class Records(Protocol):
    """What :func:`call_with_recovery` needs from the side API (a fake in tests, or a wrapper)."""

    def invocation(self, invocation_id: str) -> Invocation: ...

    def result(self, invocation_id: str) -> RecordedResult: ...


# -- the decision -------------------------------------------------------------------------------


class Step(StrEnum):
    """The six things a caller can do after a failure."""

    FETCH_RESULT = "fetch_result"  # GET .../result; never re-send
    RETRY_SAME_KEY = "retry_same_key"  # the identical request with the same key, after ``delay``
    # The remote refused it completely (no effect) and said when to come back: after ``delay``,
    # send it again as a new operation, with a new key (the old key replays the refusal).
    RETRY_NEW_KEY = "retry_new_key"
    WAIT = "wait"  # still in flight: ask the side API again after ``delay``
    RECONCILE = "reconcile"  # stop: the effect may have happened; find out what did
    CORRECT = "correct"  # stop: fix the request, route, token or credential


@dataclass(frozen=True, slots=True)
class What:
    step: Step
    delay: float = 0.0
    invocation_id: str | None = None
    idempotency_key: str | None = None
    #: The enum value that decided (``next_action`` of a record, or ``retry`` of an envelope).
    because: NextAction | Retry | None = None


_BY_NEXT_ACTION: dict[NextAction, Step] = {
    NextAction.FETCH_RESULT: Step.FETCH_RESULT,
    NextAction.RETURN_RECORDED_RESULT: Step.FETCH_RESULT,
    NextAction.RETRY_NEW_ATTEMPT: Step.RETRY_SAME_KEY,
    NextAction.RETRY_SAME_KEY: Step.RETRY_SAME_KEY,
    NextAction.RETRY_WHEN_ALLOWED: Step.RETRY_NEW_KEY,
    NextAction.RECONCILE: Step.RECONCILE,
    NextAction.STOP_FOR_CORRECTION: Step.CORRECT,
    NextAction.WAIT: Step.WAIT,
}

_BY_RETRY: dict[Retry, Step] = {
    Retry.FETCH_RESULT: Step.FETCH_RESULT,
    Retry.NEVER: Step.FETCH_RESULT,  # the recorded result is the answer; do not repeat
    Retry.BACKOFF: Step.RETRY_SAME_KEY,
    Retry.SAME_IDEMPOTENCY_KEY: Step.RETRY_SAME_KEY,
    Retry.RECONCILE: Step.RECONCILE,
    Retry.AFTER_CORRECTION: Step.CORRECT,
}


def after_failure(failure: Envelope | Invocation) -> What:
    """What to do next, from a record's ``next_action`` (authoritative) or an envelope's ``retry``
    (what the broker knew when it answered). Only closed enums are read, never ``message``."""
    if isinstance(failure, Invocation):
        step = _BY_NEXT_ACTION[failure.next_action]
        action = failure.next_action
        if step is Step.FETCH_RESULT and not failure.result_available:
            # Complete, but not stored (RESULT_STORE_FAILED): an operator decides; never re-send.
            step = Step.RECONCILE
        if action in (NextAction.RETRY_WHEN_ALLOWED, NextAction.RETRY_NEW_ATTEMPT):
            delay = failure.retry_after if failure.retry_after is not None else DEFAULT_BACKOFF
        elif step is Step.WAIT:
            delay = DEFAULT_POLL
        else:
            delay = 0.0
        return What(step, delay, failure.invocation_id, failure.idempotency_key, action)
    step = _BY_RETRY[failure.retry]
    delay = 0.0
    if failure.retry is Retry.BACKOFF:
        delay = failure.retry_after if failure.retry_after is not None else DEFAULT_BACKOFF
    if step is Step.FETCH_RESULT and failure.invocation_id is None:
        step = Step.RECONCILE  # nothing to fetch without a record
    return What(step, delay, failure.invocation_id, failure.idempotency_key, failure.retry)


# -- the recovery loop --------------------------------------------------------------------------

#: Envelopes about *this* request's refusal whose ``invocation_id`` names an earlier record with
#: other facts (a different fingerprint; a budget spent): the record's ``next_action`` does not
#: apply to this request, the envelope does.
_ABOUT_THIS_REQUEST = frozenset({Code.IDEMPOTENCY_MISMATCH, Code.RETRY_BUDGET_EXHAUSTED})


def as_result(response: Any) -> RecordedResult:
    """A response of any HTTP library: ``(status, headers, body)``, or an object with
    ``status_code``/``status``, ``headers`` and ``content``/``body``/``read()``."""
    if isinstance(response, RecordedResult):
        return response
    if isinstance(response, tuple) and len(response) == 3:
        status, headers, body = response
    else:
        status = getattr(response, "status_code", None) or getattr(response, "status")
        headers = response.headers
        body = getattr(response, "content", None)
        if body is None:
            body = response.body if hasattr(response, "body") else response.read()
    return RecordedResult(int(status), tuple(header_pairs(headers)), bytes(body), source="proxy")


def call_with_recovery(
    send: Callable[[dict[str, str]], Any],
    api: Records,
    key: str,
    *,
    max_attempts: int = 3,
    max_wait: float = 60.0,
    sleep: Callable[[float], None] = time.sleep,
    header: str = "Idempotency-Key",
    transport_errors: tuple[type[BaseException], ...] = (OSError,),
) -> RecordedResult:
    """Send through the proxy with ``key`` and recover from a broker failure without a second effect.

    ``send(headers)`` makes the request (always the identical request: same method, target, body)
    with ``headers`` added, and returns the response (see :func:`as_result`). After a broker
    envelope the side API's ``next_action`` decides: the recorded result is fetched, the request is
    repeated with the SAME key (the broker re-checks every repeat: replay, re-send under a declared
    contract, or refusal), or :class:`ReconcileRequired` / :class:`CorrectionRequired` is raised.
    A transport error between agent and broker is repeated with the same key too: the broker
    binds the key to one invocation, so the repeat learns what happened instead of re-doing it.

    Bounded: at most ``max_attempts`` sends, at most ``max_wait`` seconds of waiting in total
    (:class:`AttemptsExhausted` after that). A transport error on the last send, or a side API
    error, is raised as it is: call again later with the same key. It never invents a key.
    """
    if not key or not key.strip():
        raise ValueError("an idempotency key is required: without one a repeat is a new operation")
    if max_attempts < 1:
        raise ValueError("max_attempts must be at least 1")
    waited = 0.0
    attempts = 0
    envelope: Envelope | None = None
    invocation: Invocation | None = None

    def pause(seconds: float) -> None:
        nonlocal waited
        if waited + seconds > max_wait:
            raise AttemptsExhausted(
                f"gave up after waiting {waited:.1f}s of max_wait={max_wait}s while the record still allows a retry; "
                f"call again later with the same key {key!r} (or allow a longer max_wait)", envelope, invocation)
        waited += seconds
        sleep(seconds)

    while True:
        if attempts >= max_attempts:
            raise AttemptsExhausted(
                f"gave up after {attempts} sends (max_attempts) while the record still allows a retry; call again "
                f"later with the same key {key!r} (or allow more max_attempts)", envelope, invocation)
        attempts += 1
        try:
            reply = as_result(send({header: key}))
        except transport_errors:
            if attempts >= max_attempts:
                raise
            pause(DEFAULT_BACKOFF)
            continue
        envelope = envelope_of(reply.headers, reply.body)
        if envelope is None:
            return reply  # the remote's own complete answer
        invocation = None
        if envelope.invocation_id is None or envelope.code in _ABOUT_THIS_REQUEST:
            what = after_failure(envelope)
        else:
            invocation = api.invocation(envelope.invocation_id)
            what = after_failure(invocation)
            while what.step is Step.WAIT:
                pause(what.delay)
                invocation = api.invocation(envelope.invocation_id)
                what = after_failure(invocation)
        if what.step in (Step.FETCH_RESULT, Step.RETRY_NEW_KEY):
            # RETRY_NEW_KEY: the recorded refusal is the answer to this key; a new operation is
            # the caller's decision (this function never invents a key).
            assert what.invocation_id is not None
            try:
                return api.result(what.invocation_id)
            except ResultUnavailable as exc:
                raise ReconcileRequired("the record has no complete result", exc.envelope, invocation) from None
        if what.step is Step.RECONCILE:
            raise ReconcileRequired(f"{envelope.code.value}: do not re-send; reconcile", envelope, invocation)
        if what.step is Step.CORRECT:
            raise CorrectionRequired(f"{envelope.code.value}: correct the request first", envelope, invocation)
        if attempts < max_attempts:
            pause(what.delay)
