"""Looking inside content-coded bodies for an echo of the injected credential (pure; the
broker-level proof is in test_broker_e2e)."""

from __future__ import annotations

import base64
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
    (b"not compressed at all", ["gzip"], "^gzip: the compressed data is corrupt$"),
    (b"\x1f\x8b\x08\x00" + bytes(6) + b"\xff" * 20, ["gzip"], "^gzip: the compressed data is corrupt$"),
    (b"not zstd", ["zstd"], "^zstd: the compressed data is corrupt$"),
    (b"not zlib", ["deflate"], "^deflate: the compressed data is corrupt$"),
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
    plain = _spellings(SECRET)[0]
    assert (plain.probe, plain.folded) == (SECRET, True), "letters, digits and -_.: one plain search (lower-cased)"
    # PHP's urlencode and Java's URLEncoder write ~ as %7E: a token with one is looked for spelled so too.
    assert redact(b"x=tok%7Eabcdef123&y=1", [b"tok~abcdef123"]) == (b"x=[REDACTED]&y=1", True)
    near = SPECIAL.replace("q", "g")  # one byte off is not the secret, in any spelling
    body = json.dumps({"a": near, "b": urllib.parse.quote(near), "c": near.upper(), "d": near.encode().hex(),
                       "e": base64.b64encode(near.encode()).decode()}).encode()
    assert redact(body, [SPECIAL.encode()]) == (body, False)


# ---------------------------------------------------------------- re-encoded echoes
# A careless upstream re-encodes what it echoes: the request's headers in a base64 debug field,
# a hex dump, an upper-cased header, a URL percent-encoded twice.

#: A typical API key: letters, digits and _ (its spelling needs no escapes).
TOKEN = "sk_live_4eC39HqLyjWDarjtT1zdp7dc"
#: One whose base64 holds + and / at every alignment (bytes >= 0xF8 and ? > ~).
TOKEN_BASE64_SIGNS = "tok\u00ff\u00fe?>~~~>>>???_0123456789"


def _b64(data: bytes, urlsafe: bool) -> str:
    return (base64.urlsafe_b64encode if urlsafe else base64.b64encode)(data).decode()


def _kept(redacted: bytes) -> list[bytes]:
    """What is left either side of the [REDACTED] markers."""
    return redacted.split(b"[REDACTED]")


