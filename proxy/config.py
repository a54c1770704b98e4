"""Configuration: one TOML file plus ``AFFIDAVIT_*`` environment variables, validated at start.

The environment overrides the file (``AFFIDAVIT_PROXY__LISTEN=127.0.0.1:9090``; lists such as
``AFFIDAVIT_ROUTES`` take JSON). A bad configuration raises :class:`ConfigError`, which names the
source (the file, or the variable that set the value), the key and the reason; nothing starts
half-configured.
"""

from __future__ import annotations

import ipaddress
import itertools
import math
import os
import re
import tomllib
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

DEFAULT_CONFIG = Path("affidavit.toml")

_DURATION = re.compile(r"^ *([0-9]+(?:\.[0-9]+)?) *(ms|s|m|h|d)? *$")
#: The longest duration any setting takes (an idempotency retention of a year is already long).
MAX_DURATION = 366 * 86400.0
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(value: Any) -> float:
    """``"250ms"``, ``"10s"``, ``"5m"``, ``"24h"``, ``"7d"`` or a number of seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if not match:
            if str(value).strip().startswith("-"):
                raise ValueError(f"{value!r}: a duration must be positive")
            raise ValueError(f"{value!r} is not a duration such as '10s', '5m' or '24h' (or a number of seconds)")
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if math.isnan(seconds) or seconds <= 0:
        raise ValueError(f"{value!r}: a duration must be positive")
    return seconds


def _setting_duration(value: Any) -> float:
    """A duration a setting takes: :func:`parse_duration`'s, finite and at most :data:`MAX_DURATION`
    (a window to look back over, ``--since``, may be longer)."""
    seconds = parse_duration(value)
    if seconds > MAX_DURATION:
        raise ValueError(f"{value!r}: longer than any setting takes (at most 366d)")
    return seconds


Duration = Annotated[float, BeforeValidator(_setting_duration)]


def _no_flag(value: Any) -> Any:
    """A number or size given as ``true``/``false`` is a slip (pydantic would read it as 1 or 0)."""
    if isinstance(value, bool):
        raise ValueError(f"{str(value).lower()} is a boolean; this setting takes a number")
    return value


def check_size(value: Any) -> Any:
    """A size as pydantic's ``ByteSize`` reads it, with a message that echoes the value and shows
    the form (pydantic's own says only "could not parse value and unit from byte string")."""
    if isinstance(value, str):
        try:
            TypeAdapter(ByteSize).validate_python(value)
        except ValidationError:
            rule = "a size cannot be negative" if value.strip().startswith("-") else (
                "not a size such as '64KiB', '10MiB' or '1GB' (or a number of bytes; units are case-insensitive: "
                "KiB/MiB/GiB are powers of 1024, KB/MB/GB of 1000)")
            raise ValueError(f"{value!r}: {rule}") from None
    return value


Size = Annotated[ByteSize, BeforeValidator(check_size), BeforeValidator(_no_flag)]


def _flag(value: Any) -> Any:
    """``true`` or ``false``; from the environment also ``"true"``/``"false"``/``"1"``/``"0"``. A number, or
    a word such as ``"no"`` or ``"off"``, is refused rather than guessed at."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "0"):
        return False
    raise ValueError(f"{value!r}: give true or false")


Flag = Annotated[bool, BeforeValidator(_flag)]
Number = Annotated[int, BeforeValidator(_no_flag)]

_LISTEN_HOST = re.compile(r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?\]")


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = str(value).rpartition(":")
    if sep and _LISTEN_HOST.fullmatch(host) and port.isascii() and port.isdigit() and not 1 <= int(port) <= 65535:
        raise ValueError(f"{value!r}: port {int(port)} is out of range (1 to 65535)")
    if not sep or not _LISTEN_HOST.fullmatch(host) or not (port.isascii() and port.isdigit()):
        # An empty host ('[]:8080') would bind every interface: that must be said, as 0.0.0.0 or [::].
        raise ValueError(f"{value!r} is not host:port, e.g. '127.0.0.1:8080' or '[::1]:8080' (every interface: "
                         "'0.0.0.0:8080' or '[::]:8080')")
    return host.strip("[]"), int(port)


def _check_listen(value: str) -> str:
    parse_listen(value)
    return value


Listen = Annotated[str, BeforeValidator(_check_listen)]

_SOURCE = re.compile(r"^(env|file|vault):(.+)$")


def _check_source(value: str) -> str:
    if not isinstance(value, str) or not _SOURCE.match(value):
        raise ValueError("must be 'env:NAME', 'file:/path' or 'vault:NAME' (never the value itself)")
    return value


SecretSource = Annotated[str, BeforeValidator(_check_source)]


_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def _token(value: str) -> str:
    """An HTTP token (RFC 9110 5.6.2): what a header name or a method must be."""
    if not _TOKEN.fullmatch(value):
        raise ValueError(f"{value!r} is not a valid HTTP token (a header name or method: letters, digits, !#$%&'*+-.^_`|~)")
    return value


Token = Annotated[str, AfterValidator(_token)]

#: The longest method the journal records (its ``invocations.method`` column); every method HTTP
#: defines is shorter. Names are held to their columns' widths too: a longer value would make every
#: journal write that holds it fail on PostgreSQL, and with it the writes batched alongside.
MAX_METHOD_LENGTH = 16

#: Headers the broker itself reads, sets or drops on the way upstream (hop-by-hop ones, Host,
#: the agent's proxy credential, the body's length; proxy.upstream.HOP_BY_HOP): none can carry
#: an idempotency key or a credential.
RESERVED_HEADERS = frozenset({
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
    "proxy-authenticate", "proxy-authorization", "host", "content-length",
})


def _free_header(value: str) -> str:
    _token(value)
    if value.lower() in RESERVED_HEADERS:
        raise ValueError(f"{value!r} is a header the broker itself reads, sets or drops on the way upstream "
                         "(hop-by-hop, Host, Proxy-Authorization, Content-Length): it cannot carry a key or a credential")
    return value


FreeHeader = Annotated[str, AfterValidator(_free_header)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ProxySection(_Section):
    listen: Listen = "127.0.0.1:8080"
    default: Literal["deny"] = "deny"
    #: mitmproxy's configuration directory: the broker's CA certificate and key live here.
    confdir: Path = Path(".affidavit")
    #: Default request-body limit for routes that set none.
    max_body: Size = ByteSize(10 * 1024 * 1024)
    #: Request header agents may use to mark one logical operation (see docs/retries.md).
    idempotency_header: FreeHeader = "Idempotency-Key"
    #: How long a re-send may hold an invocation before it must have dispatched.
    retry_lease: Duration = 30.0
    #: How long an agent's request line and headers may take to arrive, from their first byte.
    request_head_timeout: Duration = 30.0
    #: How long an agent's request body may take to arrive, once its headers are complete.
    request_body_timeout: Duration = 120.0
    #: Broker processes sharing the listen ports (SO_REUSEPORT) and one journal; see docs/performance.md.
    workers: Number = Field(default=1, ge=1, le=64)
    #: The event loop the broker runs on: uvloop's (libuv), or asyncio's own.
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    #: On a stop, how long the exchanges already sent may take to end as they would, before the
    #: rest are cut (nothing new is sent meanwhile); see docs/operations.md.
    drain: Duration = 10.0


class ApiSection(_Section):
    listen: Listen = "127.0.0.1:8081"
    operator_token: SecretSource | None = None
    #: How long one request (line, headers and body) may take to arrive, from its first byte.
    request_timeout: Duration = 30.0


class DatabaseSection(_Section):
    url: str = "sqlite+aiosqlite:///./affidavit.db"
    pool_size: Number = Field(default=10, ge=1, le=200)
    #: Upgrade the schema on start (always done for SQLite; PostgreSQL uses `affidavit db upgrade`).
    auto_upgrade: Flag | None = None

    @field_validator("url")
    @classmethod
    def _supported(cls, url: str) -> str:
        if not url.startswith(("sqlite+aiosqlite://", "postgresql+asyncpg://")):
            raise ValueError("use 'sqlite+aiosqlite:///path.db' or 'postgresql+asyncpg://user@host/db'")
        if url.startswith("sqlite"):
            from sqlalchemy.engine import make_url

            parsed = make_url(url)
            database = parsed.database or ""
            if (database in ("", ":memory:") or database.startswith("file::memory:") or parsed.query.get("mode") == "memory"
                    or "memdb" in str(parsed.query.get("vfs", ""))):
                # The journal's writer process would open a database of its own, and every record
                # would be gone at exit: the journal's promise needs a file.
                raise ValueError("an in-memory SQLite database cannot be the journal; give a file path, "
                                 "e.g. 'sqlite+aiosqlite:///./affidavit.db'")
        return url

    @property
    def is_sqlite(self) -> bool:
        return self.url.startswith("sqlite")


class UpstreamSection(_Section):
    #: Extra CA file trusted for upstream TLS, on top of the system store.
    ca_bundle: str = ""
    connect_timeout: Duration = 10.0
    #: How long the caller waits for a complete response before being told `unknown`.
    response_timeout: Duration = 60.0
    #: How long the broker keeps reading a late response after the caller stopped waiting,
    #: so a result that arrives late is still recorded and fetchable.
    result_horizon: Duration = 300.0
    max_response_body: Size = ByteSize(32 * 1024 * 1024)
    #: How long an idle upstream connection is kept for the next request of its agent and route.
    keepalive: Duration = 30.0


#: A ``[crypto] keys`` id, and an entry: ``ID=env:NAME`` or ``ID=file:/path``.
KEY_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_KEY_SOURCE = re.compile(r"(?:env|file):.+$")


def _check_key_entry(value: str) -> str:
    key_id, sep, source = value.partition("=") if isinstance(value, str) else ("", "", "")
    if not (sep and _KEY_SOURCE.match(source)):
        raise ValueError("each key is 'ID=env:NAME' or 'ID=file:/path' (the source holds 32 random bytes, base64)")
    if not KEY_ID.fullmatch(key_id):
        raise ValueError(f"the key id {key_id[:70]!r} is not 1 to 64 letters, digits, '_', '.' or '-'")
    return value


KeyEntry = Annotated[str, BeforeValidator(_check_key_entry)]


class CryptoSection(_Section):
    """AES-256-GCM keys for event payloads, stored results and the vault.

    The first key encrypts everything new; every listed key can decrypt, so a key is rotated by
    putting a new one first and keeping the old one listed until nothing needs it. With no key,
    payloads and results are stored unencrypted and the vault is locked.
    """

    keys: list[KeyEntry] = Field(default_factory=list)

    @field_validator("keys")
    @classmethod
    def _distinct(cls, keys: list[str]) -> list[str]:
        _unique("", [k.split("=", 1)[0] for k in keys])  # the error's location already says crypto.keys
        return keys

    def entries(self) -> list[tuple[str, str]]:
        """(key id, source) pairs, encrypting key first."""
        return [tuple(k.split("=", 1)) for k in self.keys]  # type: ignore[misc]


class LogSection(_Section):
    #: debug, info, warning or error. Logs are JSON lines on stderr and never hold a secret.
    level: Literal["debug", "info", "warning", "error"] = "info"


class RecoverySection(_Section):
    """How brokers notice each other's deaths (docs/operations.md)."""

    #: This broker's stable name; default "<host name>:<proxy port>". Must be unique among live
    #: brokers: a restarted broker closes the in-flight records of its earlier incarnations.
    instance: str | None = Field(default=None, max_length=72)
    heartbeat: Duration = 2.0
    #: A broker whose heartbeat is this old is considered stopped; its in-flight work is closed.
    stale_after: Duration = 30.0
    sweep_every: Duration = 10.0

    @field_validator("instance")
    @classmethod
    def _instance(cls, instance: str | None) -> str | None:
        if instance is not None and not re.fullmatch(r"[!-~]+", instance):
            raise ValueError(f"{instance!r}: a name of visible ASCII characters without spaces, such as 'broker-1' "
                             "(leave it out for the default '<host name>:<proxy port>')")
        return instance

    @model_validator(mode="after")
    def _stale_after_beats(self) -> "RecoverySection":
        if self.stale_after < 2 * self.heartbeat:
            raise ValueError(f"'stale_after' ({self.stale_after:g} s) must be at least two heartbeats "
                             f"({2 * self.heartbeat:g} s): a live broker whose beat is a moment late would be taken "
                             "for stopped, and its in-flight records closed under it")
        return self


class Agent(_Section):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", max_length=100)
    token: SecretSource


class Secret(_Section):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", max_length=100)
    from_: SecretSource = Field(alias="from")


class Injection(_Section):
    """How the credential is attached: a header template, or HTTP Basic with a fixed user."""

    header: FreeHeader | None = None
    value: str = "{secret}"
    basic: str | None = Field(default=None, description="HTTP Basic username; the secret is the password")
    #: The exact value an agent may send in the injected header to satisfy an SDK that insists
    #: on a key (e.g. "Bearer placeholder"); it is replaced. Any other value is refused with
    #: FORBIDDEN_HEADER_OVERRIDE.
    placeholder: str | None = None

    @model_validator(mode="after")
    def _one_form(self) -> "Injection":
        if (self.header is None) == (self.basic is None):
            raise ValueError("set exactly one of 'header' (with 'value') or 'basic'")
        if self.header is not None and "{secret}" not in self.value:
            raise ValueError("'value' must contain '{secret}'")
        for name in ("value", "basic", "placeholder"):
            if (text := getattr(self, name)) is not None and re.search(r"[\x00-\x1f\x7f]", text):
                raise ValueError(f"'{name}' holds a control character (a line break, say): a header value cannot")
        if self.basic is not None and ":" in self.basic:
            raise ValueError("'basic' holds a ':': HTTP Basic ends the user name at the first ':' (RFC 7617), so the "
                             "upstream would read a different user and password")
        if self.basic is not None and self.value != "{secret}":
            raise ValueError("'value' has no effect with 'basic' (the secret is the password); remove it")
        return self

    @property
    def target_header(self) -> str:
        return self.header if self.header is not None else "Authorization"

    @property
    def method(self) -> str:
        return "basic" if self.basic is not None else "header"


class Idempotency(_Section):
    """A declared remote contract: the service binds this header's key to one operation."""

    header: FreeHeader = "Idempotency-Key"
    scope: str = Field(max_length=200)
    retention: Duration


#: What a lookup path may name: the invocation's idempotency key, its id, and the job reference of
#: a 202 answer (proxy.broker.Broker.lookup fills them in).
LOOKUP_PLACEHOLDERS = ("key", "invocation_id", "job_ref")


class Lookup(_Section):
    """How to ask the remote about an operation: a GET on the route's own origin.

    A complete 2xx answer means the remote has the operation (``committed``); a complete 404 or
    410 means it has none (``rejected``: it claims no effect). Anything else proves nothing.
    """

    path: str = Field(pattern=r"^/")
    method: Literal["GET", "HEAD"] = "GET"

    @field_validator("path")
    @classmethod
    def _path(cls, path: str) -> str:
        if path.startswith("//"):
            raise ValueError("starts with '//', which a client reads as another host: the lookup goes to the route's "
                             "own origin, give a path such as '/v1/charges/{key}'")
        if not path.isascii() or not path.isprintable() or " " in path or "#" in path:
            raise ValueError(f"{path!r}: a lookup path holds visible ASCII only, without '#' (percent-encode the rest)")
        if (odd := sorted(set(re.findall(r"\{([^{}]*)\}", path)) - set(LOOKUP_PLACEHOLDERS))):
            raise ValueError(f"unknown placeholder(s) {', '.join('{' + o + '}' for o in odd)}: the lookup path takes "
                             + ", ".join("{" + p + "}" for p in LOOKUP_PLACEHOLDERS))
        return path


class Route(_Section):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]+$", max_length=200)
    host: str
    port: Number = Field(default=443, ge=1, le=65535)
    scheme: Literal["http", "https"] | None = None
    methods: list[str] = Field(default_factory=lambda: ["GET", "HEAD"])
    path: str = "/*"
    agents: list[str]
    credential: str | None = None
    inject: Injection | None = None
    idempotent: Flag | None = None
    idempotency: Idempotency | None = None
    approval: Flag = False
    #: How long a request held for approval waits for an operator's decision.
    approval_timeout: Duration = 300.0
    #: A read-only request that asks the remote what became of an operation, for
    #: `affidavit reconcile ID --lookup`. Placeholders: {key}, {invocation_id}, {job_ref}.
    lookup: Lookup | None = None
    max_body: Size | None = None
    retry_budget: Number = Field(default=3, ge=0, le=100)
    #: Connect here instead of resolving `host` (TLS is still verified against `host`).
    connect_to: Listen | None = None
    connect_timeout: Duration | None = None
    response_timeout: Duration | None = None
    result_horizon: Duration | None = None
    #: Keep the route's upstream connections alive between requests (the default). False: a new
    #: connection for every request, closed after its answer, for an upstream that does not keep
    #: HTTP/1.1's framing (it answers without reading a body, or sends bytes nobody asked for).
    reuse_connections: Flag = True

    @field_validator("agents")
    @classmethod
    def _someone(cls, agents: list[str]) -> list[str]:
        if not agents:
            raise ValueError("list at least one agent (the names of [[agents]] that may use this route): a route no "
                             "agent may use matches nothing")
        return agents

    @field_validator("methods")
    @classmethod
    def _upper(cls, methods: list[str]) -> list[str]:
        if not methods:
            raise ValueError("list at least one method")
        if "*" in methods:
            raise ValueError("'*' is not a wildcard here (it would allow only a method named '*'): list the methods, "
                             'e.g. ["GET", "POST"]')
        for method in methods:
            if len(method) > MAX_METHOD_LENGTH:
                raise ValueError(f"{method!r} is {len(method)} characters long; the journal records methods of at most "
                                 f"{MAX_METHOD_LENGTH}")
        return [_token(m).upper() for m in methods]

    @field_validator("host")
    @classmethod
    def _host(cls, host: str) -> str:
        host = host.lower()
        if host.endswith(".") and host != ".":
            raise ValueError(f"{host!r}: write the host without its trailing dot ({host.rstrip('.')!r}); a request "
                             "naming it with the dot is refused before any route is matched")
        name = host[2:] if host.startswith("*.") else host
        if _DNS_NAME.fullmatch(name) and len(name) <= 253 or name is host and _ipv6_literal(host):
            return host
        raise ValueError("must be an exact host name (labels of letters, digits and inner '-', joined by '.'), "
                         "an IP address ('10.0.0.5', '[::1]') or '*.suffix'")

    @field_validator("path")
    @classmethod
    def _path(cls, path: str) -> str:
        if not path.startswith("/"):
            raise ValueError("must start with '/' (a glob such as '/v1/charges*')")
        if not path.isascii() or not path.isprintable() or " " in path or "#" in path:
            # A request path holding any of these is refused before routes are matched.
            raise ValueError(f"{path!r}: a path glob holds visible ASCII only, without '#' (no request path "
                             "can hold anything else, so the route could never match)")
        return path

    @model_validator(mode="after")
    def _credential_needs_injection(self) -> "Route":
        if (self.credential is None) != (self.inject is None):
            raise ValueError("'credential' and 'inject' go together")
        if self.connect_to is not None and self.host.startswith("*."):
            raise ValueError("'connect_to' needs an exact host, not a '*.suffix' pattern")
        if self.inject is not None and self.idempotency is not None and (
                self.inject.target_header.lower() == self.idempotency.header.lower()):
            raise ValueError(f"'idempotency.header' and the injected header are both {self.idempotency.header!r}: the "
                             "upstream would get the credential and the key in two lines of one header")
        return self

    @property
    def effective_scheme(self) -> str:
        return self.scheme or ("http" if self.port == 80 else "https")

    def matches_target(self, scheme: str, host: str, port: int) -> bool:
        if scheme != self.effective_scheme or port != self.port:
            return False
        host = host.lower()
        if self.host.startswith("*."):
            # Names only: '*.254' must not take 169.254.169.254, nor '*.0.0.1' 127.0.0.1.
            return host.endswith(self.host[1:]) and len(host) > len(self.host) - 1 and not _ip_literal(host)
        return host == self.host

    def matches_path(self, path: str) -> bool:
        return fnmatchcase(path, self.path)


