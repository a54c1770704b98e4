"""The docs must not lie: the README's commands are the ones CI and users run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```sh\n(python3 -m venv[^\n]+)\n```", text)


def test_readme_starts_with_the_two_commands():
    run, test = readme_commands()[:2]
    assert run.endswith("affidavit run --example")
    assert "pip install -e '.[dev]'" in test and test.endswith("pytest")


def test_ci_runs_the_readme_test_command_verbatim():
    test = readme_commands()[1]
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test in lines


def test_every_doc_the_readme_links_exists():
    text = (ROOT / "README.md").read_text()
    for link in re.findall(r"\]\((docs/[^)]+)\)", text):
        assert (ROOT / link).is_file(), link


def test_ci_runs_the_readme_mitmproxy_12_command_when_it_can():
    """The same venv, install and test modules as the README's command for Python 3.12."""
    text = (ROOT / "README.md").read_text()
    [command] = re.findall(r"```sh\npython3\.12( -m venv[^\n]+)\n```", text)
    ci = (ROOT / ".ci" / "run").read_text()
    assert f'"$next_python"{command}\n' in ci
    assert "mitmproxy 12 line was NOT tested" in ci, "a machine without Python 3.12 says so"