@pytest.mark.parametrize("urlsafe", [False, True], ids=["standard", "url-safe"])
@pytest.mark.parametrize("before", [b"", b"a", b"ab", b"abc", b"Authorization: Bearer "])
@pytest.mark.parametrize("secret", [TOKEN, TOKEN_BASE64_SIGNS])
def test_base64_of_the_secret_is_found_at_every_alignment_in_both_alphabets(secret: str, before: bytes, urlsafe: bool):
    """Inside a longer base64 text the secret may start at any byte (0, 1 or 2 bytes before it
    modulo 3): the characters that depend on its bytes alone are found, padded or not, and at
    most one character either side is left (a few bits of the first and last byte)."""
    raw = secret.encode()
    if secret == TOKEN_BASE64_SIGNS:  # it exercises both alphabets: + and / at every alignment
        assert all(b"+" in base64.b64encode(b + raw)[4:-4] and b"/" in base64.b64encode(b + raw)[4:-4] for b in (b"", b"a", b"ab"))
    for after in (b"", b"!", b"!?", b' "rest"'):
        encoded = _b64(before + raw + after, urlsafe)
        for spelled in (encoded, encoded.rstrip("="), json.dumps(encoded)[1:-1].replace("/", "\\/"),
                        urllib.parse.quote(encoded, safe="")):
            body = json.dumps({"debug": "x"}).encode().replace(b'"x"', b'"' + spelled.encode() + b'"')
            redacted, changed = redact(body, [raw])
            assert changed and redacted.count(b"[REDACTED]") == 1, (spelled, redacted)
            head, tail = (urllib.parse.unquote(part.decode()).replace("\\/", "/") for part in _kept(redacted))
            # What is left is what encodes the bytes either side (4 characters per 3) and at most one more.
            assert len(head.removeprefix('{"debug": "')) <= -(-len(before) * 4 // 3) + 1, redacted
            assert len(tail.removesuffix('"}').rstrip("=")) <= -(-len(after) * 4 // 3) + 1, redacted


def test_the_basic_token_stays_replaced_whole_and_the_password_inside_is_found_in_base64_too():
    """The Basic value is base64 of user:secret: its token is a needle as it always was (the
    secret's own base64 run sits inside it and must not break it up)."""
    from proxy.config import Injection
    from proxy.credentials import injected_header

    credential = Credential("key", "env", TOKEN)
    name, value = injected_header(Injection(basic="svc"), credential)
    token = value.removeprefix("Basic ")
    needles = redaction_needles(credential, value)
    echo = json.dumps({"authorization": value, "token": token, "lower": token.lower(), "hex": token.encode().hex(),
                       "other user": base64.b64encode(f"admin:{TOKEN}".encode()).decode()}).encode()
    redacted, changed = redact(echo, needles)
    assert changed
    assert json.loads(redacted) == {"authorization": "[REDACTED]", "token": "[REDACTED]", "lower": "[REDACTED]",
                                    "hex": "[REDACTED]", "other user": "YWRtaW46[REDACTED]M="}, redacted


@pytest.mark.parametrize("spell", [bytes.hex, lambda b: b.hex().upper(),
                                   lambda b: "".join(c.upper() if i % 3 else c for i, c in enumerate(b.hex()))],
                         ids=["lower", "upper", "mixed"])
def test_hex_of_the_secret_is_found_in_any_case(spell):
    for secret in (TOKEN, SPECIAL):
        raw = secret.encode()
        dump = (b"\x00\x01log" + raw + b"\n").hex()
        hexed = spell(raw)
        body = f"dump={dump[:10]}{hexed}{dump[-4:]} id={hexed}".encode()
        redacted, changed = redact(body, [raw])
        assert changed and redacted == f"dump={dump[:10]}[REDACTED]{dump[-4:]} id=[REDACTED]".encode(), redacted


@pytest.mark.parametrize("change", [str.upper, str.lower, str.swapcase, str.title])
def test_the_secret_with_its_letters_in_another_case_is_found_in_every_spelling(change):
    """An upstream that upper-cases a header value still hands over all but a bit per letter.
    ASCII letters only (an é upper-cased is other bytes, and stays so)."""

    def case(text: str) -> str:
        return "".join(change(c) if c.isascii() else c for c in text) if change is not str.title else \
            "".join(c.upper() if c.isascii() and i % 4 == 0 else c for i, c in enumerate(text))

    needles = redaction_needles(Credential("key", "v1", SPECIAL), f"Bearer {SPECIAL}")
    for spelled in (case(SPECIAL), json.dumps(case(SPECIAL))[1:-1], urllib.parse.quote(case(SPECIAL)),
                    html.escape(case(SPECIAL)), case(f"Bearer {SPECIAL}")):
        redacted, changed = redact(b"seen: " + spelled.encode() + b";", needles)
        assert changed and redacted == b"seen: [REDACTED];", (spelled, redacted)
    assert redact(case(TOKEN).encode(), [TOKEN.encode()]) == (b"[REDACTED]", True)


@pytest.mark.parametrize("how", [
    "twice", "three times", "twice, lower-case hex", "form-encoded, then percent-encoded", "form-encoded twice"])
def test_a_secret_percent_encoded_more_than_once_is_found(how: str):
    """A URL holding the token encoded again (a redirect's ``next=``, a proxy that encodes the
    whole URL): every ``%`` becomes ``%25``, as often as it was encoded."""
    once = urllib.parse.quote(SPECIAL, safe="")
    spelled = {
        "twice": urllib.parse.quote(once, safe=""),
        "three times": urllib.parse.quote(urllib.parse.quote(once, safe=""), safe=""),
        "twice, lower-case hex": re.sub("%[0-9A-F]{2}", lambda m: m.group().lower(), urllib.parse.quote(once, safe="")),
        "form-encoded, then percent-encoded": urllib.parse.quote(urllib.parse.quote_plus(SPECIAL), safe=""),
        "form-encoded twice": urllib.parse.quote_plus(urllib.parse.quote_plus(SPECIAL)),
    }[how]
    assert "%25" in spelled
    redacted, changed = redact(f"next=%2Fcb%3Ftoken%3D{spelled}&x=1".encode(), [SPECIAL.encode()])
    assert changed and redacted == b"next=%2Fcb%3Ftoken%3D[REDACTED]&x=1", redacted


def test_a_near_miss_is_not_redacted_in_any_encoding():
    """One character off (not merely its case) is another value: none of its encodings is touched."""
    near = TOKEN[:16] + "x" + TOKEN[17:]  # (the last byte's low bits are in no base64 run of the secret)
    assert near != TOKEN
    raw = near.encode()
    forms = [near, near.upper(), raw.hex(), raw.hex().upper(), urllib.parse.quote(urllib.parse.quote(near))]
    forms += [_b64(before + raw, urlsafe) for before in (b"", b"a", b"ab") for urlsafe in (False, True)]
    body = json.dumps(forms).encode()
    assert redact(body, [TOKEN.encode()]) == (body, False)


def test_a_secret_too_short_for_its_encoded_forms_does_not_touch_base64_or_hex_text():
    """Below MIN_ENCODED_RUN characters a base64 or hex run could turn up in a large body by
    chance (an image, hashes): a body the agent receives would be corrupted. So the base64 of a
    secret is looked for from 13 bytes on (each alignment's run is 16 characters), its hex from
    8 bytes on; the secret itself always."""
    import random

    rng = random.Random(4)
    for length, encoded_found in ((12, False), (13, True)):
        secret = bytes(rng.choice(b"abcdefghijkmnopqrstuvwxyz0123456789") for _ in range(length))
        blob = base64.b64encode(rng.randbytes(300) + secret + rng.randbytes(300))
        redacted, changed = redact(blob, [secret])
        assert changed is encoded_found and (b"[REDACTED]" in redacted) is encoded_found, (length, redacted)
    for length, encoded_found in ((7, False), (8, True)):
        secret = bytes(rng.choice(b"abcdefghijkmnopqrstuvwxyz0123456789") for _ in range(length))
        blob = (rng.randbytes(300) + secret + rng.randbytes(300)).hex().encode()
        redacted, changed = redact(blob, [secret])
        assert changed is encoded_found, (length, redacted)
    # A 4-character secret (the shortest injected) inside random base64: its few characters of
    # base64 are there, and left alone; the secret itself is still found as it is.
    short = b"k7Qx"
    run = base64.b64encode(short)[:5]
    blob = base64.b64encode(rng.randbytes(3000)) + run + base64.b64encode(rng.randbytes(3000))
    assert redact(blob, [short]) == (blob, False)
    assert redact(b"a=K7QX", [short]) == (b"a=[REDACTED]", True)


def test_an_echo_in_several_encodings_at_once_inside_a_compressed_body_is_found():
    needles = redaction_needles(Credential("key", "v1", TOKEN), f"Bearer {TOKEN}")
    raw = TOKEN.encode()
    echo = json.dumps({"b64": base64.b64encode(b"Authorization: Bearer " + raw).decode(), "hex": raw.hex(),
                       "upper": TOKEN.upper(), "url": base64.urlsafe_b64encode(b"x" + raw).decode()}).encode()
    for coding in ("gzip", "deflate", "zstd"):
        body, changed, problem = redact_body(encoding.encode(echo, coding), coding, needles, 1 << 20)
        plain = encoding.decode(body, coding)
        assert changed and problem is None, plain
        fields = json.loads(plain)
        assert fields["hex"] == fields["upper"] == "[REDACTED]" and all("[REDACTED]" in v for v in fields.values()), fields
        assert TOKEN.upper().encode() not in plain.upper()


def test_a_chunked_coding_before_another_is_undone_too():
    """RFC 9112 6.1: a close-delimited response may apply chunked, then gzip. Its content is what
    was chunked, not the chunk framing (which is what the broker stored when it skipped every
    chunked, the parser having undone none)."""
    import gzip

    from proxy.codings import decode_transfer

    wire = gzip.compress(b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-T: 1\r\n\r\n")
    assert decode_transfer(wire, ["chunked", "gzip"], 1000) == b"hello world"
    for broken in (b"5\r\nhel", b"5\r\nhelloXX0\r\n\r\n", b"zz\r\n", b"0\r\n\r\nextra", b"0\r\nX-T: 1\r\n", b"5\r\nhello\r\n"):
        with pytest.raises(Undecodable):
            decode_transfer(gzip.compress(broken), ["chunked", "gzip"], 1000)
    with pytest.raises(Undecodable):
        decode_transfer(b"a\r\n0123456789\r\n0\r\n\r\n", ["chunked"], 5)
