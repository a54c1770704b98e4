"""Unit tests of proxy/fingerprint.py: what makes two requests "the same operation".

The fingerprint is stored with every keyed invocation and compared on every repeat, so it must
be stable where the module promises stability (header order and case, host case, surrounding
whitespace, headers that do not define the operation, the injected credential) and sensitive
where it promises sensitivity (method, target, query as sent, body, Content-Type,
Content-Encoding).
"""

from __future__ import annotations

import hashlib
import json

import pytest

from proxy.fingerprint import (
    OPERATION_HEADERS,
    approval_fingerprint,
    body_sha256,
    config_digest,
    fingerprint,
    normalized_target,
)

TARGET = normalized_target("https", "api.payments.test", 443, "/v1/charges?currency=eur")
BODY = b'{"amount":100}'
HEADERS = [("Content-Type", "application/json"), ("Accept", "*/*"), ("User-Agent", "sdk/1.0")]


def fp(method: str = "POST", target: str = TARGET, body: bytes = BODY, headers=HEADERS, extra=()) -> str:
    return fingerprint(method, target, body, headers, extra)


# -- the form ---------------------------------------------------------------------------------


def test_the_fingerprint_is_a_prefixed_sha256_and_deterministic():
    value = fp()
    assert value.startswith("sha256:") and len(value) == 71
    int(value.removeprefix("sha256:"), 16)
    assert fp() == value


def test_the_v1_canonical_form_is_pinned():
    """Stored fingerprints must keep matching after an upgrade: the canonical form is fixed."""
    canonical = {
        "v": 1,
        "method": "POST",
        "target": "https://api.payments.test:443/v1/charges?currency=eur",
        "body_sha256": hashlib.sha256(BODY).hexdigest(),
        "headers": {"content-type": ["application/json"]},
    }
    expected = "sha256:" + hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert fp() == expected


def test_only_content_type_and_content_encoding_define_the_operation_by_default():
    assert set(OPERATION_HEADERS) == {"content-type", "content-encoding"}


# -- stability ------------------------------------------------------------------------------------


def test_header_order_and_name_case_do_not_matter():
    reordered = [("user-agent", "sdk/1.0"), ("ACCEPT", "*/*"), ("content-TYPE", "application/json")]
    assert fp(headers=reordered) == fp()
    two = [("Content-Type", "application/json"), ("Content-Encoding", "gzip")]
    assert fp(headers=two) == fp(headers=list(reversed(two))) == fp(headers=[("content-encoding", "gzip"), ("CONTENT-TYPE", "application/json")])


def test_surrounding_whitespace_in_an_operation_header_value_does_not_matter():
    assert fp(headers=[("Content-Type", "  application/json\t")]) == fp(headers=[("Content-Type", "application/json")])


@pytest.mark.parametrize("header", [
    ("Authorization", "Bearer sk_live_secret"),
    ("X-Api-Key", "sk_live_secret"),
    ("Idempotency-Key", "order-1234"),
    ("Proxy-Authorization", "Basic YnVpbGRlcjp0b2tlbg=="),
    ("Cookie", "session=abc"),
    ("X-Request-Id", "req_1"),
])
def test_headers_that_do_not_define_the_operation_never_influence_it(header):
    assert fp(headers=[*HEADERS, header]) == fp()


def test_the_injected_credential_never_influences_it():
    """The agent's request with a placeholder, with the injected value, or with neither: one fingerprint."""
    agent = [("Content-Type", "application/json")]
    placeholder = [*agent, ("Authorization", "Bearer affidavit-placeholder")]
    injected_a = [*agent, ("Authorization", "Bearer sk_live_AAAA")]
    injected_b = [*agent, ("Authorization", "Bearer sk_live_BBBB"), ("X-Api-Key", "sk_live_BBBB")]
    values = {fp(headers=h) for h in (agent, placeholder, injected_a, injected_b)}
    assert len(values) == 1
    assert "sk_live" not in values.pop()


def test_host_case_and_a_trailing_dot_are_normalised():
    expected = "https://api.payments.test:443/v1/charges"
    assert normalized_target("HTTPS", "API.Payments.TEST.", 443, "/v1/charges") == expected
    assert normalized_target("https", "api.payments.test", 443, "/v1/charges") == expected
    assert fp(target=normalized_target("HTTPS", "Api.Payments.Test", 443, "/v1/charges?currency=eur")) == fp()


def test_the_port_is_always_explicit_and_an_empty_path_is_the_root():
    assert normalized_target("https", "h.test", 443, "") == "https://h.test:443/"
    assert normalized_target("http", "h.test", 80, "/") == "http://h.test:80/"


def test_ipv6_hosts_are_bracketed_once():
    assert normalized_target("https", "::1", 8443, "/x") == "https://[::1]:8443/x"
    assert normalized_target("https", "[::1]", 8443, "/x") == "https://[::1]:8443/x"
    assert normalized_target("https", "FE80::1", 443, "/") == "https://[fe80::1]:443/"


def test_the_method_name_case_does_not_matter():
    assert fp(method="post") == fp(method="POST")


def test_an_empty_body_is_the_hash_of_no_bytes():
    assert body_sha256(b"") == hashlib.sha256(b"").hexdigest()
    assert fp(body=b"", method="GET") == fingerprint("GET", TARGET, b"", [("Content-Type", "application/json"), ("Accept", "x")])


# -- sensitivity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [b'{"amount":101}', b'{"amount": 100}', b"", BODY + b"\n", b'{"AMOUNT":100}'])
def test_any_body_change_changes_it(body):
    assert fp(body=body) != fp()


