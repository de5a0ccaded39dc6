"""The deployment under deploy/ against the code it deploys: every Kubernetes manifest
validates against the Kubernetes schemas (``kubernetes-validate``, bundled, offline), the
compose file parses and has every part, every ``sluice …`` command line parses with the real
CLI, every ``SLUICE_*`` variable is loaded by the real settings class of its part, and the
probes, ports and grace periods match what the processes serve and how long they take to
stop. No broker, no Docker, no cluster: it runs in seconds.

Mutations tried by hand, each failing the test named: a misspelt field in a manifest
(``terminationGracePeriodSecond``: the schema test); ``--engine-urll`` in an agent's args (the
command-line test); ``SLUICE_AGENT_METRIC_PORT`` in a ConfigMap, or ``SLUICE_AGENT_…`` moved
into the dispatcher's (the settings test); a readiness probe on ``/ready`` (the probe test);
``terminationGracePeriodSeconds: 30`` on the agents (the grace test); ``enableServiceLinks``
removed (the service-links test); the engine without ``restartPolicy: Always`` (the sidecar
test); ``STREAM_REPLICAS: "three"`` (the settings test: values are validated too); a
package folder missing from .dockerignore (the image test); ``lame_duck_duration: 10s`` in a
nats config (the nats-server test: its minimum is 30 s)."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import typer
import yaml
from typer.exceptions import TyperException

from sluice.agent.runtime import AgentSettings
from sluice.cli.app import app
from sluice.client import ClientSettings
from sluice.common.probes import HEALTH_PATH, METRICS_PATH, READY_PATH
from sluice.common.settings import SluiceSettings
from sluice.dispatcher.runtime import DispatcherSettings
from sluice.gateway.settings import GatewaySettings
from sluice.testing.natsserver import find_binary

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
COMPOSE_DIR = ROOT / "deploy" / "compose"
COMPOSE = COMPOSE_DIR / "compose.yaml"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"

K8S_VERSIONS = ["1.29.0", kubernetes_validate.utils.latest_version()]
"""The oldest Kubernetes the manifests need (native sidecars: 1.29) and the newest schema
kubernetes-validate bundles."""

SETTINGS: dict[str, type[SluiceSettings]] = {
    "dispatcher": DispatcherSettings,
    "agent": AgentSettings,
    "gateway": GatewaySettings,
    "client": ClientSettings,
}
"""The settings class of each ``SLUICE_<PART>_`` prefix."""

PART_OF_COMMAND = {"dispatcher": "dispatcher", "agent": "agent", "gateway": "gateway"}
"""The settings a ``sluice`` command reads; any other command (``engine``, the admin
commands) reads the client's, or none."""

SHARED_VARIABLES = {"SLUICE_NATS_URL", "SLUICE_CONFIG_FILE"}

DOWNWARD_API_VALUE = "pod-0"
"""What a ``valueFrom: fieldRef`` variable (the pod's name) stands for here."""


# ----------------------------------------------------------------------------- loading


def _k8s_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def _k8s_docs() -> list[tuple[Path, dict[str, Any]]]:
    docs = []
    for path in _k8s_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path, doc))
    return docs


def _compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


@dataclass
class Container:
    """One process of the deployment: where it is, its ``sluice`` arguments (``None`` for
    another image) and its environment (name -> value; ``None``: from elsewhere)."""

    where: str
    image: str
    args: list[str] | None
    env: dict[str, str | None] = field(default_factory=dict)
    spec: dict[str, Any] = field(default_factory=dict)
    pod: dict[str, Any] = field(default_factory=dict)

    @property
    def command(self) -> str | None:
        """The ``sluice`` subcommand it runs."""
        return self.args[0] if self.args else None


def _is_sluice(image: str) -> bool:
    return image.split("/")[-1].split(":")[0] == "sluice"


