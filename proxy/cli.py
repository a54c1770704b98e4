"""The ``affidavit`` command line (typer)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .cli_operator import ConfigOption, approvals_app, invocations_app, metrics, reconcile, settings_or_exit
from .cli_security import audit_app, keys_app, secrets_app
from .config import DEFAULT_CONFIG, ConfigError

app = typer.Typer(
    help="Affidavit: an HTTP(S) forward proxy for AI agents that tells the truth about remote effects.",
    no_args_is_help=True,
    add_completion=False,
)
db_app = typer.Typer(help="The journal database.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(invocations_app, name="invocations")
app.command("metrics")(metrics)
app.add_typer(approvals_app, name="approvals")
app.command("reconcile")(reconcile)
app.add_typer(secrets_app, name="secrets")
app.add_typer(audit_app, name="audit")
app.add_typer(keys_app, name="keys")

def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"affidavit {version('affidavit')}")
        except PackageNotFoundError:
            typer.echo("affidavit (not installed: run from a source tree)")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    config: Annotated[
        Optional[Path],
        typer.Option("--config", "-c", help="TOML configuration file for the command that follows (as AFFIDAVIT_CONFIG; "
                     "the command's own --config wins)."),
    ] = None,
) -> None:
    """Affidavit: an HTTP(S) forward proxy for AI agents that tells the truth about remote effects."""
    # Before the command: click parses the command's own options after this callback, so the
    # command reads it through its --config's environment variable (and workers inherit it).
    if config is not None:
        os.environ["AFFIDAVIT_CONFIG"] = str(config)


@app.command()
def run(
    config: ConfigOption = None,
    example: Annotated[bool, typer.Option("--example", help="Write an example configuration first if none exists.")] = False,
    workers: Annotated[
        Optional[int], typer.Option(min=1, max=64, help="Broker processes sharing the ports (default: proxy.workers).")
    ] = None,
    worker_index: Annotated[Optional[int], typer.Option(hidden=True, help="Internal: run as this worker.")] = None,
) -> None:
    """Start the broker: the proxy and the side API."""
    from .app import run as run_broker
    from .failpoints import PROBLEM

    if PROBLEM is not None:
        typer.echo(f"affidavit: cannot start: {PROBLEM}", err=True)
        raise typer.Exit(2)

    _optimized()
    if example:
        from .example import write_example

        written = write_example(config or DEFAULT_CONFIG)
        if written is None:
            typer.echo(f"affidavit: {config or DEFAULT_CONFIG} exists; --example left it as it is and runs it")
        else:
            tokens, kept = written
            reused = f"; {' and '.join(kept)} {'was' if len(kept) == 1 else 'were'} there already and kept" if kept else ""
            typer.echo(f"affidavit: wrote an example configuration to {config or DEFAULT_CONFIG} (tokens in {tokens}/{reused})")
    settings = settings_or_exit(config, quiet=worker_index is not None)
    count = workers if workers is not None else settings.proxy.workers
    try:
        if count > 1 and worker_index is None:
            from .app import StartupError, prepare_database, resolve_tokens
            from .crypto import KeyRing
            from .workers import supervise

            # Everything a worker would refuse, refused once, before any worker starts.
            resolve_tokens(settings)
            KeyRing.from_settings(settings.crypto)
            try:
                prepare_database(settings)
            except StartupError as exc:
                typer.echo(f"affidavit: cannot start: {exc}", err=True)
                raise typer.Exit(1) from None
            code = supervise(settings, config, count)
        else:
            code = run_broker(settings, worker=worker_index)
    except ConfigError as exc:
        typer.echo(f"affidavit: {exc}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


@app.command()
def env(
    config: ConfigOption = None,
    agent: Annotated[Optional[str], typer.Option(help="Agent name for the proxy URL (default: the first agent).")] = None,
    token: Annotated[
        Optional[str], typer.Option(help="Token to print literally (default: read from the agent's configured source).")
    ] = None,
) -> None:
    """Print the exports an agent needs (proxy URL and the broker's CA for curl, Python, Node)."""
    from .app import env_lines

    settings = settings_or_exit(config)
    if agent is None and not settings.agents:
        # Exports for a made-up 'AGENT' with the token 'TOKEN' would only fail later, as 407s.
        typer.echo("affidavit: no [[agents]] are configured, so the proxy refuses every request; add one "
                   "(docs/configuration.md), then run this again", err=True)
        raise typer.Exit(2)
    if agent is None:
        agent = settings.agents[0].name
    names = [a.name for a in settings.agents]
    if agent is not None and token is None and agent not in names:  # with --token the name is taken as given
        # A typo here would only show later, as 407s from the proxy.
        typer.echo(f"affidavit: no agent {agent!r} in the configuration (agents: {', '.join(names) or 'none'})", err=True)
        raise typer.Exit(2)
    for line in env_lines(settings, agent, token):
        typer.echo(line)
    # The exports are printed either way (a script may run this before the broker's first start);
    # what they name that is not there is said, not left to fail later as a CA error or a 407.
    from .app import ca_path

    if not ca_path(settings).is_file():
        typer.echo(f"affidavit: warning: no CA at {ca_path(settings)} yet: the first `affidavit run` with this configuration "
                   "creates it; if the broker already runs, this is not its directory or configuration (relative paths "
                   "are read from the working directory)", err=True)
    configured = next((a for a in settings.agents if a.name == agent), None)
    if token is None and configured is not None and configured.token.startswith("file:"):
        path = Path(configured.token.partition(":")[2]).absolute()
        if not path.is_file():
            typer.echo(f"affidavit: warning: agent {agent!r}'s token file {path} does not exist: the exported proxy URL "
                       "reads it; run this where the broker runs, or pass its --config", err=True)


@app.command()
def ca(config: ConfigOption = None, pem: Annotated[bool, typer.Option(help="Print the certificate itself.")] = False) -> None:
    """Print the path of the broker's CA certificate (agents must trust it)."""
    from .app import ca_path

    settings = settings_or_exit(config)
    path = ca_path(settings)
    if not path.is_file():
        confdir = settings.proxy.confdir
        where = (
            f"`proxy.confdir` ({confdir}) is relative, so it was looked up from this directory: "
            "run this in the broker's working directory, or make confdir absolute."
            if not confdir.is_absolute()
            else "If the broker runs with another configuration, pass its --config."
        )
        typer.echo(f"affidavit: no CA at {path}: the first `affidavit run` with this configuration creates it. {where}", err=True)
        raise typer.Exit(1)
    if pem:
        sys.stdout.buffer.write(path.read_bytes())  # the file as it is, byte for byte
        sys.stdout.flush()
    else:
        typer.echo(str(path))


@db_app.command("upgrade")
def db_upgrade(config: ConfigOption = None) -> None:
    """Bring the journal's schema to the version this broker needs."""
    from .app import schema_revision
    from .config import redact_url
    from .store import migrate

    settings = settings_or_exit(config)
    if (problem := migrate.sqlite_file_problem(settings.database.url)) is not None:
        typer.echo(f"affidavit: cannot upgrade database.url {redact_url(settings.database.url)}: {problem}", err=True)
        raise typer.Exit(1)
    database = migrate.sqlite_file(settings.database.url)
    new_file = database is not None and not Path(database).exists()
    try:
        if not new_file:
            schema_revision(settings.database.url)  # a newer broker's: refused as `run` does
        # What it was at, read under the upgrade's lock: a concurrent upgrade's work is not claimed.
        before = migrate.upgrade(settings.database.url)
    except ConfigError as exc:
        typer.echo(f"affidavit: {exc}", err=True)
        raise typer.Exit(2) from None
    except Exception as exc:
        from .store import queries
        from .store.journal import brief

        # What to check, as the read commands say it (the database name, the server, the role).
        advice = f"; {queries.what_to_check(exc)}, then run it again" if queries.unreachable(exc) else ""
        typer.echo(f"affidavit: could not upgrade {redact_url(settings.database.url)}: {brief(exc)}{advice}", err=True)
        raise typer.Exit(1) from None
    head, url = migrate.head(), redact_url(settings.database.url)
    if before is None and new_file:
        done = f"created the journal file {migrate.sqlite_where(database)}"  # type: ignore[arg-type]
    elif before is None:
        done = "created the journal's schema"
    elif before == head:
        done = "nothing to do"
    else:
        done = f"upgraded from revision {before}"
    typer.echo(f"affidavit: {done}; {url} is at revision {head}{' already' if before == head else ''}")


def _optimized() -> None:
    """Serve under ``python -O``: mitmproxy type-checks every request and response it builds
    while ``__debug__`` is true (a development aid that costs a third of its CPU per request).
    The broker's own code never relies on ``assert``. Same process (exec), same PID.
    ``AFFIDAVIT_DEBUG_CHECKS=1`` keeps the checks."""
    if sys.flags.optimize or os.environ.get("AFFIDAVIT_DEBUG_CHECKS") == "1":
        return
    os.execv(sys.executable, [sys.executable, "-O", "-m", "proxy", *sys.argv[1:]])


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
