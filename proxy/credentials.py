"""Credentials: resolve a secret source at the moment of use and attach it to a request.

Values live only in memory, only for the request that needs them. What is recorded is the
credential's id, a non-secret version and the injection method.
"""

from __future__ import annotations

import base64
import functools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from typing import TYPE_CHECKING

from .codings import Undecodable, codings_of, decode, encode
from .config import Injection, Settings
from .contract import Code

if TYPE_CHECKING:  # crypto imports this module (read_source) at run time
    from sqlalchemy.ext.asyncio import AsyncEngine

    from .crypto import KeyRing


@dataclass(frozen=True, slots=True)
class Credential:
    id: str
    version: str
    value: str = field(repr=False)


#: The shortest secret the broker injects: a shorter one cannot be found and redacted reliably.
MIN_SECRET_LENGTH = 4


class CredentialUnavailable(Exception):
    """The credential cannot be used; ``message`` is safe to show (it never names the value)."""

    def __init__(self, code: Code, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def read_source(source: str, *, what: str) -> tuple[str, str]:
    """(value, version) of an ``env:`` or ``file:`` source. Raises CredentialUnavailable."""
    scheme, _, ref = source.partition(":")
    if scheme == "env":
        value = os.environ.get(ref)
        if not value:
            state = "is not set" if value is None else "is set but empty"
            raise CredentialUnavailable(Code.CREDENTIAL_MISSING, f"{what}: environment variable {ref} {state}")
        return value, "env"
    if scheme == "file":
        path = Path(ref)
        try:
            stat = path.stat()
            value = path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise CredentialUnavailable(
                Code.CREDENTIAL_MISSING, f"{what}: cannot read {path} ({exc.strerror or 'unreadable'})"
            ) from None
        except UnicodeDecodeError:
            raise CredentialUnavailable(
                Code.CREDENTIAL_MISSING, f"{what}: {path} is not UTF-8 text (the secret is read as text; a binary "
                "key file does not work here)") from None
        if not value:
            raise CredentialUnavailable(Code.CREDENTIAL_MISSING, f"{what}: {path} is empty")
        return value, f"file-{stat.st_mtime_ns}"
    if scheme == "vault":
        raise CredentialUnavailable(
            Code.VAULT_LOCKED,
            f"{what}: the vault is not available in this broker (it holds upstream credentials, [[secrets]] from = "
            "\"vault:NAME\", once [crypto] keys are configured; agent and operator tokens come from env:NAME or "
            "file:/path)")
    raise CredentialUnavailable(Code.CREDENTIAL_MISSING, f"{what}: unsupported source")


class Credentials:
    """Upstream credentials by name, read from their source at the moment of use."""

    def __init__(self, settings: Settings, engine: AsyncEngine | None = None, ring: KeyRing | None = None):
        self._sources = {s.name: s.from_ for s in settings.secrets}
        self._engine = engine
        self._ring = ring

    async def get(self, name: str) -> Credential:
        source = self._sources.get(name)
        if source is None:
            raise CredentialUnavailable(Code.CREDENTIAL_MISSING, f"credential '{name}' is not configured")
        what = f"credential '{name}'"
        if source.startswith("vault:") and self._engine is not None and self._ring is not None:
            from . import vault  # imported here: the vault module imports this one

            value, version = await vault.latest(self._engine, self._ring, source.removeprefix("vault:"), what=what)
        else:
            value, version = read_source(source, what=what)
        if len(value.strip()) < MIN_SECRET_LENGTH:
            # Too short to be told apart from ordinary text: an echo of it could not be redacted,
            # so it is never sent (fail closed) rather than sent and possibly shown to the agent.
            raise CredentialUnavailable(
                Code.CREDENTIAL_MISSING,
                f"{what} is shorter than {MIN_SECRET_LENGTH} characters (surrounding spaces aside): an echo of a value "
                "that short cannot be told apart from other text and kept from the agent, so it is not sent. "
                "Configure the real secret.",
            )
        return Credential(id=name, version=version, value=value)

    async def version(self, name: str) -> str | None:
        """The non-secret version the credential would have now, without reading its value
        (for an approval card, shown before any secret is touched). None if unavailable."""
        source = self._sources.get(name)
        if source is None:
            return None
        scheme, _, ref = source.partition(":")
        if scheme == "env":
            return "env" if os.environ.get(ref) else None
        if scheme == "file":
            try:
                return f"file-{Path(ref).stat().st_mtime_ns}"
            except OSError:
                return None
        if scheme == "vault" and self._engine is not None:
            from . import vault

            return await vault.latest_version(self._engine, ref)
        return None


def injected_header(inject: Injection, credential: Credential) -> tuple[str, str]:
    """The header that carries the credential. Plain replacement, never str.format."""
    if inject.basic is not None:
        token = base64.b64encode(f"{inject.basic}:{credential.value}".encode()).decode("ascii")
        return "Authorization", f"Basic {token}"
    assert inject.header is not None
    # Surrounding spaces are no part of a field value (RFC 9110 5.5): the upstream reads it without them.
    return inject.header, inject.value.replace("{secret}", credential.value).strip()


def redaction_needles(credential: Credential, header_value: str) -> list[bytes]:
    """Byte strings that must never be stored or shown: the value and the finished header, also as
    the upstream reads them (a header value's surrounding spaces are not part of it), and a value
    that is not ASCII also as a server that decodes header bytes as Latin-1 echoes it (WSGI)."""
    needles = {credential.value, header_value, credential.value.strip(), header_value.strip()}
    for text in list(needles):
        if not text.isascii():
            needles.add(text.encode().decode("latin-1"))
    if header_value.startswith("Basic "):
        needles.add(header_value.removeprefix("Basic "))
    return sorted((n.encode() for n in needles if len(n) >= 4), key=len, reverse=True)


def redact(data: bytes, needles: list[bytes]) -> tuple[bytes, bool]:
    """Replace every echo of a needle, however an upstream spelled it (see :func:`_spellings`);
    returns (bytes, whether anything was replaced). Longer needles first (the whole header value
    before the secret inside it); a spelling's pattern runs only if its probe is in ``data``."""
    if not data or not needles:
        return data, False
    present = _present(data, needles)
    changed = False
    for needle in needles:
        forms = present.get(needle)
        if not forms:
            continue
        folded = data.lower() if any(form.folded for form in forms) else data
        spans = [m.span() for form in forms for m in form.pattern.finditer(folded if form.folded else data)]
        if spans:
            data, changed = _replaced(data, spans), True
    return data, changed


def _present(data: bytes, needles: list[bytes]) -> dict[bytes, list[_Form]]:
    """Each needle's spellings whose probe ``data`` holds: a plain search for each, the common path.
    Shortest needle first, so that a probe holding one already found absent (the header value's
    holds the secret's) is known absent without a search of its own."""
    folded: bytes | None = None
    absent: list[tuple[bytes, bool]] = []
    present: dict[bytes, list[_Form]] = {}
    for needle in sorted(needles, key=len):
        for form in _spellings(needle):
            if any(f == form.folded and a in form.probe for a, f in absent):
                continue
            if form.folded and folded is None:
                folded = data.lower()
            if form.probe in (folded if form.folded else data):
                present.setdefault(needle, []).append(form)
            else:
                absent.append((form.probe, form.folded))
    return present


def _replaced(data: bytes, spans: list[tuple[int, int]]) -> bytes:
    """``data`` with each span replaced; spans that overlap become one ``[REDACTED]``."""
    out, pos = [], 0
    for start, end in sorted(spans):
        if start < pos:
            pos = max(pos, end)
            continue
        out += (data[pos:start], b"[REDACTED]")
        pos = end
    out.append(data[pos:])
    return b"".join(out)


#: The shortest base64 or hex run of a needle that is looked for: 16 characters are 96 bits in
#: base64 and 64 in hex, so arbitrary text of that alphabet holds one of a needle's runs by chance
#: about once in 2**70 (base64: six runs) or 2**41 (hex) bodies of 8 MiB; a false match would
#: corrupt a body the agent receives. Base64 takes a needle of 13 bytes or more (each of its
#: three runs is then 16 characters at least); hex one of 8 bytes or more.
MIN_ENCODED_RUN = 16

#: Bytes the encodings an echo may go through leave as they are (``~`` is not one: PHP's
#: urlencode and Java's URLEncoder write it ``%7E``).
_PLAIN = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.")
#: HTML's named references; numeric ones (``&#43;``, ``&#x2B;``, ``&#039;``) are matched for every
#: character an encoder changes (not for letters, digits and ``-_.``, which no encoder spells so).
_HTML = {'"': (b"&quot;",), "&": (b"&amp;",), "'": (b"&apos;",), "<": (b"&lt;",), ">": (b"&gt;",)}
_URL_SAFE = bytes.maketrans(b"+/", b"-_")


@dataclass(frozen=True, slots=True)
class _Form:
    """One way an echo of a needle may be spelled."""

    pattern: re.Pattern[bytes]
    #: A literal every match holds (the longest stretch no encoding changes), looked for first.
    probe: bytes
    #: Matched (and probed) in ``data.lower()``, the same length as ``data`` so a span carries
    #: over: the needle's ASCII letters in any case. Base64 is matched as it is (case matters).
    folded: bool


# Kept for the secrets in use (a rotation adds one); they are in this process's memory anyway.
@functools.lru_cache(maxsize=256)
def _spellings(needle: bytes) -> tuple[_Form, ...]:
    """How an upstream that echoes ``needle`` may spell it:

    - its ASCII letters in any case, and every character that an encoding changes as sent,
      percent-encoded once or any number of times over (``%40``, ``%2540``, ``%252540``; hex
      digits in either case; a space also as ``+``, ``%2B``...), JSON-escaped (``\\"``, ``\\/``,
      ``\\uXXXX``, as Python's, Go's and PHP's encoders write them) or as an HTML character
      reference (named, or numeric in decimal or hex, with any leading zeros), each on its own
      (an encoder escapes some characters and not others);
    - the hex of its bytes, in any case, if that is :data:`MIN_ENCODED_RUN` digits or more;
    - its base64 inside a longer base64 text: for each of the three alignments, the run of
      characters that depend on its bytes alone, in the standard and the URL-safe alphabet (a
      ``+`` or ``/`` in it also escaped as above), if each run is :data:`MIN_ENCODED_RUN`
      characters or more. The character either side of a run holds a few bits of the needle's
      first or last byte (at most four) and is left as it is.

    Each form's probe is its longest stretch of letters, digits and ``-_.``: no encoding above
    changes them, so a body without the probe holds no echo in that form."""
    low = needle.lower()  # ASCII letters only, as bytes.lower() folds the data
    try:
        source, probe = _spelled(low.decode("utf-8"))
    except UnicodeDecodeError:
        source, probe = re.escape(low), low
    forms = [_Form(re.compile(source), probe, True)]
    if 2 * len(needle) >= MIN_ENCODED_RUN:
        forms.append(_Form(re.compile(needle.hex().encode()), needle.hex().encode(), True))
    for run in _base64_runs(needle):
        source, probe = _spelled(run.decode("ascii"))
        forms.append(_Form(re.compile(source), probe, False))
    return tuple(forms)


def _spelled(text: str) -> tuple[bytes, bytes]:
    """(pattern, longest run of bytes it matches only as they are) for ``text`` with each
    character an encoding changes in any of its encoded forms (see :func:`_spellings`)."""
    parts, runs, run = [], [], b""
    for char in text:
        raw = char.encode("utf-8")
        if raw[0] in _PLAIN:
            parts.append(re.escape(raw))
            run += raw
            continue
        runs.append(run)
        run = b""
        forms = {raw}
        # Hex digits in either case, each on its own (an encoder may mix them within a character);
        # each %25 more is one more round of percent-encoding.
        percent = [b"".join(b"%%(?:25)*(?i:%02x)" % b for b in raw)]
        if char == " ":
            forms.add(b"+")
            percent.append(b"%(?:25)*(?i:2b)")
        if char in '"\\/':
            forms.add(b"\\" + raw)
        forms.update(_HTML.get(char, ()))
        literal = [re.escape(f) for f in sorted(forms, key=len, reverse=True)]
        units = char.encode("utf-16-be")
        escaped = b"".join(b"\\\\u(?i:%s)" % units[i:i + 2].hex().encode() for i in range(0, len(units), 2))
        numeric = [b"&\\#0*%d;" % ord(char), b"&\\#[xX]0*(?i:%x);" % ord(char)]
        parts.append(b"(?:" + b"|".join([*literal, *percent, escaped, *numeric]) + b")")
    runs.append(run)
    return b"".join(parts), max(runs, key=len)


def _base64_runs(needle: bytes) -> list[bytes]:
    """The base64 characters that depend on ``needle``'s bytes alone, with 0, 1 or 2 bytes before
    it (modulo 3) in the text encoded, in both alphabets; none if one is under :data:`MIN_ENCODED_RUN`."""
    runs = []
    for before in range(3):
        first = -(-8 * before // 6)  # the first character with no bit of the bytes before
        end = 8 * (before + len(needle)) // 6  # the characters after it hold bits of the bytes after
        runs.append(base64.b64encode(bytes(before) + needle)[first:end])
    if min(map(len, runs)) < MIN_ENCODED_RUN:
        return []
    return sorted({spelled for run in runs for spelled in (run, run.translate(_URL_SAFE))}, key=len, reverse=True)


def redact_body(body: bytes, content_encoding: str | None, needles: list[bytes], limit: int) -> tuple[bytes, bool, str | None]:
    """:func:`redact` for a response body, looking through its content codings too (an upstream
    that echoes the request's headers gzipped would otherwise hand the secret to the agent).

    Returns (body, whether anything was replaced, why the body could not be looked inside, if it
    could not). A decoded body that held a needle is redacted and encoded again the same way."""
    raw, changed = redact(body, needles)
    applied = codings_of(content_encoding) if needles and body else []  # no body (HEAD, 304): nothing inside
    if not applied:
        return raw, changed, None
    try:
        plain = decode(body, applied, limit)
    except Undecodable as exc:
        return raw, changed, str(exc)
    clean, found = redact(plain, needles)
    if not found:
        return raw, changed, None
    return encode(clean, applied), True, None