_DNS_NAME = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*")


def _ipv6_literal(host: str) -> bool:
    return host.startswith("[") and host.endswith("]") and ":" in host and _ip_literal(host)


def _ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="AFFIDAVIT_",
        env_nested_delimiter="__",
        extra="forbid",
        populate_by_name=True,
    )

    proxy: ProxySection = ProxySection()
    api: ApiSection = ApiSection()
    database: DatabaseSection = DatabaseSection()
    upstream: UpstreamSection = UpstreamSection()
    crypto: CryptoSection = CryptoSection()
    recovery: RecoverySection = RecoverySection()
    log: LogSection = LogSection()
    agents: list[Agent] = Field(default_factory=list)
    secrets: list[Secret] = Field(default_factory=list)
    routes: list[Route] = Field(default_factory=list)

    #: Set by :func:`load_settings` for the duration of one construction.
    _toml_path: ClassVar[Path | None] = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if cls._toml_path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=cls._toml_path))
        return tuple(sources)

    @model_validator(mode="after")
    def _references(self) -> "Settings":
        agents = _unique("agents", [a.name for a in self.agents])
        secrets = _unique("secrets", [s.name for s in self.secrets])
        _unique("routes", [r.name for r in self.routes])
        for i, route in enumerate(self.routes):
            for agent in route.agents:
                if agent not in agents:
                    raise ValueError(f"routes[{i}].agents: no agent named {agent!r} in [[agents]]")
            if route.credential is not None and route.credential not in secrets:
                raise ValueError(f"routes[{i}].credential: no secret named {route.credential!r} in [[secrets]]")
        return self

    def secret(self, name: str) -> Secret:
        return next(s for s in self.secrets if s.name == name)


