"""Looking inside content-coded bodies for an echo of the injected credential (pure; the
broker-level proof is in test_broker_e2e)."""

from __future__ import annotations

import html
import json
import re
import urllib.parse
import zlib

import pytest
from mitmproxy.net import encoding

from proxy.codings import Undecodable, codings_of, decode, encode
from proxy.credentials import Credential, _spellings, redact, redact_body, redaction_needles

SECRET = b"sk_canary_0123456789"
ECHO = b'{"headers": [["Authorization", "Bearer ' + SECRET + b'"]]}'


def raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


@pytest.mark.parametrize("coding", ["gzip", "x-gzip", "deflate", "zstd"])
def test_each_known_coding_round_trips(coding: str):
    assert decode(encode(ECHO, [coding]), [coding], 1 << 20) == ECHO


def test_raw_deflate_and_stacked_codings_and_gzip_members_decode():
    assert decode(raw_deflate(ECHO), ["deflate"], 1 << 20) == ECHO
    assert codings_of("gzip, identity, br") == ["gzip", "br"]
    assert decode(encoding.encode(encoding.encode(ECHO, "gzip"), "zstd"), ["gzip", "zstd"], 1 << 20) == ECHO
    two_members = encoding.encode(b"first ", "gzip") + encoding.encode(b"second", "gzip")
    assert decode(two_members, ["gzip"], 1 << 20) == b"first second"


@pytest.mark.parametrize("coding", ["gzip", "deflate", "zstd"])
def test_a_body_that_expands_beyond_the_limit_stops_at_the_limit(coding: str):
    bomb = encode(b"\0" * (8 << 20), [coding])
    assert len(bomb) < 64 * 1024
    with pytest.raises(Undecodable, match="more than 1048576 bytes"):
        decode(bomb, [coding], 1 << 20)


@pytest.mark.parametrize(("body", "codings", "why"), [
    (b"not compressed at all", ["gzip"], "gzip"),
    (encoding.encode(ECHO, "gzip")[:-12], ["gzip"], "ends early"),
    (ECHO, ["compress"], "a coding the broker does not know"),
])
def test_what_cannot_be_decoded_says_why(body: bytes, codings: list[str], why: str):
    with pytest.raises(Undecodable, match=why):
        decode(body, codings, 1 << 20)


def test_redact_body_replaces_the_echo_inside_the_coding_and_keeps_the_coding():
    body, changed, problem = redact_body(encoding.encode(ECHO, "gzip"), "gzip", [SECRET], 1 << 20)
    assert changed and problem is None
    assert encoding.decode(body, "gzip") == ECHO.replace(SECRET, b"[REDACTED]")


def test_redact_body_leaves_a_clean_or_uninspectable_body_byte_for_byte():
    clean = encoding.encode(b'{"ok": true}', "zstd")
    assert redact_body(clean, "zstd", [SECRET], 1 << 20) == (clean, False, None)
    assert redact_body(clean, "zstd", [], 1 << 20) == (clean, False, None), "no credential: nothing to look for"
    body, changed, problem = redact_body(b"\x00junk", "gzip", [SECRET], 1 << 20)
    assert (body, changed) == (b"\x00junk", False) and problem is not None
    plain = b"Bearer " + SECRET
    assert redact_body(plain, None, [SECRET], 1 << 20) == (b"Bearer [REDACTED]", True, None)


@pytest.mark.parametrize("coding", ["gzip", "br", "zstd", "deflate", "compress"])
def test_an_empty_body_with_a_coding_header_is_left_alone(coding: str):
    """A response to HEAD, or a 304, names the coding of a body it does not carry."""
    assert redact_body(b"", coding, [SECRET], 1 << 20) == (b"", False, None)


def test_br_is_not_decoded_because_one_step_cannot_be_bounded():
    with pytest.raises(Undecodable, match="br cannot be decoded"):
        decode(encoding.encode(ECHO, "br"), ["br"], 1 << 20)


def test_many_tiny_gzip_members_and_data_after_a_zlib_stream_are_refused_quickly():
    import time

    empty = encoding.encode(b"", "gzip")
    started = time.monotonic()
    with pytest.raises(Undecodable, match="more than 1024 gzip members"):
        decode(empty * 200_000, ["gzip"], 32 << 20)
    assert time.monotonic() - started < 2
    assert decode(empty * 3 + encoding.encode(ECHO, "gzip"), ["gzip"], 1 << 20) == ECHO
    with pytest.raises(Undecodable, match="after the end"):
        decode(zlib.compress(b"{}") + zlib.compress(ECHO), ["deflate"], 1 << 20)


