"""deploy/ must say what it does: container image, compose file, Kubernetes manifests, systemd unit.

No container engine runs here, so every file is checked as far as a machine without one allows:

* every YAML file parses; the compose file's structure is checked (start order, two replicas on
  one database, one CA, one configuration, the secrets each `file:` source needs, ports);
* the Kubernetes manifests validate against the Kubernetes OpenAPI schemas (kubernetes-validate,
  offline, strict: unknown fields fail) and `kubectl kustomize` renders them;
* the systemd unit passes `systemd-analyze verify`, and a parser checks what it must contain;
* the Dockerfile is checked structurally, the wheel its build stage makes is built from exactly
  what it copies and must carry the migrations, and its HEALTHCHECK command runs against a broker;
* the configurations load with the broker's own settings code;
* most important, the commands the compose file runs (ca-init, migrate, two brokers with the
  environment compose gives them) are read out of compose.yaml and run by hand against the
  machine's PostgreSQL: both replicas journal into one database, and an invocation one replica
  recorded is read (record and result) through the other's side API.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import ssl
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx
import kubernetes_validate
import pytest
import tomli_w
import yaml
from sqlalchemy.engine import make_url

from proxy.config import load_settings, parse_duration
from tests.support.broker import AFFIDAVIT, free_port, free_ports
from tests.support.certs import TestPKI
from tests.support.hostile import HostileUpstream
from tests.support.journal import dispatched_ids, query
from tests.support.pg import fresh_database, require_postgres

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "compose.yaml"
EXAMPLE = DEPLOY / "affidavit.example.toml"
UNIT = DEPLOY / "systemd" / "affidavit.service"

CONFIG = "/etc/affidavit/affidavit.toml"
DATA = "/var/lib/affidavit"
SECRETS = "/run/secrets"
BROKERS = ("broker-a", "broker-b")
#: Files the broker needs in its confdir: exactly what the Kubernetes CA Secret holds.
CA_FILES = {"mitmproxy-ca.pem", "mitmproxy-ca-cert.pem", "mitmproxy-dhparam.pem"}
#: Kubernetes versions the manifests must validate against (oldest still common, newest bundled).
K8S_VERSIONS = ("1.28.0", kubernetes_validate.latest_version())


# ------------------------------------------------------------------------------------ readers


def load_yaml(path: Path) -> list[Any]:
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def compose() -> dict[str, Any]:
    (doc,) = load_yaml(COMPOSE)
    return doc


def services() -> dict[str, Any]:
    return compose()["services"]


def k8s_objects() -> dict[tuple[str, str], dict[str, Any]]:
    objects: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in load_yaml(path):
            objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def example() -> dict[str, Any]:
    return tomllib.loads(EXAMPLE.read_text())


_INTERPOLATION = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, $$."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3)
        current = env.get(name)
        if op in (":-", "-"):
            unset = current is None or (op == ":-" and current == "")
            return arg if unset else current  # type: ignore[return-value]
        if op in (":?", "?"):
            if current is None or (op == ":?" and current == ""):
                raise KeyError(f"compose would refuse to start: {name}: {arg}")
            return current
        return current or ""

    return _INTERPOLATION.sub(one, value)


@dataclass
class Instruction:
    keyword: str
    args: str
    stage: int

    def json(self) -> list[str]:
        value = json.loads(self.args)
        assert isinstance(value, list), f"{self.keyword} should use the JSON (exec) form: {self.args}"
        return value


def dockerfile() -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped (as Docker reads them)."""
    out: list[Instruction] = []
    stage = -1
    pending = ""
    for raw in (DEPLOY / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending = f"{pending} {line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        keyword, _, args = pending.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        out.append(Instruction(keyword, args.strip(), stage))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continuation line"
    return out


def final_stage() -> list[Instruction]:
    instructions = dockerfile()
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for i in final_stage():
        if i.keyword == "ENV":
            for item in shlex.split(i.args):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def one(keyword: str) -> Instruction:
    found = [i for i in final_stage() if i.keyword == keyword]
    assert len(found) == 1, f"the final stage should have exactly one {keyword}: {found}"
    return found[0]


def unit() -> dict[str, list[tuple[str, str]]]:
    """systemd unit sections as ordered (key, value) lists (keys may repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            sections.setdefault(current, [])
            continue
        assert current is not None, f"{UNIT}: {line!r} outside a section"
        key, sep, value = line.partition("=")
        assert sep, f"{UNIT}: {line!r} is not key=value"
        sections[current].append((key.strip(), value.strip()))
    return sections


def unit_values(section: str, key: str) -> list[str]:
    return [v for k, v in unit().get(section, []) if k == key]


def file_sources(config: dict[str, Any]) -> dict[str, str]:
    """Every `file:` source in a configuration: {path: what it is}."""
    found: dict[str, str] = {}
    for agent in config.get("agents", []):
        found[agent["token"]] = f"agents.{agent['name']}.token"
    if config.get("api", {}).get("operator_token"):
        found[config["api"]["operator_token"]] = "api.operator_token"
    for secret in config.get("secrets", []):
        found[secret["from"]] = f"secrets.{secret['name']}"
    for entry in config.get("crypto", {}).get("keys", []):
        key_id, _, source = entry.partition("=")
        found[source] = f"crypto.keys.{key_id}"
    return {source.removeprefix("file:"): what for source, what in found.items() if source.startswith("file:")}


def check_loads(text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> Any:
    """Load a configuration with the broker's own code (no AFFIDAVIT_* variables around)."""
    for key in list(os.environ):
        if key.startswith("AFFIDAVIT_"):
            monkeypatch.delenv(key)
    path = tmp_path / name
    path.write_text(text)
    return load_settings(path)


# ------------------------------------------------------------------------------------ YAML


def test_every_yaml_file_in_deploy_parses():
    files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert COMPOSE in files and len(files) >= 8, files
    for path in files:
        docs = load_yaml(path)
        assert docs, f"{path} holds no document"
        for doc in docs:
            assert isinstance(doc, dict), f"{path}: every document should be a mapping"


# ------------------------------------------------------------------------------------ Dockerfile


def test_dockerfile_structure():
    instructions = dockerfile()
    froms = [i.args.split()[0] for i in instructions if i.keyword == "FROM"]
    assert froms and all(f.startswith("python:3.11-slim") for f in froms), froms

    users = [i.args for i in final_stage() if i.keyword == "USER"]
    assert users, "the image must not run as root: no USER in the final stage"
    user = users[-1].split(":")[0]
    assert user.isdigit() and int(user) != 0, f"USER should be a numeric non-root uid (Kubernetes runAsNonRoot checks it): {users[-1]}"

    health = one("HEALTHCHECK").args
    assert "/healthz" in health and "8081" in health, health

    exposed = {int(p.split("/")[0]) for i in final_stage() if i.keyword == "EXPOSE" for p in i.args.split()}
    assert exposed == {8080, 8081}

    volumes = [v for i in final_stage() if i.keyword == "VOLUME" for v in (i.json() if i.args.startswith("[") else i.args.split())]
    assert DATA in volumes, volumes

    assert one("ENTRYPOINT").json() == ["affidavit"]
    assert one("CMD").json() == ["run", "--config", CONFIG]
    assert one("WORKDIR").args == DATA

    env = image_env()
    assert env["AFFIDAVIT_PROXY__LISTEN"] == "0.0.0.0:8080"
    assert env["AFFIDAVIT_API__LISTEN"] == "0.0.0.0:8081"


def build_copy_sources() -> list[str]:
    """What the build stage copies from the build context (the repository root)."""
    sources: list[str] = []
    for i in dockerfile():
        if i.keyword == "COPY" and "--from" not in i.args:
            parts = i.args.split()
            sources.extend(p for p in parts[:-1] if not p.startswith("--"))
    return sources


def test_dockerfile_copies_only_what_exists_and_the_ignore_file_lets_it_through():
    sources = build_copy_sources()
    assert {"pyproject.toml", "README.md", "proxy", "migrations"} <= set(sources), sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: not in the build context (repository root)"
    rules = [line.strip() for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert rules[0] == "*", "the ignore file is an allow-list"
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    assert set(sources) <= allowed, f"copied but ignored: {set(sources) - allowed}"
    assert not {".venv", ".git"} & allowed


def test_the_image_wheel_carries_the_migrations(tmp_path: Path):
    """Build the wheel from exactly what the Dockerfile copies, install it alone, and run
    `affidavit db upgrade` from it: the schema history must come from inside the package."""
    src = tmp_path / "src"
    src.mkdir()
    for source in build_copy_sources():
        origin = ROOT / source
        if origin.is_dir():
            shutil.copytree(origin, src / source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(origin, src / source)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(tmp_path / "wheels"), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheels").glob("affidavit-*.whl")
    site = tmp_path / "site"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(site), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert installed.returncode == 0, installed.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("AFFIDAVIT_")}
    env["PYTHONPATH"] = str(site)
    where = subprocess.run(
        [sys.executable, "-c", "from proxy.store import migrate; print(migrate.migrations_dir())"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()) == site / "proxy" / "_migrations"
    config = tmp_path / "affidavit.toml"
    config.write_text(f'[database]\nurl = "sqlite+aiosqlite:///{tmp_path / "journal.db"}"\n')
    upgraded = subprocess.run(
        [str(site / "bin" / "affidavit"), "db", "upgrade", "--config", str(config)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert upgraded.returncode == 0, upgraded.stderr
    assert "is at revision" in upgraded.stdout


# ------------------------------------------------------------------------------------ compose


def test_compose_start_order():
    svc = services()
    assert {"postgres", "ca-init", "migrate", *BROKERS, "lb"} <= set(svc), sorted(svc)
    assert svc["postgres"]["image"].startswith("postgres:15")
    assert "synchronous_commit=on" in svc["postgres"]["command"]
    assert svc["postgres"]["healthcheck"]["test"]
    assert svc["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert svc["migrate"]["command"] == ["db", "upgrade", "--config", CONFIG]
    for one_shot in ("migrate", "ca-init"):
        assert svc[one_shot]["restart"] == "no"
    for name in BROKERS:
        depends = svc[name]["depends_on"]
        assert depends["migrate"]["condition"] == "service_completed_successfully", name
        assert depends["ca-init"]["condition"] == "service_completed_successfully", name
        assert svc[name]["command"] == ["run", "--config", CONFIG]
        assert svc[name]["restart"] in ("always", "unless-stopped", "on-failure")


def test_compose_replicas_share_database_configuration_and_ca():
    svc = services()
    a, b = (svc[name] for name in BROKERS)
    for key in ("image", "command", "configs", "secrets", "volumes", "environment"):
        assert a.get(key) == b.get(key), f"{key} differs between the replicas"
    # One configuration file, so one [database] url; nothing overrides it per replica.
    (config,) = a["configs"]
    assert config["target"] == CONFIG
    assert "file" in compose()["configs"][config["source"]]
    assert not any(k.startswith("AFFIDAVIT_DATABASE") for k in a["environment"])
    assert example()["database"]["url"].startswith("postgresql+asyncpg://")
    # One named volume holds the CA (proxy.confdir is below it), the one ca-init writes.
    confdir = example()["proxy"]["confdir"]
    assert confdir.startswith(DATA + "/")
    (volume,) = [v for v in a["volumes"] if v.split(":")[1] == DATA]
    name = volume.split(":")[0]
    assert name in compose()["volumes"], "the CA volume must be a named volume, shared"
    assert f"{name}:{DATA}" in svc["ca-init"]["volumes"]
    assert svc["ca-init"]["entrypoint"][-1] == confdir
    # The migration and the brokers use the same image and the same configuration.
    assert svc["migrate"]["image"] == a["image"] == svc["ca-init"]["image"]
    assert svc["migrate"]["configs"] == a["configs"]


def test_compose_listens_on_all_interfaces_and_publishes_only_the_balancer():
    svc = services()
    env = image_env()
    for name in BROKERS:
        broker_env = svc[name]["environment"]
        assert broker_env["AFFIDAVIT_PROXY__LISTEN"] == env["AFFIDAVIT_PROXY__LISTEN"] == "0.0.0.0:8080"
        assert broker_env["AFFIDAVIT_API__LISTEN"] == env["AFFIDAVIT_API__LISTEN"] == "0.0.0.0:8081"
        assert "ports" not in svc[name], f"{name}: agents reach the brokers through the balancer only"
    published = {tuple(interpolate(p, {}).split(":")[-2:]) for p in svc["lb"]["ports"]}
    assert published == {("8080", "8080"), ("8081", "8081")}, published
    mounts = [v.split(":") for v in svc["lb"]["volumes"]]
    assert ["./haproxy.cfg", "/usr/local/etc/haproxy/haproxy.cfg", "ro"] in mounts
    assert (DEPLOY / "haproxy.cfg").is_file()


def test_compose_secrets_cover_every_file_source_in_the_example():
    needed = file_sources(example())
    assert needed, "the example should take its tokens and keys from files"
    top = compose()["secrets"]
    for path, what in needed.items():
        assert path.startswith(SECRETS + "/"), f"{what}: {path} is not a compose secret path"
        name = path.removeprefix(SECRETS + "/")
        assert name in top, f"{what}: no compose secret {name!r}"
        for broker in BROKERS:
            assert name in services()[broker]["secrets"], f"{broker} does not get secret {name!r}"
    assert "PGPASSWORD" in services()["migrate"]["environment"]
    assert make_url(example()["database"]["url"]).password is None, "no password in the database URL: PGPASSWORD carries it"


def test_compose_refuses_to_start_without_a_database_password():
    value = services()["postgres"]["environment"]["POSTGRES_PASSWORD"]
    with pytest.raises(KeyError):
        interpolate(value, {})
    assert interpolate(value, {"AFFIDAVIT_DB_PASSWORD": "x"}) == "x"


def test_example_configuration_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    settings = check_loads(EXAMPLE.read_text(), tmp_path, monkeypatch, "affidavit.toml")
    assert not settings.database.is_sqlite
    assert settings.database.auto_upgrade is None, "PostgreSQL must not auto-upgrade: `affidavit db upgrade` runs first"


# ------------------------------------------------------------------------------------ HAProxy


def haproxy_sections() -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current = None
    for raw in (DEPLOY / "haproxy.cfg").read_text().splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if not raw[0].isspace():
            current = line.strip()
            sections[current] = []
        else:
            assert current is not None
            sections[current].append(line.strip())
    return sections


def seconds(value: str) -> float:
    number, unit = re.fullmatch(r"(\d+)(ms|s|m|h|d)?", value).groups()  # type: ignore[union-attr]
    return int(number) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 0.001}[unit]


def test_haproxy_balances_tcp_over_both_brokers_and_checks_readiness():
    sections = haproxy_sections()
    defaults = sections["defaults"]
    assert "mode tcp" in defaults
    timeouts = {line.split()[1]: seconds(line.split()[2]) for line in defaults if line.startswith("timeout ")}
    # A silent tunnel waits for the upstream's answer up to response_timeout: do not cut it.
    response_timeout = parse_duration(example()["upstream"]["response_timeout"])
    assert timeouts["client"] > response_timeout and timeouts["server"] > response_timeout, timeouts
    binds = {line.split()[1] for name, lines in sections.items() if name.startswith("frontend") for line in lines if line.startswith("bind")}
    assert binds == {":8080", ":8081"}
    servers = {}
    for name, lines in sections.items():
        if name.startswith("backend"):
            assert "option httpchk" in lines and "http-check send meth GET uri /readyz" in lines, name
            servers[name.split()[1]] = sorted(line.split()[1:] for line in lines if line.startswith("server "))
    assert servers["brokers_proxy"] == [[b, f"{b}:8080", "port", "8081"] for b in BROKERS]
    assert servers["brokers_api"] == [[b, f"{b}:8081"] for b in BROKERS]
    published = services()["lb"]["ports"]
    assert any(p.endswith(":8080:8080") for p in published) and any(p.endswith(":8081:8081") for p in published)


def haproxy_binary() -> str | None:
    return os.environ.get("AFFIDAVIT_TEST_HAPROXY") or shutil.which("haproxy")


@pytest.mark.skipif(haproxy_binary() is None, reason="haproxy is not installed here (`apt-get install haproxy`); "
                    "the structural test above still checks deploy/haproxy.cfg")
def test_haproxy_accepts_the_configuration():
    done = subprocess.run([haproxy_binary(), "-c", "-f", str(DEPLOY / "haproxy.cfg")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# ------------------------------------------------------------------------------------ Kubernetes


def test_kubernetes_manifests_validate_against_the_api_schemas():
    count = 0
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in load_yaml(path):
            for version in K8S_VERSIONS:
                try:
                    kubernetes_validate.validate(doc, version, strict=True)
                except kubernetes_validate.ValidationError as exc:
                    pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata']['name']} is not valid for Kubernetes {version}: {exc.message} at {'.'.join(map(str, exc.path))}")
            count += 1
    assert count >= 7


def test_kustomization_lists_every_manifest():
    (kustomization,) = load_yaml(K8S / "kustomization.yaml")
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files
    assert all(doc["metadata"].get("namespace", kustomization["namespace"]) == kustomization["namespace"]
               for doc in k8s_objects().values() if doc["kind"] != "Namespace")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed here; the schema test above still validates every manifest")
def test_kubectl_kustomize_renders_offline():
    # `kubectl apply --dry-run=client` needs a cluster for its REST mapping; kustomize does not.
    done = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KUBECONFIG": os.devnull})
    assert done.returncode == 0, done.stderr
    rendered = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(done.stdout) if d}
    assert rendered == set(k8s_objects())


def deployment() -> dict[str, Any]:
    return k8s_objects()[("Deployment", "affidavit")]


def container(pod: dict[str, Any]) -> dict[str, Any]:
    (c,) = pod["spec"]["template"]["spec"]["containers"]
    return c


def test_kubernetes_deployment():
    d = deployment()
    pod = d["spec"]["template"]["spec"]
    c = container(d)
    assert d["spec"]["replicas"] == 3
    assert c["args"] == ["run", "--config", CONFIG]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"proxy": 8080, "api": 8081}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "api"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "api"}
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    env = {e["name"]: e for e in c["env"]}
    assert env["AFFIDAVIT_PROXY__LISTEN"]["value"] == "0.0.0.0:8080" and env["AFFIDAVIT_API__LISTEN"]["value"] == "0.0.0.0:8081"
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    # The CA comes from one Secret, mounted read-only as the confdir, in every replica.
    confdir = example()["proxy"]["confdir"]
    ca = mounts[confdir]
    assert ca.get("readOnly") is True
    assert volumes[ca["name"]]["secret"]["secretName"] == "affidavit-ca"
    assert "items" not in volumes[ca["name"]]["secret"], "all three CA files must be mounted"
    # The configuration from the ConfigMap, at the path the command names.
    config = mounts[str(Path(CONFIG).parent)]
    assert volumes[config["name"]]["configMap"]["name"] == "affidavit-config"
    assert mounts[SECRETS].get("readOnly") is True
    # With a read-only root, everything the process may write is a volume.
    assert {DATA, "/tmp"} <= set(mounts)


def test_kubernetes_migration_job_and_service():
    objects = k8s_objects()
    job = objects[("Job", "affidavit-migrate")]
    c = container(job)
    assert c["args"] == ["db", "upgrade", "--config", CONFIG]
    assert c["image"] == container(deployment())["image"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    service = objects[("Service", "affidavit")]
    assert {(p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {(8080, "proxy"), (8081, "api")}
    assert service["spec"]["selector"] == deployment()["spec"]["selector"]["matchLabels"]
    pdb = objects[("PodDisruptionBudget", "affidavit")]
    assert pdb["spec"]["selector"]["matchLabels"] == deployment()["spec"]["selector"]["matchLabels"]


def test_kubernetes_configuration_and_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    objects = k8s_objects()
    text = objects[("ConfigMap", "affidavit-config")]["data"][Path(CONFIG).name]
    settings = check_loads(text, tmp_path, monkeypatch, "k8s.toml")
    assert not settings.database.is_sqlite
    in_k8s, in_example = tomllib.loads(text), example()
    assert in_k8s["database"].pop("url") != in_example["database"].pop("url")
    assert in_k8s == in_example, "the ConfigMap should be deploy/affidavit.example.toml but for the database host"
    # Every file the configuration names is a key of the Secret mounted at /run/secrets.
    tokens = objects[("Secret", "affidavit-secrets")]["stringData"]
    for path, what in file_sources(in_k8s).items():
        assert path.startswith(SECRETS + "/") and path.removeprefix(SECRETS + "/") in tokens, what
    env = {e["name"]: e for e in container(deployment())["env"]}
    assert env["PGPASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "affidavit-secrets", "key": "db_password"}
    assert "db_password" in tokens
    ca = objects[("Secret", "affidavit-ca")]["stringData"]
    assert set(ca) == CA_FILES
    for value in [*tokens.values(), *ca.values()]:
        assert "REPLACE" in value, "placeholder values must say they are placeholders"


# ------------------------------------------------------------------------------------ systemd


def test_systemd_unit_content():
    assert unit_values("Service", "User") == ["affidavit"]
    (pre,) = unit_values("Service", "ExecStartPre")
    (start,) = unit_values("Service", "ExecStart")
    binary = shlex.split(start)[0]
    assert shlex.split(pre) == [binary, "db", "upgrade", "--config", CONFIG]
    assert shlex.split(start) == [binary, "run", "--config", CONFIG]
    expected = {
        "Restart": "on-failure",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ReadWritePaths": DATA,
        "WorkingDirectory": DATA,
        "PrivateTmp": "yes",
        "ProtectHome": "yes",
    }
    for key, value in expected.items():
        assert unit_values("Service", key) == [value], key
    assert unit_values("Install", "WantedBy") == ["multi-user.target"]
    # Every `file:` source of the example has a credential of the same name.
    credentials = {v.split(":", 1)[0] for v in unit_values("Service", "LoadCredential")}
    assert {Path(p).name for p in file_sources(example())} <= credentials


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here; test_systemd_unit_content still checks the unit")
def test_systemd_analyze_verify(tmp_path: Path):
    """`systemd-analyze verify` loads the unit the way systemd would (offline, no PID 1 needed) and
    checks that the commands exist: the copy points them at this venv's `affidavit`."""
    (start,) = unit_values("Service", "ExecStart")
    binary = shlex.split(start)[0]
    copy = tmp_path / UNIT.name
    copy.write_text(UNIT.read_text().replace(binary, AFFIDAVIT))
    done = subprocess.run(["systemd-analyze", "verify", "--man=no", str(copy)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SYSTEMD_LOG_COLOR": "0"})
    about_unit = [line for line in (done.stdout + done.stderr).splitlines() if UNIT.name in line]
    assert done.returncode == 0 and not about_unit, done.stdout + done.stderr


# ------------------------------------------------------------------------------------ one story


def test_every_deployment_runs_the_same_two_commands():
    svc = services()
    upgrade = ["db", "upgrade", "--config", CONFIG]
    run = ["run", "--config", CONFIG]
    assert one("ENTRYPOINT").json() + one("CMD").json() == ["affidavit", *run]
    assert svc["migrate"]["command"] == upgrade and all(svc[b]["command"] == run for b in BROKERS)
    assert container(k8s_objects()[("Job", "affidavit-migrate")])["args"] == upgrade
    assert container(deployment())["args"] == run
    assert shlex.split(unit_values("Service", "ExecStartPre")[0])[1:] == upgrade
    assert shlex.split(unit_values("Service", "ExecStart")[0])[1:] == run


def test_operations_doc_names_only_files_that_exist():
    text = (ROOT / "docs" / "operations.md").read_text()
    for heading in ("Deployment", "Upgrading", "PostgreSQL settings that matter", "Backups", "Key rotation",
                    "What to alert on", "Sizing"):
        assert re.search(rf"^#+ {re.escape(heading)}\s*$", text, re.M), f"docs/operations.md: no heading {heading!r}"
    for name in set(re.findall(r"deploy/[\w./-]+[\w]", text)):
        assert (ROOT / name).exists() or name in ("deploy/.env", "deploy/affidavit.toml") or name.startswith("deploy/secrets"), name
    # The CA command the doc gives for Kubernetes and systemd is compose's ca-init, verbatim.
    code = re.search(r'--entrypoint python \S+ -c "([^"]+)"', text)
    assert code, "docs/operations.md: the CA command is missing"
    assert code.group(1) == services()["ca-init"]["entrypoint"][2]


# ------------------------------------------------------------------------------------ compose, by hand


@dataclass
class Container:
    """One compose service run as a local process: its paths under ``root``, its own ports."""

    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    proxy_port: int = 0
    api_port: int = 0

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def logs(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@dataclass
class Stack:
    root: Path
    database_url: str
    tokens: dict[str, str]
    brokers: dict[str, Container] = field(default_factory=dict)
    #: The confdir's files (content and mtime) before the brokers started.
    ca_before: dict[str, str] = field(default_factory=dict)

    def host(self, value: str) -> str:
        """A container path as this machine sees it (compose's mounts become directories under root)."""
        for prefix in (str(Path(CONFIG).parent), SECRETS, DATA):
            value = value.replace(prefix, str(self.root) + prefix)
        return value

    @property
    def ca_file(self) -> Path:
        return Path(self.host(example()["proxy"]["confdir"])) / "mitmproxy-ca-cert.pem"

    def client(self, broker: Container) -> httpx.Client:
        verify = ssl.create_default_context(cafile=str(self.ca_file))
        proxy = f"http://builder:{self.tokens['builder']}@127.0.0.1:{broker.proxy_port}"
        return httpx.Client(proxy=proxy, verify=verify, timeout=20, trust_env=False)

    def api(self, broker: Container) -> httpx.Client:
        return httpx.Client(base_url=broker.api_url, headers={"Authorization": f"Bearer {self.tokens['builder']}"},
                            timeout=10, trust_env=False)


def base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("AFFIDAVIT_", "PG")) and "PROXY" not in k.upper()}


def service_env(stack: Stack, service: dict[str, Any]) -> dict[str, str]:
    """The environment compose gives a service (image ENV, then the service's), paths mapped."""
    compose_vars = {"AFFIDAVIT_DB_PASSWORD": "unused-with-trust-auth"}
    env = {**base_env(), **image_env()}
    for key, value in (service.get("environment") or {}).items():
        env[key] = stack.host(interpolate(str(value), compose_vars))
    return env


def service_argv(stack: Stack, service: dict[str, Any]) -> list[str]:
    """entrypoint + command as compose resolves them against the image, paths mapped."""
    if "entrypoint" in service:
        argv = list(service["entrypoint"]) + list(service.get("command") or [])
    else:
        argv = one("ENTRYPOINT").json() + list(service.get("command") or one("CMD").json())
    program = {"affidavit": AFFIDAVIT, "python": sys.executable}[argv[0]]
    return [program, *(stack.host(a) for a in argv[1:])]


def run_one_shot(stack: Stack, name: str) -> subprocess.CompletedProcess[str]:
    service = services()[name]
    done = subprocess.run(service_argv(stack, service), cwd=stack.host(DATA), env=service_env(stack, service),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{name}: {done.stdout}\n{done.stderr}"
    return done


def ca_state(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() + f"@{p.stat().st_mtime_ns}" for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, pki: TestPKI, upstream_server: HostileUpstream) -> Iterator[Stack]:
    """compose up, by hand: the machine's PostgreSQL stands in for the postgres service."""
    url, drop = fresh_database(require_postgres())
    root = tmp_path_factory.mktemp("compose")
    stack = Stack(root, url, {})
    for directory in (Path(CONFIG).parent, Path(SECRETS), Path(DATA)):
        Path(stack.host(str(directory))).mkdir(parents=True)

    # affidavit.toml = the example, with this machine's database and a route to the test upstream.
    config = example()
    config["database"]["url"] = url
    config["upstream"]["ca_bundle"] = pki.ca_cert
    config["routes"].append({
        "name": "deploy.check",
        "host": "api.payments.test",
        "port": 443,
        "methods": ["GET"],
        "path": "/h/*",
        "agents": ["builder"],
        "credential": "payments-key",
        "inject": {"header": "Authorization", "value": "Bearer {secret}"},
        "connect_to": f"127.0.0.1:{upstream_server.tls_port('good')}",
    })
    Path(stack.host(CONFIG)).write_text(stack.host(tomli_w.dumps(config)))
    # The compose secrets: one file each, as compose would mount them.
    for path, what in file_sources(config).items():
        value = base64.b64encode(os.urandom(32)).decode() if what.startswith("crypto.") else secrets.token_hex(16)
        Path(stack.host(path)).write_text(value + "\n")
        if what.startswith("agents."):
            stack.tokens[what.split(".")[1]] = value

    brokers: list[Container] = []
    try:
        run_one_shot(stack, "ca-init")
        confdir = Path(stack.host(config["proxy"]["confdir"]))
        assert CA_FILES <= set(os.listdir(confdir))
        first = ca_state(confdir)
        run_one_shot(stack, "ca-init")  # a second `compose up` keeps the CA
        assert ca_state(confdir) == first
        # Keep only what the Kubernetes CA Secret holds: those files must be all a broker needs.
        for extra in set(os.listdir(confdir)) - CA_FILES:
            (confdir / extra).unlink()
        migrated = run_one_shot(stack, "migrate")
        assert "is at revision" in migrated.stdout
        run_one_shot(stack, "migrate")  # a second `compose up` runs it again: a no-op
        stack.ca_before = ca_state(confdir)

        for name in BROKERS:
            service = services()[name]
            env = service_env(stack, service)
            # Containers have an address each; here the replicas share 127.0.0.1, so new ports.
            assert env["AFFIDAVIT_PROXY__LISTEN"].startswith("0.0.0.0:") and env["AFFIDAVIT_API__LISTEN"].startswith("0.0.0.0:")
            proxy_port, api_port = free_ports(2)
            broker = Container(name, service_argv(stack, service), env, Path(stack.host(DATA)), root / f"{name}.log",
                               proxy_port=proxy_port, api_port=api_port)
            env["AFFIDAVIT_PROXY__LISTEN"] = f"127.0.0.1:{broker.proxy_port}"
            env["AFFIDAVIT_API__LISTEN"] = f"127.0.0.1:{broker.api_port}"
            with broker.log.open("ab") as log:
                broker.proc = subprocess.Popen(broker.argv, cwd=broker.cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True)
            brokers.append(broker)
            stack.brokers[name] = broker
        deadline = time.monotonic() + 60
        for broker in brokers:
            while True:
                assert broker.proc is not None
                if broker.proc.poll() is not None:
                    raise RuntimeError(f"{broker.name} exited with {broker.proc.returncode}:\n{broker.logs()[-3000:]}")
                try:
                    if httpx.get(broker.api_url + "/readyz", timeout=1, trust_env=False).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{broker.name} not ready in 60s:\n{broker.logs()[-3000:]}")
                time.sleep(0.05)
        yield stack
        # `docker stop` sends SIGTERM: a broker must exit cleanly on it.
        for broker in brokers:
            assert broker.proc is not None
            broker.proc.send_signal(signal.SIGTERM)
        for broker in brokers:
            assert broker.proc is not None
            code = broker.proc.wait(30)
            assert code == 0, f"{broker.name} exited {code} on SIGTERM:\n{broker.logs()[-3000:]}"
    finally:
        for broker in brokers:
            if broker.proc is not None and broker.proc.poll() is None:
                os.killpg(broker.proc.pid, signal.SIGKILL)
                broker.proc.wait(5)
        drop()


def writer_of(stack: Stack, invocation_id: str) -> str:
    rows = query(stack.database_url, f"SELECT writer FROM events WHERE invocation_id = '{invocation_id}' AND kind = 'DISPATCH_STARTED'")
    assert len(rows) == 1, rows
    return rows[0][0]


def test_compose_commands_run_two_replicas_on_one_journal(stack: Stack, upstream: HostileUpstream):
    a, b = (stack.brokers[name] for name in BROKERS)
    answers = {}
    for broker in (a, b):
        with stack.client(broker) as client:
            response = client.get(f"https://api.payments.test/h/ok/{broker.name}")
        assert response.status_code == 200, response.text
        answers[broker.name] = (response.headers["affidavit-invocation-id"], response.content)
    (id_a, body_a), (id_b, body_b) = answers["broker-a"], answers["broker-b"]
    assert id_a != id_b
    # One journal: both invocations are in the one database, each written by its own replica.
    assert {id_a, id_b} <= dispatched_ids(stack.database_url)
    # Each broker process signs its events as its own writer (audit chain): two writers, one journal.
    assert writer_of(stack, id_a) != writer_of(stack, id_b)
    rows = query(stack.database_url, f"SELECT count(*) FROM invocations WHERE invocation_id IN ('{id_a}', '{id_b}')")
    assert rows == [("2",)]
    # Any replica serves any invocation: A's record and result through B's side API, and back.
    for reader, (invocation_id, body) in ((b, (id_a, body_a)), (a, (id_b, body_b))):
        with stack.api(reader) as api:
            record = api.get(f"/v1/invocations/{invocation_id}")
            assert record.status_code == 200, record.text
            assert record.json()["outcome"] == "committed", record.json()
            result = api.get(f"/v1/invocations/{invocation_id}/result")
            assert result.status_code == 200, result.text
            assert result.content == body
    assert len(upstream.received) == 2, "fetching results must not re-send anything"


def test_replicas_share_one_ca_and_write_nothing_into_it(stack: Stack):
    """Both replicas presented certificates from the one CA (the client above trusted only its
    file); and neither wrote into the confdir, so a read-only mount of the three files works."""
    confdir = Path(stack.host(example()["proxy"]["confdir"]))
    assert ca_state(confdir) == stack.ca_before
    assert set(os.listdir(confdir)) == CA_FILES
    # Nor anywhere else in the data volume (their working directory and home).
    assert os.listdir(stack.host(DATA)) == [confdir.name]
    shown = subprocess.run([AFFIDAVIT, "ca", "--pem", "--config", stack.host(CONFIG)], cwd=stack.host(DATA),
                           env=base_env(), capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == stack.ca_file.read_text().strip()


def test_image_healthcheck_command_works(stack: Stack):
    argv = json.loads(one("HEALTHCHECK").args.split("CMD", 1)[1])
    assert argv[0] == "python"
    broker = stack.brokers["broker-a"]
    alive = subprocess.run([sys.executable, *(a.replace(":8081", f":{broker.api_port}") for a in argv[1:])],
                           capture_output=True, timeout=30)
    assert alive.returncode == 0, alive.stderr
    dead = subprocess.run([sys.executable, *(a.replace(":8081", f":{free_port()}") for a in argv[1:])],
                          capture_output=True, timeout=30)
    assert dead.returncode != 0, "the health check must fail when nothing answers"


@pytest.mark.skipif(haproxy_binary() is None, reason="haproxy is not installed here (`apt-get install haproxy`); "
                    "the replicas are still driven one by one above")
def test_haproxy_gives_one_port_for_both_replicas(stack: Stack, upstream: HostileUpstream, tmp_path: Path):
    """deploy/haproxy.cfg as is, but for the addresses: broker-X:port -> 127.0.0.1:its port."""
    text = (DEPLOY / "haproxy.cfg").read_text()
    proxy_port, api_port = free_ports(2)
    text = text.replace("bind :8080", f"bind 127.0.0.1:{proxy_port}").replace("bind :8081", f"bind 127.0.0.1:{api_port}")
    for name, broker in stack.brokers.items():
        text = text.replace(f"{name}:8080 port 8081", f"127.0.0.1:{broker.proxy_port} port {broker.api_port}")
        text = text.replace(f"{name}:8081", f"127.0.0.1:{broker.api_port}")
    assert "broker-a:" not in text and "broker-b:" not in text
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(text)
    log = (tmp_path / "haproxy.log").open("wb")
    lb = subprocess.Popen([haproxy_binary(), "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ids: list[str] = []
        deadline = time.monotonic() + 30
        front = Container("lb", [], {}, tmp_path, tmp_path / "haproxy.log", proxy_port=proxy_port, api_port=api_port)
        while len({writer_of(stack, i) for i in ids}) < 2:
            assert lb.poll() is None, (tmp_path / "haproxy.log").read_text()
            assert time.monotonic() < deadline, f"the balancer did not reach both replicas: {ids}"
            try:
                with stack.client(front) as client:  # a new connection each time
                    response = client.get("https://api.payments.test/h/ok/lb")
            except httpx.HTTPError:
                time.sleep(0.5)  # health checks have not marked the brokers up yet
                continue
            assert response.status_code == 200, response.text
            ids.append(response.headers["affidavit-invocation-id"])
        with stack.api(front) as api:
            for invocation_id in ids:
                assert api.get(f"/v1/invocations/{invocation_id}").status_code == 200
    finally:
        lb.send_signal(signal.SIGTERM)
        try:
            lb.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(lb.pid, signal.SIGKILL)
            lb.wait(5)
        log.close()


def test_the_repository_top_level_is_the_fixed_layout():
    """The top level is fixed (product.md): a stray file committed there (a shell redirect's
    leftover, say) is caught here rather than shipped."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    top = {path.split("/", 1)[0] for path in tracked.splitlines()}
    fixed = {"pyproject.toml", "README.md", "proxy", "migrations", "tests", "deploy", "docs", ".ci", "bench", ".gitignore"}
    assert top == fixed, f"unexpected: {sorted(top - fixed)}, missing: {sorted(fixed - top)}"