def _unique(section: str, names: list[str]) -> set[str]:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{section}: the name {name!r} is used twice" if section else f"the name {name!r} is used twice")
        seen.add(name)
    return seen


#: The sections the checks across sections (Settings._references) read.
CROSS_CHECKED = ("agents", "secrets", "routes")


class ConfigError(Exception):
    """The configuration cannot be used. The message names the source, the key and the reason."""


def load_settings(path: Path | None = None, **overrides: Any) -> Settings:
    """Read ``path`` (if it exists or was asked for) and the environment; validate everything."""
    toml_path: Path | None = None
    if path is not None:
        if path.is_dir():
            raise ConfigError(f"{path}: a directory, not a configuration file (name the TOML file in it)")
        if not path.exists():
            raise ConfigError(f"{path}: no such configuration file")
        if not (path.is_file() or path.is_char_device()):  # /dev/null: no settings but the defaults and AFFIDAVIT_*
            raise ConfigError(f"{path}: not a regular file (a FIFO or a socket?); name the TOML file itself")
        toml_path = path
    elif DEFAULT_CONFIG.is_file():
        toml_path = DEFAULT_CONFIG
    text = ""
    if toml_path is not None:
        try:
            text = toml_path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            line = toml_path.read_bytes()[:exc.start].count(b"\n") + 1
            raise ConfigError(f"{toml_path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} on line {line}); TOML "
                              "files are UTF-8: save it as UTF-8") from None
        except OSError as exc:
            raise ConfigError(f"{toml_path}: cannot be read: {exc.strerror or exc}") from None
        try:
            tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{toml_path}: not valid TOML: {exc}") from None
    # Variables a source names ("env:AFFIDAVIT_SECRET__PAY") are values, not settings.
    sources = text + " ".join(
        v for k, v in os.environ.items() if k.upper().startswith("AFFIDAVIT_"))
    referenced = set(re.findall(r"env:([A-Za-z_][A-Za-z0-9_]*)", sources))
    typos = [name for name in os.environ if name.upper().startswith("AFFIDAVIT_") and "__" in name
             and name not in referenced
             and name[len("AFFIDAVIT_"):].split("__", 1)[0].lower() not in Settings.model_fields]
    if typos:  # pydantic-settings ignores a variable whose section it does not know
        raise ConfigError(
            f"environment: {', '.join(sorted(typos))}: no such section (a typo? sections: "
            f"{', '.join(k for k in Settings.model_fields if not k.startswith('_'))})"
        )
    Settings._toml_path = toml_path
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, toml_path, EnvSettingsSource(Settings))) from None
    except SettingsError as exc:  # an environment value pydantic-settings could not even parse
        field = exc.args[0].split('"')[1] if exc.args and exc.args[0].count('"') >= 2 else "?"
        names = sorted(k for k in os.environ if k.upper().startswith(f"AFFIDAVIT_{field.upper()}"))
        reason = f"{type(exc.__cause__).__name__}: {exc.__cause__}" if exc.__cause__ else str(exc)
        raise ConfigError(
            f"environment: {', '.join(names) or 'AFFIDAVIT_' + field.upper()}: not valid JSON ({reason}). Lists such as "
            "AFFIDAVIT_AGENTS, AFFIDAVIT_ROUTES and AFFIDAVIT_CRYPTO__KEYS take JSON, e.g. "
            "AFFIDAVIT_CRYPTO__KEYS='[\"k1=file:/run/secrets/key\"]'"
        ) from None
    finally:
        Settings._toml_path = None