def _env_sources() -> dict[tuple[str, str], dict[str, str]]:
    """The data of every ConfigMap and Secret under deploy/k8s, by (kind, name)."""
    out: dict[tuple[str, str], dict[str, str]] = {}
    for _, doc in _k8s_docs():
        if doc["kind"] in ("ConfigMap", "Secret"):
            data = {**doc.get("data", {}), **doc.get("stringData", {})}
            out[doc["kind"], doc["metadata"]["name"]] = {k: str(v) for k, v in data.items()}
    return out


def _pod_specs() -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(where, the workload, its pod spec) of every Deployment and StatefulSet."""
    for path, doc in _k8s_docs():
        if doc["kind"] in ("Deployment", "StatefulSet"):
            where = f"{path.name}: {doc['kind']} {doc['metadata']['name']}"
            yield where, doc, doc["spec"]["template"]["spec"]


def _k8s_containers() -> list[Container]:
    sources = _env_sources()
    out = []
    for where, _, pod in _pod_specs():
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            env: dict[str, str | None] = {}
            for ref in c.get("envFrom", []):
                if "configMapRef" in ref:
                    env.update(sources[("ConfigMap", ref["configMapRef"]["name"])])
                else:  # the gateway's keys: an example Secret stands for the operator's
                    env.update(sources[("Secret", ref["secretRef"]["name"])])
            for e in c.get("env", []):
                env[e["name"]] = e.get("value", DOWNWARD_API_VALUE)
            sluice = _is_sluice(c["image"])
            if sluice:
                assert "command" not in c, f"{where}/{c['name']}: the image's entrypoint is sluice"
            out.append(
                Container(
                    f"{where}/{c['name']}",
                    c["image"],
                    list(c.get("args", [])) if sluice else None,
                    env,
                    c,
                    pod,
                )
            )
    return out


def _compose_containers() -> list[Container]:
    out = []
    for name, svc in _compose()["services"].items():
        image = svc.get("image", "")
        args = svc.get("command")
        env = {k: None if v is None else str(v) for k, v in (svc.get("environment") or {}).items()}
        sluice = _is_sluice(image)
        out.append(Container(f"compose: {name}", image, list(args) if sluice else None, env, svc))
    return out


def _sluice_containers() -> list[Container]:
    return [c for c in _k8s_containers() + _compose_containers() if c.args is not None]


def _of(command: str) -> list[Container]:
    found = [c for c in _sluice_containers() if c.command == command]
    assert found, f"no container runs sluice {command}"
    return found


# ----------------------------------------------------------------------------- the CLI


def _parse(args: list[str]) -> dict[str, Any]:
    """Parse ``sluice ARGS`` with the real CLI (the click command typer builds) without
    running it: the subcommand's parameters, or a ``typer.exceptions.TyperException`` (a
    usage error: an unknown option, a bad value)."""
    cmd: Any = typer.main.get_command(app)
    ctx = cmd.context_class(cmd, info_name="sluice")
    rest = list(args)
    while hasattr(cmd, "get_command"):  # sluice -> agent; sluice quota -> set
        name, rest = rest[0], rest[1:]
        sub = cmd.get_command(ctx, name)
        assert sub is not None, f"no command {name!r} in sluice {' '.join(args)}"
        cmd = sub
        if hasattr(cmd, "get_command"):
            ctx = cmd.context_class(cmd, info_name=name, parent=ctx)
    return dict(cmd.make_context(cmd.name, rest, parent=ctx).params)


# Parameters of the part commands that override a setting of another name (cli/app.py).
_OPTION_SETTING = {"model": "models", "kv_events": "engine_kv_events"}


def _overrides(command: str, params: dict[str, Any]) -> dict[str, Any]:
    cls = SETTINGS[PART_OF_COMMAND[command]]
    out = {}
    for name, value in params.items():
        setting = _OPTION_SETTING.get(name, name)
        given = value is not None and value != ()  # typer hands the command None for ()
        if given and setting in cls.model_fields and name != "config":
            out[setting] = value
    return out


# ----------------------------------------------------------------------------- Kubernetes


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_kubernetes_manifest_validates(version: str) -> None:
    docs = _k8s_docs()
    assert len(docs) >= 15, [p.name for p, _ in docs]
    problems = []
    for path, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(p) for p in exc.path)
            problems.append(f"{path.name}: {doc['kind']} {doc['metadata']['name']}: {where}: "
                            f"{exc.message[:300]}")  # fmt: skip
    assert not problems, "\n".join(problems)


def test_the_kustomization_lists_every_manifest() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    applied = {p.name for p in _k8s_files() if not p.name.endswith(".example.yaml")}
    assert set(kust["resources"]) == applied
    assert kust["resources"][0] == "namespace.yaml"


def test_pods_disable_service_links() -> None:
    """A Service named ``sluice-gateway`` in the namespace would give every pod
    ``SLUICE_GATEWAY_PORT=tcp://…`` and ``SLUICE_GATEWAY_SERVICE_HOST``: the first is read as
    the gateway's port, the second stops it as an unknown setting."""
    for where, _, pod in _pod_specs():
        assert pod.get("enableServiceLinks") is False, where