#: A secret with every kind of character an echo's encoding rewrites.
SPECIAL = 'p@ss/w+rd"q<y>&\\z \'é'
_SPELLINGS = {
    "as sent": SPECIAL,
    "JSON, ASCII only (Python's json)": json.dumps(SPECIAL)[1:-1],
    "JSON, UTF-8 kept (orjson, Node)": json.dumps(SPECIAL, ensure_ascii=False)[1:-1],
    "JSON, slashes escaped (PHP)": json.dumps(SPECIAL)[1:-1].replace("/", "\\/"),
    "JSON, HTML-safe (Go)": json.dumps(SPECIAL)[1:-1].replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"),
    "JSON, upper-case escapes": json.dumps(SPECIAL)[1:-1].replace("\\u00e9", "\\u00E9"),
    "URL component": urllib.parse.quote(SPECIAL, safe=""),
    "URL path, lower-case hex": re.sub("%[0-9A-F]{2}", lambda m: m.group().lower(), urllib.parse.quote(SPECIAL)),
    "URL path, hex case mixed within a character": urllib.parse.quote(SPECIAL).replace("%C3%A9", "%C3%a9"),
    "form": urllib.parse.quote_plus(SPECIAL),
    "JavaScript encodeURIComponent": urllib.parse.quote(SPECIAL, safe="!*'()"),
    "HTML": html.escape(SPECIAL),
    "HTML, quotes kept": html.escape(SPECIAL, quote=False),
    "HTML, Go's html/template (+ as &#43;)": html.escape(SPECIAL).replace("+", "&#43;"),
    "HTML, PHP's htmlspecialchars (&#039;)": html.escape(SPECIAL).replace("&#x27;", "&#039;"),
    "HTML, numeric references in upper-case hex": "".join(c if c.isalnum() else f"&#X{ord(c):X};" for c in SPECIAL),
}


@pytest.mark.parametrize("how", list(_SPELLINGS))
def test_an_echo_of_the_secret_is_found_however_the_upstream_encoded_it(how: str):
    """An honest upstream that echoes what it was sent usually encodes it on the way out (a JSON
    document, a query string, an HTML page): every such spelling of the secret is an echo."""
    needles = redaction_needles(Credential("key", "v1", SPECIAL), f"Bearer {SPECIAL}")
    spelled = _SPELLINGS[how].encode()
    body = b'{"headers": [["Authorization", "Bearer ' + spelled + b'"]], "q": "' + spelled + b'"}'
    redacted, changed = redact(body, needles)
    assert changed and spelled not in redacted, redacted
    assert redacted == b'{"headers": [["Authorization", "[REDACTED]"]], "q": "[REDACTED]"}'
    inside, changed, problem = redact_body(encoding.encode(body, "gzip"), "gzip", needles, 1 << 20)
    assert changed and problem is None and encoding.decode(inside, "gzip") == redacted


def test_a_secret_with_surrounding_spaces_is_found_as_the_upstream_read_it():
    """A header value's surrounding spaces are no part of it: the upstream echoes the value
    without them, and the broker sends it without them."""
    from proxy.config import Injection
    from proxy.credentials import injected_header

    credential = Credential("key", "env", SECRET.decode() + " \t")
    name, value = injected_header(Injection(header="Authorization", value="Bearer {secret}"), credential)
    assert (name, value) == ("Authorization", "Bearer " + SECRET.decode())
    echo = b'{"seen": "' + SECRET + b'", "header": "Bearer ' + SECRET + b'"}'
    assert redact(echo, redaction_needles(credential, value)) == (b'{"seen": "[REDACTED]", "header": "[REDACTED]"}', True)


def test_a_secret_that_is_not_ascii_is_found_as_a_latin_1_reading_server_echoes_it():
    """WSGI servers (PEP 3333) decode header bytes as Latin-1: an echo of a UTF-8 secret through
    them is its mojibake, JSON-escaped or not."""
    secret = "cnF\u00e9\u20ac\u00dc_x9Lq"
    needles = redaction_needles(Credential("key", "env", secret), f"Bearer {secret}")
    misread = secret.encode().decode("latin-1")
    for echo in (json.dumps({"a": misread}).encode(), json.dumps({"a": misread}, ensure_ascii=False).encode()):
        redacted, changed = redact(echo, needles)
        assert changed and redacted == b'{"a": "[REDACTED]"}', redacted


def test_a_secret_too_short_to_be_found_is_never_injected(monkeypatch):
    import asyncio

    from proxy.config import Settings
    from proxy.contract import Code
    from proxy.credentials import Credentials, CredentialUnavailable

    monkeypatch.setenv("AFFIDAVIT_TEST_SHORT", "k7Q ")
    settings = Settings.model_validate({"secrets": [{"name": "short", "from": "env:AFFIDAVIT_TEST_SHORT"}]})
    with pytest.raises(CredentialUnavailable) as refused:
        asyncio.run(Credentials(settings).get("short"))
    assert refused.value.code is Code.CREDENTIAL_MISSING and "shorter than 4 characters" in refused.value.message
    assert "k7Q" not in refused.value.message
    monkeypatch.setenv("AFFIDAVIT_TEST_SHORT", "k7Qx")
    assert asyncio.run(Credentials(settings).get("short")).value == "k7Qx"


def test_a_secret_no_encoding_changes_is_looked_for_as_it_is_and_other_bytes_are_left_alone():
    assert _spellings(SECRET) is None, "letters, digits and -_.: one plain search"
    # PHP's urlencode and Java's URLEncoder write ~ as %7E: a token with one is looked for spelled so too.
    assert redact(b"x=tok%7Eabcdef123&y=1", [b"tok~abcdef123"]) == (b"x=[REDACTED]&y=1", True)
    near = SPECIAL.replace("q", "Q")  # one byte off is not the secret, in any spelling
    body = json.dumps({"a": near, "b": urllib.parse.quote(near)}).encode()
    assert redact(body, [SPECIAL.encode()]) == (body, False)