def _describe(exc: ValidationError, toml_path: Path | None, env: EnvSettingsSource) -> str:
    """Every problem with its key and the source its value came from: the environment overrides
    the file, so a stale variable must not be blamed on a file that is right."""
    errors = [(error, _origin(error["loc"], toml_path, env)) for error in exc.errors()]
    sources = {source for _, source in errors}
    file = str(toml_path) if toml_path is not None else None
    if sources == {file}:
        where = file
    elif file in sources or None in sources:
        where = f"{file} and environment"
    else:
        where = "environment"
    lines = [f"{where}: invalid configuration ({exc.error_count()} problem(s)); nothing was done:"]
    for error, source in errors:
        key = _key(error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown key (a typo? every key is in docs/configuration.md)"
        if source == where:
            label = key or "(top level)"
        else:
            named = f"{file} and AFFIDAVIT_* variables together" if source is None else source
            label = f"{key} (from {named})" if key else f"(top level, from {named})"
        lines.append(f"  {label}: {message}")
    return "\n".join(lines)


def _origin(loc: tuple[Any, ...], toml_path: Path | None, env: EnvSettingsSource) -> str | None:
    """Where the value at ``loc`` came from, as pydantic-settings read the environment: the
    variable that set it or the section or list around it (``AFFIDAVIT_PROXY__WORKERS`` for
    proxy.workers, ``AFFIDAVIT_ROUTES`` for routes[0].host), else the file. None when both had a
    part in it (a check across sections, say, of routes from the environment and agents from the file)."""
    loc = tuple(part for part in loc if not (isinstance(part, str) and part.startswith(("function-", "constrained-"))))
    keys = list(itertools.takewhile(lambda part: isinstance(part, str), loc))
    spelled = {name if env.case_sensitive else name.lower(): name for name in os.environ}
    from_env: Any = env()  # what the environment sets, and only that
    for depth in range(len(keys), 0, -1):
        name = env.env_prefix + env.env_nested_delimiter.join(keys[:depth])
        name = name if env.case_sensitive else name.lower()
        if name in env.env_vars:
            # A variable that sets a section as JSON (AFFIDAVIT_PROXY='{...}') is merged with the
            # file's section: it set this key only if its JSON has it. A list it sets whole.
            if depth == len(keys) or _holds(from_env, keys):
                return spelled.get(name, name)
            break
    if toml_path is None:
        return "environment"
    if not loc:  # a check across sections: of those it reads, did the environment set any?
        return None if any(section in from_env for section in CROSS_CHECKED) else str(toml_path)
    beneath = from_env  # a check of a whole section or item: did the environment set part of it?
    for part in loc:
        try:
            beneath = beneath[part]
        except (KeyError, IndexError, TypeError):
            return str(toml_path)
    return None if beneath else str(toml_path)


def _holds(data: Any, keys: list[str]) -> bool:
    for key in keys:
        if not isinstance(data, dict) or key not in data:
            return False
        data = data[key]
    return True


def _key(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.startswith(("function-", "constrained-")):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def redact_url(url: str) -> str:
    """``database.url`` fit for messages: any password masked, and a SQLite file's path as it is
    on disk (SQLAlchemy would percent-encode a path with letters outside ASCII, a path no operator
    can find by eye). Something that is no URL at all shows as nothing of it."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return "the given database"
    shown = parsed.render_as_string(hide_password=True)
    if parsed.get_backend_name() == "sqlite" and parsed.database:
        _, mark, query = shown.partition("?")
        return f"{parsed.drivername}:///{parsed.database}{mark}{query}"
    return shown
