"""The example configuration `affidavit run --example` writes on a fresh machine."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from urllib.parse import quote

EXAMPLE = """\
# Affidavit example configuration, written by `affidavit run --example`.
# Reference: docs/configuration.md. Every value can be overridden with AFFIDAVIT_* variables.

[proxy]
listen = "127.0.0.1:8080"
confdir = @confdir@            # the broker's CA certificate and key live here

[api]
listen = "127.0.0.1:8081"
operator_token = @operator_token@

[database]
url = @database@   # production: postgresql+asyncpg://user@host/db

[upstream]
ca_bundle = ""                    # extra CA file for upstream TLS (system store otherwise)
connect_timeout = "10s"
response_timeout = "60s"

[[agents]]
name = "builder"
token = @builder_token@

[[secrets]]
name = "github-token"
from = "env:GITHUB_TOKEN"         # export GITHUB_TOKEN=... before `affidavit run`

[[routes]]
name = "github.read"
host = "api.github.com"
port = 443
methods = ["GET", "HEAD"]
path = "/*"
agents = ["builder"]
credential = "github-token"
inject = { header = "Authorization", value = "Bearer {secret}" }
"""


def example_text(home: str) -> str:
    """The example with its files (tokens, CA, journal) under ``home``: ``"."`` when the file is
    written in the working directory, else that file's directory, named absolutely, since the
    broker reads relative paths from the directory it is started in."""
    def quoted(value: str) -> str:
        return json.dumps(value, ensure_ascii=False)  # a TOML basic string (no surrogate escapes)

    prefix = "" if home == "." else home.rstrip("/") + "/"
    secrets_dir = f"{prefix}.affidavit"
    text = EXAMPLE
    for name, value in (
        ("confdir", secrets_dir),
        ("operator_token", f"file:{secrets_dir}/operator.token"),
        ("builder_token", f"file:{secrets_dir}/builder.token"),
        ("database", f"sqlite+aiosqlite:///{quote(prefix, safe='/') or './'}affidavit.db"),  # '?', '%' in a URL
    ):
        text = text.replace(f"@{name}@", quoted(value))
    return text


def write_example(path: Path) -> tuple[Path, list[str]] | None:
    """Write the example and fresh random tokens, unless a configuration already exists: the
    directory the tokens are in and the token files that were there already (kept, not
    replaced), or None."""
    if path.exists():
        return None
    home = path.parent.resolve()
    here = home == Path.cwd().resolve()
    secrets_dir = home / ".affidavit"
    secrets_dir.mkdir(parents=True, exist_ok=True)
    kept = []
    for name in ("builder.token", "operator.token"):
        token_file = secrets_dir / name
        if token_file.exists():
            kept.append(name)
        else:
            token_file.write_text(secrets.token_urlsafe(24) + "\n")
            token_file.chmod(0o600)
    path.write_text(example_text("." if here else str(home)))
    return (Path(".affidavit") if here else secrets_dir), kept
