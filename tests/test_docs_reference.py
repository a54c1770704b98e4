"""The reference docs must cover the code: every setting, command, API call and code, and their
examples must load. These tests read the code's own models (settings, the typer app, the OpenAPI
schema, the closed enums), so a new key, command, path or code without docs fails here."""

from __future__ import annotations

import json
import os
import re
import tomllib
import typing
from pathlib import Path
from typing import Annotated, Any, Iterator

import pytest
import typer
from pydantic import BaseModel, TypeAdapter

from proxy.config import Route, Settings, load_settings
from proxy.contract import Code
from proxy.envelope import STATUS
from proxy.routing import match_route

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def doc(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


# -- sections of a markdown page ---------------------------------------------------------------

_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$", re.M)
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _headings(text: str) -> list[tuple[int, int, str]]:
    """(offset, level, title) of every heading outside fenced code blocks."""
    fenced = [(m.start(), m.end()) for m in _FENCE.finditer(text)]
    return [
        (m.start(), len(m.group(1)), m.group(2))
        for m in _HEADING.finditer(text)
        if not any(a <= m.start() < b for a, b in fenced)
    ]


def section(text: str, title: str, *, where: str) -> str:
    """The text under the heading whose title is exactly ``title``, up to the next heading of the
    same or a higher level (sub-sections included)."""
    heads = _headings(text)
    found = [(i, h) for i, h in enumerate(heads) if h[2] == title]
    assert len(found) == 1, f"{where}: expected exactly one heading {title!r}, found {len(found)}"
    i, (start, level, _) = found[0]
    end = next((h[0] for h in heads[i + 1 :] if h[1] <= level), len(text))
    return text[start:end]


# -- configuration.md: every setting, with a default that matches the model --------------------


def _model_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """(the BaseModel inside an annotation, whether it is a list of them)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    origin = typing.get_origin(annotation)
    for arg in typing.get_args(annotation):
        model, _ = _model_of(arg)
        if model is not None:
            return model, origin is list
    return None, False


def _settings_sections() -> Iterator[tuple[list[str], str, type[BaseModel]]]:
    """(heading path in configuration.md, description, model) for every section model."""
    for name, field in Settings.model_fields.items():
        model, is_list = _model_of(field.annotation)
        assert model is not None, f"Settings.{name} is not a section or a list of tables"
        heading = f"`[[{name}]]`" if is_list else f"`[{name}]`"
        yield [heading], name, model
        for sub_name, sub_field in model.model_fields.items():
            sub_model, _ = _model_of(sub_field.annotation)
            if sub_model is not None:
                yield [heading, f"`{sub_field.alias or sub_name}`"], f"{name}.{sub_name}", sub_model


def _own(body: str) -> str:
    """A section's own text, without its sub-sections."""
    heads = _headings(body)
    return body[: heads[1][0]] if len(heads) > 1 else body


def _rows(text: str) -> dict[str, list[str]]:
    """Table rows keyed by their first cell's backticked key(s): ``| `a`, `b` | x | y |``."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for key in re.findall(r"`([^`]+)`", cells[0]):
            rows[key] = cells
    return rows


def _documented_default(cell: str) -> tuple[str, Any] | None:
    """('required'|'none'|'value', parsed) for a default cell we can check; None for prose."""
    if cell == "required":
        return "required", None
    if cell.startswith("none"):
        return "none", None
    literal = re.fullmatch(r"`([^`]+)`", cell)
    if literal is None:
        return None
    try:
        return "value", tomllib.loads(f"v = {literal.group(1)}")["v"]
    except tomllib.TOMLDecodeError:
        return None


def test_every_setting_is_documented_with_a_matching_default():
    text = doc("configuration.md")
    checked = 0
    for path, where, model in _settings_sections():
        body = text
        for title in path:
            body = section(body, title, where=f"docs/configuration.md [{where}]")
        rows = _rows(_own(body))
        for name, field in model.model_fields.items():
            key = field.alias or name
            assert key in rows, f"docs/configuration.md: [{where}] has no table row for `{key}`"
            cells = rows[key]
            if len(cells) < 3:
                continue  # a table without a default column
            documented = _documented_default(cells[1])
            if documented is None:
                continue
            kind, value = documented
            if kind == "required":
                assert field.is_required(), f"docs/configuration.md: [{where}] `{key}` is documented as required but has a default"
                continue
            assert not field.is_required(), f"docs/configuration.md: [{where}] `{key}` is required, the docs give a default"
            default = field.get_default(call_default_factory=True)
            if kind == "none":
                assert default is None, f"docs/configuration.md: [{where}] `{key}` defaults to {default!r}, not none"
                continue
            adapter = TypeAdapter(Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation)
            assert adapter.validate_python(value) == default, (
                f"docs/configuration.md: [{where}] `{key}` is documented with default {cells[1]}, the model has {default!r}"
            )
            checked += 1
    assert checked >= 25, "the default check compared suspiciously few defaults"


def test_every_section_heading_names_a_setting():
    """No documented section that the model does not have (a renamed or removed section)."""
    text = doc("configuration.md")
    sections = {name for name in Settings.model_fields}
    for _, level, title in _headings(text):
        match = re.fullmatch(r"`\[\[?(\w+)\]?\]`", title)
        if level == 2 and match:
            assert match.group(1) in sections, f"docs/configuration.md documents [{match.group(1)}], which the settings model lacks"


# -- cli.md: every command path and option -------------------------------------------------------


def _commands() -> Iterator[tuple[str, Any]]:
    """(command path, click command) for every leaf command. Typer may bring its own copy of
    click, so groups and options are recognised by shape, not by class."""
    from proxy.cli import app

    root = typer.main.get_command(app)

    def walk(command: Any, prefix: str) -> Iterator[tuple[str, Any]]:
        if isinstance(getattr(command, "commands", None), dict):
            for name, sub in command.commands.items():
                yield from walk(sub, f"{prefix} {name}".strip())
        else:
            yield prefix, command

    yield from walk(root, "")


def test_every_command_and_option_is_documented():
    text = doc("cli.md")
    intro = text[: _headings(text)[1][0]]
    assert "`--config PATH`" in intro and "AFFIDAVIT_CONFIG" in intro, "docs/cli.md: the common --config option"
    paths = []
    for path, command in _commands():
        paths.append(path)
        body = section(text, f"`affidavit {path}`", where=f"docs/cli.md (affidavit {path})")
        for param in command.params:
            if getattr(param, "param_type_name", None) != "option":
                continue
            names = [o for o in param.opts if o.startswith("--") and o not in ("--help", "--config")]
            for name in names:
                assert f"`{name}" in body, f"docs/cli.md: option {name} of `affidavit {path}` is not documented in its section"
        assert "```sh" in body, f"docs/cli.md: `affidavit {path}` has no example"
    for expected in ("run", "env", "ca", "db upgrade", "invocations list", "invocations show", "invocations result",
                     "metrics", "approvals list", "approvals approve", "approvals deny", "reconcile", "secrets set",
                     "secrets list", "secrets rotate", "audit verify", "audit export", "keys generate"):
        assert expected in paths, f"the CLI has no `affidavit {expected}` any more; update docs/cli.md and this test"


# -- api.md: every OpenAPI path and method ---------------------------------------------------------


@pytest.fixture(scope="module")
def openapi(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from proxy.api import create_app
    from proxy.store.journal import Journal, make_engine

    db = tmp_path_factory.mktemp("docs-api") / "journal.db"
    engine = make_engine(f"sqlite+aiosqlite:///{db}")
    app = create_app(engine, {"builder": "t"}, "o", Journal(engine, writer="docs-test"))
    return app.openapi()


def test_every_api_path_and_method_is_documented(openapi: dict[str, Any]):
    text = doc("api.md")
    seen = 0
    for path, methods in openapi["paths"].items():
        for method, operation in methods.items():
            title = f"`{method.upper()} {path}`"
            body = section(text, title, where=f"docs/api.md ({title})")
            assert re.search(r"^Who: ", body, re.M), f"docs/api.md: {title} does not say who may call it"
            for parameter in operation.get("parameters", []):
                if parameter["in"] == "query":
                    assert f"`{parameter['name']}`" in body, f"docs/api.md: query parameter {parameter['name']} of {title}"
            for status in operation.get("responses", {}):
                assert re.search(rf"\b{status}\b", body), f"docs/api.md: {title} does not describe answer {status}"
            if "requestBody" in operation:
                ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
                for field in openapi["components"]["schemas"][ref]["properties"]:
                    assert f"`{field}`" in body or f'"{field}"' in body, f"docs/api.md: body field {field} of {title}"
            seen += 1
    assert seen >= 9
    assert "`GET /openapi.json`" in text


# -- troubleshooting.md: every code, with its HTTP status ------------------------------------------


def test_every_code_is_in_troubleshooting_with_its_status():
    text = doc("troubleshooting.md")
    for code in Code:
        body = section(text, f"`{code.value}`", where=f"docs/troubleshooting.md ({code.value})")
        status = STATUS.get(code, 502)
        lines = body.splitlines()
        header = next((i for i, line in enumerate(lines) if line.startswith("| phase | outcome | HTTP |")), None)
        assert header is not None, f"docs/troubleshooting.md: {code.value} has no phase/outcome/HTTP table"
        cells = dict(zip(
            [c.strip() for c in lines[header].strip("|").split("|")],
            [c.strip() for c in lines[header + 2].strip("|").split("|")],
        ))
        assert re.match(rf"{status}\b", cells["HTTP"]), (
            f"docs/troubleshooting.md: {code.value} gives HTTP {cells['HTTP']!r}; proxy/envelope.py STATUS says {status}"
        )
        for part in ("**Agent:**", "**Operator:**"):
            assert part in body, f"docs/troubleshooting.md: {code.value} does not say what the {part.strip('*:').lower()} does"


def test_troubleshooting_documents_no_code_that_does_not_exist():
    text = doc("troubleshooting.md")
    codes = {c.value for c in Code}
    for _, level, title in _headings(text):
        match = re.fullmatch(r"`([A-Z_]+)`", title)
        if level == 3 and match:
            assert match.group(1) in codes, f"docs/troubleshooting.md documents {match.group(1)}, which is not a Code"


# -- recipes.md: every TOML block is a configuration that loads -------------------------------------


def _toml_blocks(text: str) -> list[str]:
    return re.findall(r"^```toml\n(.*?)^```", text, re.M | re.S)


def test_recipes_have_three_complete_configurations_that_load(tmp_path, monkeypatch):
    for name in [k for k in os.environ if k.startswith("AFFIDAVIT_")]:
        monkeypatch.delenv(name)
    blocks = _toml_blocks(doc("recipes.md"))
    assert len(blocks) >= 3, "docs/recipes.md: expected a configuration per recipe"
    loaded = []
    for i, block in enumerate(blocks):
        data = tomllib.loads(block)
        for source in re.findall(r'"env:(\w+)"', block):
            monkeypatch.setenv(source, f"docs-test-{source.lower()}")
        path = tmp_path / f"recipe-{i}.toml"
        path.write_text(block, encoding="utf-8")
        settings = load_settings(path)
        assert settings.agents and settings.routes, f"docs/recipes.md block {i + 1}: no agents or routes"
        assert data.get("routes"), f"docs/recipes.md block {i + 1} is not a whole configuration"
        for route in settings.routes:
            if route.lookup is not None:
                _lookup_goes_through_a_route(settings.routes, route, f"docs/recipes.md block {i + 1}")
        loaded.append(settings)
    routes = [r for s in loaded for r in s.routes]
    assert any(r.idempotency is not None and r.lookup is not None for r in routes), "recipe: payments with idempotency and lookup"
    assert any(r.inject is not None and set(r.methods) <= {"GET", "HEAD"} for r in routes), "recipe: read-only injected token"
    assert any(r.approval for r in routes), "recipe: approvals"


def _lookup_goes_through_a_route(routes: list[Route], route: Route, where: str) -> None:
    """The lookup is sent through the broker as the same agent: some route must allow it."""
    assert route.lookup is not None
    path = route.lookup.path.replace("{key}", "k").replace("{invocation_id}", "act_x").replace("{job_ref}", "j")
    host = route.host.replace("*", "x")
    for agent in route.agents:
        found = match_route(routes, agent, route.effective_scheme, host, route.port, route.lookup.method, path)
        assert isinstance(found, Route), f"{where}: the lookup of route {route.name!r} is not allowed by any route: {found}"


# -- links ------------------------------------------------------------------------------------------

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(title: str) -> str:
    """GitHub's anchor for a heading."""
    title = re.sub(r"[^\w\- ]", "", title.strip().lower().replace("`", ""))
    return title.replace(" ", "-")


def _pages() -> list[Path]:
    return sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_every_relative_link_points_to_an_existing_file_and_heading(page: Path):
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # https:, mailto:
        file_part, _, anchor = target.partition("#")
        destination = (page.parent / file_part).resolve() if file_part else page
        assert destination.exists(), f"{page.relative_to(ROOT)}: link to {target} points to nothing"
        if anchor and destination.suffix == ".md":
            anchors = {_slug(title) for _, _, title in _headings(destination.read_text(encoding="utf-8"))}
            assert anchor in anchors, f"{page.relative_to(ROOT)}: link to {target}: no such heading in {destination.name}"


def test_the_readme_links_every_doc_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in sorted(DOCS.glob("*.md")):
        assert f"(docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"
    table = readme[readme.index("| page | what |") :]
    assert re.search(r"^\| \[docs/quickstart\.md\]", table.split("\n", 2)[2], re.M), "README: the quickstart is not first"


# -- envelope.schema.json: its closed enums are the contract's ------------------------------------


def test_the_envelope_schema_enums_are_the_contracts():
    from proxy.contract import Outcome, Phase, Retry

    schema = json.loads((DOCS / "envelope.schema.json").read_text())
    error = schema["properties"]["error"]["properties"]
    attempt_codes = schema["properties"]["evidence"]["properties"]["attempts"]["items"]["properties"]["code"]["enum"]
    for name, listed, members in (
        ("error.code", error["code"]["enum"], Code),
        ("evidence.attempts[].code", attempt_codes, Code),
        ("error.phase", error["phase"]["enum"], Phase),
        ("error.outcome", error["outcome"]["enum"], Outcome),
        ("error.retry", error["retry"]["enum"], Retry),
    ):
        assert sorted(listed) == sorted(m.value for m in members), (
            f"docs/envelope.schema.json {name} is out of step with proxy/contract.py"
        )
