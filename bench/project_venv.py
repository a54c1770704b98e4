"""Let ``python bench/<script>.py`` work from any Python: re-execute in the project's venv.

No imports beyond the standard library, so a script can call it before importing anything the
venv provides."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def reexec_in_project_venv(script: str) -> None:
    """Re-execute ``script`` (with the same arguments) under ``<repo>/.venv/bin/python``, unless
    this already is that venv, there is none, or ``AFFIDAVIT_BENCH_NO_REEXEC`` is set."""
    venv = REPO / ".venv"
    python = venv / "bin" / "python"
    if os.environ.get("AFFIDAVIT_BENCH_NO_REEXEC") or not python.exists():
        return
    if Path(sys.prefix).resolve() == venv.resolve():
        return
    os.environ["AFFIDAVIT_BENCH_NO_REEXEC"] = "1"
    os.execv(str(python), [str(python), str(Path(script).resolve()), *sys.argv[1:]])