@pytest.mark.parametrize("method", ["PUT", "PATCH", "GET", "DELETE"])
def test_another_method_changes_it(method):
    assert fp(method=method) != fp()


@pytest.mark.parametrize(("scheme", "host", "port", "path"), [
    ("http", "api.payments.test", 443, "/v1/charges?currency=eur"),
    ("https", "api2.payments.test", 443, "/v1/charges?currency=eur"),
    ("https", "api.payments.test", 8443, "/v1/charges?currency=eur"),
    ("https", "api.payments.test", 443, "/v1/Charges?currency=eur"),  # the path's case is kept
    ("https", "api.payments.test", 443, "/v1/charges/?currency=eur"),
    ("https", "api.payments.test", 443, "/v1/charges?currency=usd"),
    ("https", "api.payments.test", 443, "/v1/charges"),
])
def test_another_target_changes_it(scheme, host, port, path):
    assert fp(target=normalized_target(scheme, host, port, path)) != fp()


def test_the_query_is_taken_exactly_as_sent():
    """No query normalisation is implemented: order, encoding and empty values all count."""
    base = normalized_target("https", "h.test", 443, "/x?a=1&b=2")
    assert base == "https://h.test:443/x?a=1&b=2"
    variants = ["/x?b=2&a=1", "/x?a=%31&b=2", "/x?a=1&b=2&", "/x?a=1&b=2&c", "/x?a=1&amp;b=2"]
    values = {fp(target=normalized_target("https", "h.test", 443, v)) for v in variants}
    assert len(values) == len(variants) and fp(target=base) not in values
    assert normalized_target("https", "h.test", 443, "/x?A=1") != normalized_target("https", "h.test", 443, "/x?a=1")


@pytest.mark.parametrize("headers", [
    [("Content-Type", "application/x-www-form-urlencoded")],
    [("Content-Type", "application/json"), ("Content-Encoding", "gzip")],
    [],  # no Content-Type at all
    [("Content-Type", "application/json"), ("Content-Type", "text/plain")],
])
def test_content_type_and_content_encoding_changes_change_it(headers):
    assert fp(headers=headers) != fp(headers=[("Content-Type", "application/json")])


def test_repeated_operation_header_values_keep_their_order():
    one = [("Content-Encoding", "gzip"), ("Content-Encoding", "br")]
    assert fp(headers=one) != fp(headers=list(reversed(one)))


def test_extra_headers_join_the_operation_case_insensitively():
    with_version = [*HEADERS, ("Stripe-Version", "2024-06-20")]
    assert fp(headers=with_version) == fp()  # not an operation header by default
    assert fp(headers=with_version, extra=["stripe-VERSION"]) != fp(extra=["Stripe-Version"])
    other = [*HEADERS, ("stripe-version", "2023-01-01")]
    assert fp(headers=with_version, extra=["Stripe-Version"]) != fp(headers=other, extra=["Stripe-Version"])
    assert fp(headers=[*HEADERS, ("STRIPE-VERSION", "2024-06-20")], extra=["Stripe-Version"]) == fp(headers=with_version, extra=["stripe-version"])


def test_cookies_split_over_http2_are_the_request_one_cookie_line_makes():
    """The adapter joins an HTTP/2 agent's Cookie fields before the broker sees the request, so the
    fingerprint (were Cookie ever one of its headers) cannot tell the two forms apart; Cookie is
    not an operation header by default, and neither form changes the fingerprint."""
    from mitmproxy.test import tutils

    from proxy.addon import agent_fields

    split = tutils.treq(http_version=b"HTTP/2.0", headers=((b"cookie", b"a=1"), (b"accept", b"*/*"), (b"cookie", b"b=2")))
    line = tutils.treq(http_version=b"HTTP/1.1", headers=((b"Cookie", b"a=1; b=2"), (b"Accept", b"*/*")))
    assert agent_fields(split) == [("cookie", "a=1; b=2"), ("accept", "*/*")]
    assert agent_fields(line) == [("Cookie", "a=1; b=2"), ("Accept", "*/*")]
    assert fp(headers=agent_fields(split), extra=["cookie"]) == fp(headers=agent_fields(line), extra=["cookie"])
    assert fp(headers=agent_fields(split)) == fp(headers=agent_fields(line)) == fp(headers=[])
    # HTTP/1.1 fields pass as sent; only HTTP/2 (and /3) Cookie fields are joined.
    two_lines = tutils.treq(http_version=b"HTTP/1.1", headers=((b"Cookie", b"a=1"), (b"Cookie", b"b=2")))
    assert agent_fields(two_lines) == [("Cookie", "a=1"), ("Cookie", "b=2")]


# -- approvals and configuration digests -----------------------------------------------------------


def test_an_approval_fingerprint_covers_target_method_body_and_credential_version():
    base = ("POST", TARGET, body_sha256(BODY), "payments-key", "env", "header")
    value = approval_fingerprint(*base)
    assert value.startswith("sha256:") and len(value) == 71
    assert approval_fingerprint("post", *base[1:]) == value
    for i, changed in enumerate(["PUT", TARGET + "&x=1", body_sha256(b"{}"), "other-key", "file-1", "basic"]):
        args = list(base)
        args[i] = changed
        assert approval_fingerprint(*args) != value, f"argument {i} is not covered"
    assert approval_fingerprint(*base) != fp()  # a different kind of fingerprint


def test_a_config_digest_changes_with_any_configuration_change():
    assert config_digest('{"name":"a"}') == config_digest('{"name":"a"}')
    assert config_digest('{"name":"a"}') != config_digest('{"name":"b"}')
    assert config_digest("").startswith("sha256:")