def test_pods_run_as_non_root_with_resources() -> None:
    for where, _, pod in _pod_specs():
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            assert c["resources"]["requests"].keys() >= {"cpu", "memory"}, where
            assert c["resources"]["limits"]["memory"], where
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"]["drop"] == ["ALL"], where


def test_dispatchers_have_a_disruption_budget() -> None:
    docs = [d for _, d in _k8s_docs()]
    (deploy,) = [
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "dispatcher"
    ]
    assert deploy["spec"]["replicas"] >= 2  # a leader and a standby
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    pdbs = [
        d
        for d in docs
        if d["kind"] == "PodDisruptionBudget"
        and d["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ]
    assert [p["spec"].get("minAvailable") for p in pdbs] == [1]
    assert deploy["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_nats_is_a_three_node_jetstream_statefulset() -> None:
    docs = [d for _, d in _k8s_docs()]
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "nats"]
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    governing = sts["spec"]["serviceName"]
    (headless,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == governing]
    assert headless["spec"]["clusterIP"] == "None"
    conf = next(d["data"]["nats.conf"] for d in docs if d["metadata"]["name"] == "nats-config")
    assert "jetstream" in conf and "server_name: $SERVER_NAME" in conf
    pods = [f"nats-{i}.{headless['metadata']['name']}" for i in range(3)]
    routes = re.findall(r"nats://([\w.-]+):6222", conf)
    assert routes == pods
    nats_url = _env_sources()[("ConfigMap", "sluice-common")]["SLUICE_NATS_URL"]
    assert [urlsplit(u).hostname for u in nats_url.split(",")] == pods
    (dispatcher,) = _of_k8s("dispatcher")
    assert int(dispatcher.env["SLUICE_DISPATCHER_STREAM_REPLICAS"] or 0) == 3


def _nats_configs() -> dict[str, str]:
    """The nats-server config of compose and of the Kubernetes ConfigMap, by where."""
    (k8s,) = [
        d["data"]["nats.conf"] for _, d in _k8s_docs() if d["metadata"]["name"] == "nats-config"
    ]
    return {"compose": (COMPOSE_DIR / "nats" / "nats.conf").read_text(), "k8s": k8s}


@pytest.mark.parametrize("where", ["compose", "k8s"])
def test_nats_configs_are_valid_for_the_server(where: str, tmp_path: Path) -> None:
    """``nats-server -t`` (the binary the suite runs) checks the config as the image's
    server would: unknown fields and bad values fail (a ``lame_duck_duration`` under 30 s
    did), and ``$SERVER_NAME`` must come from the environment."""
    conf = tmp_path / "nats.conf"
    conf.write_text(_nats_configs()[where])
    env = {**os.environ, "SERVER_NAME": "nats-0"}
    out = subprocess.run(
        [find_binary(), "-t", "-c", str(conf)], env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stdout + out.stderr


def _of_k8s(command: str) -> list[Container]:
    return [c for c in _of(command) if not c.where.startswith("compose")]


def test_the_engine_is_a_sidecar_that_outlives_its_draining_agent() -> None:
    """The engine runs as a native sidecar (an init container with ``restartPolicy:
    Always``): Kubernetes stops it after the agent, so a draining agent keeps its engine."""
    (agent,) = _of_k8s("agent")
    (engine,) = _of_k8s("engine")
    assert agent.pod is engine.pod or agent.pod == engine.pod
    assert engine.spec in agent.pod.get("initContainers", [])
    assert engine.spec.get("restartPolicy") == "Always"
    params = _parse(engine.args or [])
    url = urlsplit(str(_parse(agent.args or [])["engine_url"]))
    assert (url.hostname, url.port) == (params["host"], params["port"])


# ----------------------------------------------------------------------------- compose


def test_the_compose_file_has_every_part() -> None:
    services = _compose()["services"]
    commands = [
        (s.get("command") or [None])[0] for s in services.values() if _is_sluice(s.get("image", ""))
    ]  # fmt: skip
    assert commands.count("dispatcher") == 2
    agents, engines = commands.count("agent"), commands.count("engine")
    assert agents >= 2 and engines == agents
    assert commands.count("gateway") == 1
    nats = [n for n, s in services.items() if s.get("image", "").startswith("nats:")]
    assert len(nats) == 3
    assert {"prometheus", "grafana"} <= services.keys()
    k8s_nats = {c.image for c in _k8s_containers() if c.image.startswith("nats:")}
    assert {services[n]["image"] for n in nats} == k8s_nats  # one NATS release everywhere
    conf = (COMPOSE_DIR / "nats" / "nats.conf").read_text()
    assert re.findall(r"nats://([\w-]+):6222", conf) == nats
    for name in nats:
        assert services[name]["environment"]["SERVER_NAME"] == name
    for c in _compose_containers():
        if c.command in ("dispatcher", "agent"):
            assert c.env["SLUICE_NATS_URL"] == ",".join(f"nats://{n}:4222" for n in nats)
    # Each agent drives its own engine service.
    for c in _of("agent"):
        if c.where.startswith("compose"):
            host = urlsplit(str(_parse(c.args or [])["engine_url"])).hostname
            assert host in services and (services[host]["command"][0] == "engine"), c.where


def test_compose_mounts_exist() -> None:
    services = _compose()["services"]
    for name, svc in services.items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE_DIR / source).exists(), f"{name}: {source}"
        if "build" in svc:
            assert (COMPOSE_DIR / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()


def test_prometheus_scrapes_every_part_and_loads_the_alert_rules() -> None:
    prom = yaml.safe_load(PROMETHEUS.read_text())
    targets = {
        t for job in prom["scrape_configs"] for s in job["static_configs"] for t in s["targets"]
    }
    services = _compose()["services"]
    for c in _compose_containers():
        name = c.where.removeprefix("compose: ")
        if c.command in ("dispatcher", "agent"):
            part = c.command.upper()
            assert f"{name}:{c.env[f'SLUICE_{part}_METRICS_PORT']}" in targets, name
        elif c.command == "gateway":
            assert f"{name}:{_parse(c.args or [])['port']}" in targets, name
    # alerts.yml lives beside prometheus.yml, in the directory compose mounts.
    (mount,) = [v for v in services["prometheus"]["volumes"] if v.startswith("../prometheus:")]
    target = mount.split(":")[1]
    assert prom["rule_files"] == [f"{target}/alerts.yml"]
    alerts = PROMETHEUS.parent / "alerts.yml"
    if alerts.exists():  # written with the dashboard; the rules must parse
        assert "groups" in yaml.safe_load(alerts.read_text())


def test_grafana_provisions_the_dashboard_directory() -> None:
    services = _compose()["services"]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    provisioning = ROOT / "deploy" / "grafana" / "provisioning"
    provider = yaml.safe_load((provisioning / "dashboards" / "sluice.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == mounts["../grafana"]
    ds = yaml.safe_load((provisioning / "datasources" / "sluice.yml").read_text())
    assert urlsplit(ds["datasources"][0]["url"]).hostname == "prometheus"


# ----------------------------------------------------------------------------- both


def test_every_sluice_command_line_parses() -> None:
    containers = _sluice_containers()
    assert len(containers) >= 10
    for c in containers:
        try:
            _parse(c.args or [])
        except TyperException as exc:
            pytest.fail(f"{c.where}: sluice {' '.join(c.args or [])}: {exc.format_message()}")


def test_every_variable_is_a_setting_of_its_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each container's ``SLUICE_*`` variables, loaded by the real settings class of its
    part (which refuses a variable naming no setting, and validates every value), with its
    command line's options as the CLI passes them; a variable of another part's prefix would
    be ignored there, so it is a mistake too."""
    prefixes = {f"SLUICE_{p.upper()}_": p for p in SETTINGS}
    for c in _sluice_containers():
        part = PART_OF_COMMAND.get(c.command or "", "client")
        names = [n for n in c.env if n.startswith("SLUICE_") and n not in SHARED_VARIABLES]
        misplaced = [n for n in names if not n.startswith(f"SLUICE_{part.upper()}_")]
        assert not misplaced, f"{c.where} (sluice {c.command}) does not read {misplaced}"
        unknown = [n for n in names if not any(n.startswith(p) for p in prefixes)]
        assert not unknown, f"{c.where}: {unknown}"
        for name in list(os.environ):
            if name.startswith("SLUICE_"):
                monkeypatch.delenv(name)
        for name, value in c.env.items():
            monkeypatch.setenv(name, DOWNWARD_API_VALUE if value is None else value)
        overrides = {}
        if c.command in PART_OF_COMMAND:
            overrides = _overrides(c.command, _parse(c.args or []))
        try:
            SETTINGS[part].load(None, **overrides)
        except ValueError as exc:
            pytest.fail(f"{c.where}: {exc}")


def _probe(spec: dict[str, Any], kind: str) -> tuple[str, int | str]:
    get = spec[kind]["httpGet"]
    return get["path"], get["port"]


def _container_port(spec: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    (found,) = [p["containerPort"] for p in spec["ports"] if p["name"] == port]
    return int(found)


def _compose_check(c: Container) -> tuple[str, int]:
    url = urlsplit(c.spec["healthcheck"]["test"][-1])
    assert url.hostname == "127.0.0.1" and url.port is not None, c.where
    return url.path, url.port


def test_probes_are_what_the_parts_serve() -> None:
    from sluice.gateway.app import Gateway, build_app
    from sluice.sim.profiles import get_profile
    from sluice.testing.engineserver import SimServer
    from sluice.testing.engineserver import build_app as engine_app

    gateway_paths = {getattr(r, "path", "") for r in build_app(Gateway(GatewaySettings())).routes}
    engine = SimServer(get_profile("reference"), model="sim")
    engine_paths = {getattr(r, "path", "") for r in engine_app(engine).routes}
    for command in ("dispatcher", "agent"):
        for c in _of(command):
            port = int(c.env[f"SLUICE_{command.upper()}_METRICS_PORT"] or 0)
            host = c.env[f"SLUICE_{command.upper()}_METRICS_HOST"]
            assert host == "0.0.0.0", f"{c.where}: probes and Prometheus reach {host}?"
            if c.where.startswith("compose"):
                assert _compose_check(c) == (HEALTH_PATH, port), c.where
                continue
            for kind in ("startupProbe", "livenessProbe"):
                path, p = _probe(c.spec, kind)
                assert (path, _container_port(c.spec, p)) == (HEALTH_PATH, port), c.where
            path, p = _probe(c.spec, "readinessProbe")
            assert (path, _container_port(c.spec, p)) == (READY_PATH, port), c.where
            annotations = c.pod and _pod_annotations(c)
            assert annotations["prometheus.io/port"] == str(port)
            assert annotations["prometheus.io/path"] == METRICS_PATH
    for c in _of("gateway"):
        port = _parse(c.args or [])["port"]
        if c.where.startswith("compose"):
            path, p = _compose_check(c)
        else:
            path, named = _probe(c.spec, "readinessProbe")
            p = _container_port(c.spec, named)
            assert _container_port(c.spec, c.spec["livenessProbe"]["tcpSocket"]["port"]) == port
        assert path in gateway_paths and p == port, c.where
    for c in _of("engine"):
        params = _parse(c.args or [])
        if c.where.startswith("compose"):
            path, p = _compose_check(c)
        else:  # on loopback: probed from inside the container
            url = urlsplit(
                re.findall(r"'(http://[^']+)'", c.spec["startupProbe"]["exec"]["command"][-1])[0]
            )
            path, p = url.path, url.port or 0
        assert path in engine_paths and p == params["port"], c.where


def _pod_annotations(c: Container) -> dict[str, str]:
    for _, workload, pod in _pod_specs():
        if pod is c.pod or pod == c.pod:
            return dict(workload["spec"]["template"]["metadata"].get("annotations", {}))
    raise AssertionError(c.where)


def _seconds(value: int | str) -> float:
    if isinstance(value, int):
        return float(value)
    m = re.fullmatch(r"(\d+)s", value)
    assert m, value
    return float(m.group(1))


def _grace(c: Container) -> float:
    if c.where.startswith("compose"):
        return _seconds(c.spec["stop_grace_period"])
    return _seconds(c.pod["terminationGracePeriodSeconds"])


def test_stop_grace_covers_drain_and_hand_over() -> None:
    """An agent stopped by the orchestrator drains for up to ``drain_timeout_s`` and then
    says goodbye; killed before, its requests wait for the lease. A dispatcher's clean stop
    waits ``fetch_timeout_s`` + 1 s for its loops, 2 s for background tasks and 2 s to hand
    back what it held (``Dispatcher._halt``)."""
    for c in _of("agent"):
        drain = (
            c.env.get("SLUICE_AGENT_DRAIN_TIMEOUT_S")
            or AgentSettings.model_fields["drain_timeout_s"].default
        )
        assert _grace(c) >= float(drain) + 10, c.where
    fetch = DispatcherSettings.model_fields["fetch_timeout_s"].default
    for c in _of("dispatcher"):
        assert _grace(c) >= float(c.env.get("SLUICE_DISPATCHER_FETCH_TIMEOUT_S") or fetch) + 5 + 5
    for c in _of("gateway"):
        from sluice.gateway.server import SHUTDOWN_GRACE_S

        assert _grace(c) > SHUTDOWN_GRACE_S, c.where


# ----------------------------------------------------------------------------- the image


def test_the_image_holds_every_package() -> None:
    """The build context admits every folder the wheel is built from (pyproject's
    ``package-dir``): a new top-level folder missing from .dockerignore would be missing
    from the image."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    admitted = {line[1:].strip("/") for line in lines if line.startswith("!")}
    assert lines[[ln.strip() for ln in lines].index("*")] == "*"
    assert folders | {"pyproject.toml", "README.md"} <= admitted
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["sluice"]' in dockerfile
    user = re.findall(r"^USER (\S+)", dockerfile, re.M)
    assert user and user[-1].split(":")[0] not in ("root", "0")
    for where, _, pod in _pod_specs():
        image_users = [
            c
            for c in [*pod.get("initContainers", []), *pod["containers"]]
            if _is_sluice(c["image"])
        ]
        if image_users:
            assert str(pod["securityContext"]["runAsUser"]) == user[-1].split(":")[0], where
