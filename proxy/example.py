"""The example configuration `affidavit run --example` writes on a fresh machine."""

from __future__ import annotations

import secrets
from pathlib import Path

EXAMPLE = """\
# Affidavit example configuration, written by `affidavit run --example`.
# Reference: docs/configuration.md. Every value can be overridden with AFFIDAVIT_* variables.

[proxy]
listen = "127.0.0.1:8080"
confdir = ".affidavit"            # the broker's CA certificate and key live here

[api]
listen = "127.0.0.1:8081"
operator_token = "file:.affidavit/operator.token"

[database]
url = "sqlite+aiosqlite:///./affidavit.db"   # production: postgresql+asyncpg://user@host/db

[upstream]
ca_bundle = ""                    # extra CA file for upstream TLS (system store otherwise)
connect_timeout = "10s"
response_timeout = "60s"

[[agents]]
name = "builder"
token = "file:.affidavit/builder.token"

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


def write_example(path: Path) -> bool:
    """Write the example and fresh random tokens, unless a configuration already exists."""
    if path.exists():
        return False
    secrets_dir = path.parent / ".affidavit"
    secrets_dir.mkdir(parents=True, exist_ok=True)
    for name in ("builder.token", "operator.token"):
        token_file = secrets_dir / name
        if not token_file.exists():
            token_file.write_text(secrets.token_urlsafe(24) + "\n")
            token_file.chmod(0o600)
    path.write_text(EXAMPLE)
    return True
