"""Observability against a live stack: one real ``sluice up`` process (embedded nats-server,
a dispatcher, two simulated workers and the gateway, whose ``/metrics`` serves the whole
process's registry) is driven with a few requests, a rejection and a run-time quota, then
scraped once for the module. On that scrape:

- every metric family follows the Prometheus naming rules (parsed with ``prometheus_client``'s
  parser), and ``promtool check metrics`` accepts it when the binary is present;
- what issue 15 asks to see is there, with samples;
- every expression of the Grafana dashboard (``deploy/grafana/sluice.json``) and of the alerting
  rules (``deploy/prometheus/alerts.yml``) refers only to metrics the stack exposes (and
  ``promtool check rules`` accepts the rules when present);
- the runbooks of docs/operations.md run as written against ``sluice up``.

Without the stack: the metrics reference table of docs/operations.md is exactly what the
metric modules declare, and each metric is declared once.

Mutations that make these fail (each tried by hand): a gauge named ``…_wait_p50_seconds`` or
a ``…_ms`` metric declared (naming rules); ``_worker_gauges`` not called in ``Gauges.update``
(what the issue asks for); a dashboard expression naming ``sluice_dispatcher_flap_rate``
(dashboard test); a metric added to a module and not to the table (reference table).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from sluice.client import Client, Rejected, ServiceUnavailable
from sluice.client.admin import clear_model_quota, set_model_quota
from sluice.schemas.models import QuotaSpec
from sluice.testing.cluster import LocalCluster
from sluice.testing.gateway import GatewayProcess
from sluice.testing.processes import stop_processes

from .conftest import cluster_kwargs, eventually

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "sluice.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
OPERATIONS = ROOT / "docs" / "operations.md"
METRIC_MODULES = [
    "dispatcher/runtime/metrics.py",
    "agent/runtime/metrics.py",
    "gateway/metrics.py",
    "common/errors.py",
]
MODEL = "demo-8b"
PROMPT = " ".join(f"shared context {i}" for i in range(120))


# ------------------------------------------------------------------------------- the stack


@dataclass
class Stack:
    nats_url: str
    gateway_url: str
    request_ids: list[str] = field(default_factory=list)
    text: str = ""
    """The scrape of ``/metrics`` once the requests ran."""
    output: list[str] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        bin_dir = str(Path(sys.executable).parent)
        return {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "SLUICE_NATS_URL": self.nats_url,
        }

    def sluice(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sluice.cli", *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=60,
        )


def _start(proc: subprocess.Popen[str], lines: list[str]) -> dict[str, str]:
    urls: dict[str, str] = {}
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(urls) < 2:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"sluice up exited with {proc.wait()}: {''.join(lines)}")
        lines.append(line)
        m = re.match(r"\s+(NATS|gateway)\s+(\S+)", line)
        if m:
            urls[m.group(1)] = m.group(2).removesuffix("/v1")
    assert len(urls) == 2, urls

    def drain() -> None:  # the process must never block on a full pipe
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)

    threading.Thread(target=drain, daemon=True).start()
    return urls


async def _drive(stack: Stack) -> None:
    """Requests of two tenants sharing a prefix, one rejection, one gateway completion."""
    tag = uuid.uuid4().hex[:8]
    async with Client(stack.nats_url) as c:
        handles = []
        for i in range(6):
            rid = f"obs-{tag}-{i}"
            stack.request_ids.append(rid)
            tenant = "acme" if i % 2 else "other"
            handles.append(
                await c.submit(MODEL, PROMPT, max_tokens=4, request_id=rid, tenant=tenant)
            )
        for h in handles:
            await h.result(timeout_s=30)
        rid = f"obs-{tag}-rejected"
        stack.request_ids.append(rid)
        with pytest.raises(Rejected):
            await (await c.submit("no-such-model", "hi", request_id=rid)).result(timeout_s=30)
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as http:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
        assert (await http.post("/v1/completions", json=body)).status_code == 200


READY_SAMPLES = [
    "sluice_dispatcher_completed_total",
    "sluice_dispatcher_worker_lease_age_seconds",
    "sluice_dispatcher_quota_usage_ratio",
    "sluice_gateway_first_token_seconds_count",
]


def _value(text: str, sample: str) -> float:
    m = re.search(f"^{sample} (\\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _scrape(stack: Stack) -> str:
    """Scrape once a feedback tick has run over every request driven (or after 20 s): the
    flap meter's decisions reach the counter at that tick."""
    deadline = time.monotonic() + 20
    text = ""
    booked = len(stack.request_ids)  # the rejected one is not booked; the gateway's one is
    while time.monotonic() < deadline:
        text = httpx.get(f"{stack.gateway_url}/metrics", timeout=10).text
        ready = all(re.search(f"^{n}{{", text, re.M) for n in READY_SAMPLES)
        ready = ready and f'name="{MODEL}/acme"' in text  # the run-time quota applied
        if ready and _value(text, "sluice_dispatcher_flap_decisions_total") >= booked:
            break
        time.sleep(0.3)
    return text


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    cmd = [sys.executable, "-m", "sluice.cli", "up", "--nats-port", "-1", "--port", "0"]
    cmd += ["--workers", "2", "--speed", "20", "--model", MODEL]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    lines: list[str] = []
    try:
        urls = _start(proc, lines)
        s = Stack(urls["NATS"], urls["gateway"], output=lines)
        quota = s.sluice(
            "quota", "set", MODEL, "--limit", "20", "--band", "interactive=10",
            "--tenant", "acme=5", "--default-tenant", "4",
        )  # fmt: skip
        assert quota.returncode == 0, quota.stdout + quota.stderr
        asyncio.run(_drive(s))
        s.text = _scrape(s)
        yield s
    finally:
        # Ctrl-C: it stops everything it started
        stop_processes([proc], signal.SIGINT, timeout_s=30)


# ------------------------------------------------------------------------ the naming rules

BAD_UNITS = re.compile(
    r"_(ms|us|ns|msec|millis|milliseconds|microseconds|nanoseconds|minutes|hours|days|"
    r"kb|mb|gb|kib|mib|gib|kilobytes|megabytes|gigabytes|percent|pct)(_|$)"
)
QUANTILE_GAUGE = re.compile(r"_p\d+(_|$)")
RATE_GAUGE = re.compile(r"_per_(second|minute)$")
PER_REQUEST_LABEL = re.compile(r"(^|_)(request|req|trace|span|session|user|prompt)(_|$)|^id$")
FOREIGN_PREFIXES = ("process_", "python_")
"""prometheus_client's default collectors (process and GC): not ours to name."""


def families(text: str) -> list[Any]:
    return list(text_string_to_metric_families(text))


def naming_problems(text: str) -> list[str]:
    """Every breach of the naming rules in an exposition (empty: none)."""
    declared_types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    problems: list[str] = []
    for f in families(text):
        if not f.name.startswith(FOREIGN_PREFIXES):
            problems += [f"{f.name}: {p}" for p in _family_problems(f, declared_types)]
    return problems


def _family_problems(f: Any, declared_types: dict[str, str]) -> list[str]:
    name, out = f.name, []
    if not re.fullmatch(r"sluice_[a-z][a-z0-9]*(_[a-z0-9]+)+", name):
        out.append("not snake_case with the sluice_ prefix")
    if BAD_UNITS.search(name):
        out.append("not in base units (seconds, bytes, tokens, blocks, ratio)")
    if QUANTILE_GAUGE.search(name) or RATE_GAUGE.search(name):
        out.append("a quantile or a per-second figure: PromQL's job over a histogram/counter")
    if f.type == "counter" and declared_types.get(f"{name}_total") != "counter":
        out.append(f"a counter not exposed as {name}_total")
    if f.type != "counter" and name.endswith(("_total", "_count", "_sum", "_bucket")):
        out.append(f"a {f.type} with a counter or histogram suffix")
    buckets = [s for s in f.samples if s.name == f"{name}_bucket" and s.labels["le"] == "+Inf"]
    if f.type == "histogram" and f.samples and not buckets:
        out.append("a histogram without buckets")
    labels = {label for s in f.samples for label in s.labels if label != "le"}
    out += [f"label {lb!r} is per request" for lb in sorted(labels) if PER_REQUEST_LABEL.search(lb)]
    return out


def test_every_metric_follows_the_naming_rules(stack: Stack) -> None:
    ours = [f for f in families(stack.text) if f.name.startswith("sluice_")]
    assert len(ours) > 60, "the scrape holds too few sluice metrics"
    assert naming_problems(stack.text) == []


def test_the_naming_rules_catch_what_they_forbid() -> None:
    """The checker itself: each forbidden shape is reported (else the test above is empty)."""
    bad = "\n".join(
        [
            "# TYPE sluice_x_wait_p50_seconds gauge",
            "sluice_x_wait_p50_seconds 1",
            "# TYPE sluice_x_handoff_ms gauge",
            "sluice_x_handoff_ms 1",
            "# TYPE sluice_x_done counter",
            "sluice_x_done 1",
            "# TYPE sluice_x_waits gauge",
            'sluice_x_waits{request_id="r1"} 1',
            "# TYPE sluice_x_admitted_per_second gauge",
            "sluice_x_admitted_per_second 1",
            "# TYPE SluiceCamel gauge",
            "SluiceCamel 1",
            "",
        ]
    )
    problems = "\n".join(naming_problems(bad))
    for name in (
        "wait_p50_seconds", "handoff_ms", "sluice_x_done", "request_id", "per_second",
        "SluiceCamel",
    ):  # fmt: skip
        assert name in problems, f"{name} not reported:\n{problems}"


def test_no_label_carries_a_request_id(stack: Stack) -> None:
    """The ids of the requests driven through the stack appear in no label value."""
    values = {v for f in families(stack.text) for s in f.samples for v in s.labels.values()}
    assert stack.request_ids and not [v for v in values if any(r in v for r in stack.request_ids)]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_checks_the_scrape(stack: Stack) -> None:
    done = subprocess.run(
        ["promtool", "check", "metrics"], input=stack.text, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # promtool's lint findings (it exits 0 for some): none for our own metrics
    findings = [ln for ln in (done.stdout + done.stderr).splitlines() if "sluice_" in ln]
    assert findings == []


# Issue 15, item 1: what must be visible, with samples, once a few requests ran.
REQUIRED = [
    "sluice_dispatcher_worker_hit_rate",  # per worker hit rate
    "sluice_dispatcher_cached_tokens_total",
    "sluice_dispatcher_worker_engine_waiting_requests",  # queue depth at the engine
    "sluice_dispatcher_worker_in_flight_requests",
    "sluice_dispatcher_worker_lease_age_seconds",
    "sluice_dispatcher_queue_depth",  # per model and band
    "sluice_dispatcher_queue_wait_seconds_bucket",
    "sluice_dispatcher_intake_seconds_bucket",  # its first part (issue 14)
    "sluice_dispatcher_admitted_total",
    "sluice_dispatcher_rejected_total",
    "sluice_dispatcher_quota_usage_ratio",
    "sluice_dispatcher_routed_total",
    "sluice_dispatcher_flaps_total",
    "sluice_dispatcher_flap_decisions_total",
    "sluice_dispatcher_book_drift",
    "sluice_agent_engine_busy_seconds_total",
    "sluice_agent_ttft_seconds_bucket",
    "sluice_gateway_first_token_seconds_bucket",
]


def _samples(text: str) -> dict[str, list[dict[str, str]]]:
    out: dict[str, list[dict[str, str]]] = {}
    for f in families(text):
        for s in f.samples:
            out.setdefault(s.name, []).append(s.labels)
    return out


def test_the_stack_exposes_what_the_issue_asks(stack: Stack) -> None:
    samples = _samples(stack.text)
    assert [n for n in REQUIRED if n not in samples] == []
    assert {"model": MODEL, "band": "standard"} in samples["sluice_dispatcher_admitted_total"]
    rejected = samples["sluice_dispatcher_rejected_total"]
    assert {"model": "", "band": "", "reason": "unknown_model"} in rejected
    levels = {(lb["level"], lb["name"]) for lb in samples["sluice_dispatcher_quota_usage_ratio"]}
    want = {("global", ""), ("model", MODEL), ("model-band", f"{MODEL}/interactive")}
    want |= {("model-tenant", f"{MODEL}/acme"), ("model-tenant", f"{MODEL}/*")}
    assert want <= levels
    workers = {lb["worker"] for lb in samples["sluice_dispatcher_worker_lease_age_seconds"]}
    assert workers == {"worker-0", "worker-1"}
    flap_decisions = [
        float(s.value)
        for f in families(stack.text)
        for s in f.samples
        if s.name == "sluice_dispatcher_flap_decisions_total"
    ]
    assert flap_decisions and flap_decisions[0] >= 7  # 6 from the client, 1 from the gateway


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _scrape_until(url: str, sample: str, timeout_s: float = 20) -> str:
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            text = httpx.get(url, timeout=5).text
            if re.search(f"^{sample}[{{ ]", text, re.M):
                break
        time.sleep(0.2)
    return text


async def _serve_two(nats_url: str, gateway_url: str) -> None:
    """One request through the client, one through the gateway. The first submissions may
    come before the dispatcher created its streams."""
    async with httpx.AsyncClient(base_url=gateway_url, timeout=30) as http:
        await _submit_until_served(nats_url)
        body = {"model": "sim", "prompt": "hello", "max_tokens": 2}
        assert (await http.post("/v1/completions", json=body)).status_code == 200


async def _submit_until_served(nats_url: str) -> None:
    deadline = time.monotonic() + 30
    async with Client(nats_url) as c:
        while True:
            try:
                await (await c.submit("sim", PROMPT, max_tokens=3)).result(timeout_s=20)
                return
            except ServiceUnavailable:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.3)


def test_each_process_serves_its_own_metrics(nats_url: str, tmp_path: Path) -> None:
    """Deployed, every part is its own process with its own ``/metrics``: a ``sluice
    dispatcher``, a ``sluice agent`` and a ``sluice gateway`` process, scraped apart. Each
    follows the naming rules, holds its own part's metrics and the internal-error counter, and
    together they expose every metric the dashboard and the rules use. Mutation (the bug it
    found): ``sluice.testing``'s package init importing ``LocalCluster`` eagerly again, so that
    ``sluice agent`` (which imports ``sluice.testing.engines``) serves every dispatcher metric."""
    ports = {"dispatcher": _free_port(), "agent": _free_port()}
    env = {
        **os.environ,
        "SLUICE_NATS_URL": nats_url,
        "SLUICE_DISPATCHER_LEARN_S": "0.2",
        "SLUICE_DISPATCHER_MODELS": '["sim"]',
        "SLUICE_DISPATCHER_METRICS_PORT": str(ports["dispatcher"]),
        "SLUICE_AGENT_METRICS_PORT": str(ports["agent"]),
        "SLUICE_AGENT_SPEED": "20",
        "SLUICE_AGENT_HEARTBEAT_S": "0.2",
    }
    procs = []
    try:
        for args in (["dispatcher"], ["agent", "--worker-id", "proc-worker"]):
            log = (tmp_path / f"{args[0]}.log").open("w")
            cmd = [sys.executable, "-m", "sluice.cli", *args]
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log))
        with GatewayProcess(nats_url) as gw:
            asyncio.run(_serve_two(nats_url, gw.url))
            texts = {
                "dispatcher": _scrape_until(
                    f"http://127.0.0.1:{ports['dispatcher']}/metrics",
                    "sluice_dispatcher_worker_lease_age_seconds",
                ),
                "agent": _scrape_until(
                    f"http://127.0.0.1:{ports['agent']}/metrics",
                    "sluice_agent_engine_busy_seconds_total",
                ),
                "gateway": httpx.get(f"{gw.url}/metrics", timeout=10).text,
            }
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    for part, text in texts.items():
        names = {f.name for f in families(text) if f.name.startswith("sluice_")}
        assert naming_problems(text) == [], part
        if shutil.which("promtool"):
            check = ["promtool", "check", "metrics"]
            done = subprocess.run(check, input=text, capture_output=True, text=True)
            assert done.returncode == 0, f"{part}: {done.stdout}{done.stderr}"
        assert "sluice_internal_errors" in names, part
        others = {"sluice_dispatcher_", "sluice_agent_", "sluice_gateway_"} - {f"sluice_{part}_"}
        assert [n for n in names if n.startswith(tuple(others))] == [], part
        assert any(n.startswith(f"sluice_{part}_") for n in names), part
    exposed = set().union(*(exposed_names(t) for t in texts.values()))
    exprs = dashboard_exprs() + [(r["alert"], r["expr"]) for r in alert_rules()]
    missing = {n for _, e in exprs for n in metric_names(e)} - exposed
    assert missing == set()


async def test_series_go_with_their_quota_level_and_their_worker(nats_url: str) -> None:
    """A quota level removed at run time and a worker that left lose their series (no stale
    figure stays on a dashboard). Unique names: the registry is this process's, shared with
    earlier tests' dispatchers. Mutations: the ``remove`` loops of ``Gauges._quota_gauges``
    and ``Gauges._worker_gauges`` dropped."""
    tag = uuid.uuid4().hex[:8]
    tenant, worker = f"t{tag}", f"leaver-{tag}"
    level = {"level": "model-tenant", "name": f"sim/{tenant}"}
    quota = "sluice_dispatcher_quota_usage_ratio"
    lease = "sluice_dispatcher_worker_lease_age_seconds"
    kwargs = cluster_kwargs(workers=1, dispatcher={"feedback_every_s": 0.1})
    async with LocalCluster(nats_url, **kwargs) as cluster, Client(nats_url) as c:
        leaver = await cluster.add_agent(worker)

        async def has(name: str, labels: dict[str, str]) -> bool:
            return REGISTRY.get_sample_value(name, labels) is not None

        await set_model_quota(c.nc, "sim", QuotaSpec(tenant_limits={tenant: 2}))
        await eventually(lambda: has(quota, level))
        await eventually(lambda: has(lease, {"worker": worker}))
        await clear_model_quota(c.nc, "sim")
        await leaver.stop()  # it says it leaves: its lease ends at once
        await eventually(lambda: _not(has(quota, level)))
        await eventually(lambda: _not(has(lease, {"worker": worker})))
        assert await has(lease, {"worker": "worker-0"})


async def _not(a: Awaitable[bool]) -> bool:
    return not await a


# ------------------------------------------------------------- the dashboard and the rules

PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "inf", "nan", "le",
}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression refers to (Grafana variables removed)."""
    e = re.sub(r"\$\{?\w+(:\w+)?\}?", "1m", expr)  # $__rate_interval, ${model}, $worker
    e = re.sub(r'"(\\.|[^"\\])*"', '""', e)
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # ranges and subqueries
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)(\s*\()?", e):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in PROMQL_WORDS:
            continue
        names.add(word)
    return names


def test_metric_names_reads_promql() -> None:
    expr = (
        'sum by (worker) (rate(sluice_a_total{model=~"$model"}[$__rate_interval])) / '
        "ignoring(x) group_left sum(rate(sluice_b_bucket[5m])) > bool 0.1 and "
        "histogram_quantile(0.99, sluice_c_bucket) offset 1h or vector(1e3)"
    )
    assert metric_names(expr) == {"sluice_a_total", "sluice_b_bucket", "sluice_c_bucket"}


def exposed_names(text: str) -> set[str]:
    """Every name a query can use against the scrape (families without samples included)."""
    out: set[str] = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        out.add(name)
        if kind == "histogram":
            out |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return out


def dashboard_exprs() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    out = []
    for panel in board["panels"]:
        for t in panel.get("targets", []):
            out.append((panel["title"], t["expr"]))
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]
            q = q["query"] if isinstance(q, dict) else q
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", q)
            out.append((f"variable {var['name']}", inner.group(1) if inner else q))
    return out


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_dashboard_and_alerts_refer_only_to_exposed_metrics(stack: Stack) -> None:
    exposed = exposed_names(stack.text)
    exprs = dashboard_exprs() + [(r["alert"], r["expr"]) for r in alert_rules()]
    assert len(exprs) > 20
    missing = [
        (where, name)
        for where, expr in exprs
        for name in sorted(metric_names(expr))
        if name not in exposed
    ]
    assert missing == []
    assert all(metric_names(e) for _, e in exprs), "an expression names no metric"


TARGET_LABELS = {"instance", "job"}
"""Labels Prometheus adds to every scraped series."""


def _family_labels() -> dict[str, set[str]]:
    """Sample name -> the labels it carries, from the declarations."""
    out: dict[str, set[str]] = {}
    for d in declared_metrics():
        labels = set(d.labels) | TARGET_LABELS
        if d.kind == "histogram":
            out[f"{d.name}_bucket"] = labels | {"le"}
            out[f"{d.name}_sum"] = out[f"{d.name}_count"] = labels
        else:
            out[d.name] = labels
    return out


def label_problems(expr: str, known: dict[str, set[str]]) -> list[str]:
    """Labels an expression matches on or groups by that its metrics do not carry."""
    e = re.sub(r'"(\\.|[^"\\])*"', '""', expr)
    problems = []
    for name, matchers in re.findall(r"([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}", e):
        for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers):
            if label not in known.get(name, set()):
                problems.append(f"{name} has no label {label!r}")
    metrics = metric_names(expr)
    carried = set().union(*(known.get(m, set()) for m in metrics)) if metrics else set()
    clauses = r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)"
    for group in re.findall(clauses, e):
        for label in re.findall(r"\w+", group):
            if label not in carried:
                problems.append(f"no metric of the expression has the label {label!r}")
    return problems


def test_dashboard_and_alerts_match_and_group_by_labels_that_exist() -> None:
    """Mutation: ``sum by (model)`` over ``sluice_dispatcher_completed_total`` (band only)."""
    known = _family_labels()
    exprs = dashboard_exprs() + [(r["alert"], r["expr"]) for r in alert_rules()]
    problems = [(where, p) for where, e in exprs for p in label_problems(e, known)]
    assert problems == []
    assert label_problems("sum by (model) (rate(sluice_dispatcher_completed_total[5m]))", known)
    assert label_problems('sluice_dispatcher_workers{band="x"}', known)


ARTICLE_PANELS = [
    "Prefix-cache hit rate (by tokens)",
    "Time to first token P50 / P99",
    "Per-worker utilisation spread",
    "Throughput",
    "Queueing delay",
]


def test_dashboard_has_the_articles_five_panels_first_and_the_rest() -> None:
    board = json.loads(DASHBOARD.read_text())
    titles = [p["title"] for p in board["panels"] if p["type"] != "row"]
    assert titles[:5] == ARTICLE_PANELS
    for word in ("Quota", "Rejections", "Lease", "Flap", "drift", "Reconciliation", "errors"):
        assert any(word.lower() in t.lower() for t in titles[5:]), word
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "model", "band", "worker"} <= variables
    for p in board["panels"]:
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))


ARTICLE_ALERTS = {
    "SluiceRoutingFlapping",
    "SluiceQuotaLeak",
    "SluiceCacheIndexBloat",
    "SluiceWorkerStuckAtLimit",
    "SluiceQueueWaitAboveScaleUp",
}


def test_alert_rules_are_a_valid_rule_file() -> None:
    doc = yaml.safe_load(ALERTS.read_text())
    assert set(doc) == {"groups"}
    rules = alert_rules()
    assert {r["alert"] for r in rules} >= ARTICLE_ALERTS
    for r in rules:
        assert set(r) <= {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
        assert re.fullmatch(r"\d+[smh]", r["for"]), r["alert"]
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        assert {"summary", "description", "runbook"} <= set(r["annotations"]), r["alert"]
        anchor = r["annotations"]["runbook"].split("#", 1)[1]
        assert anchor in _anchors(), f"{r['alert']}: no section #{anchor} in docs/operations.md"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_checks_the_rules_and_the_dashboards_queries(tmp_path: Path) -> None:
    """The rule file as it is, and every dashboard query as a recording rule (Grafana's
    variables replaced by values), so that promtool parses each one."""
    done = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True)
    assert done.returncode == 0, done.stdout + done.stderr
    rules = []
    for i, (_, expr) in enumerate(dashboard_exprs()):
        e = expr.replace("$__rate_interval", "5m")
        rules.append({"record": f"sluice:dashboard_query_{i}", "expr": re.sub(r"\$\w+", ".*", e)})
    board = tmp_path / "dashboard-rules.yml"
    board.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run(["promtool", "check", "rules", str(board)], capture_output=True)
    assert done.returncode == 0, done.stdout + done.stderr


def _anchors() -> set[str]:
    """GitHub's anchors of the headings of docs/operations.md."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", OPERATIONS.read_text(), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        out.add(slug)
    return out


# ------------------------------------------------------------------------------ runbooks

_RUNBOOK = re.compile(r"<!-- runbook: ([\w-]+) -->\n```bash\n(.*?)```", re.S)
RUNBOOKS = [
    "flapping",
    "quota-leak",
    "index-bloat",
    "hot-prefix-duplication",
    "stuck-worker",
    "queue-wait",
    "upgrade",
]


def runbooks() -> dict[str, str]:
    return {m.group(1): m.group(2) for m in _RUNBOOK.finditer(OPERATIONS.read_text())}


def test_operations_has_a_runbook_per_incident() -> None:
    assert list(runbooks()) == RUNBOOKS


@pytest.mark.parametrize("name", RUNBOOKS)
def test_a_runbook_runs_as_written(name: str, stack: Stack, tmp_path: Path) -> None:
    """Each runbook's commands, as written, against ``sluice up`` (its NATS address the only
    change, through ``SLUICE_NATS_URL``); each must exit 0 and say something."""
    for line in runbooks()[name].strip().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", line],
            cwd=tmp_path,
            env=stack.env(),
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert done.returncode == 0, f"{line!r} failed:\n{done.stdout}\n{done.stderr}"
        assert (done.stdout + done.stderr).strip(), f"{line!r} printed nothing"


# ------------------------------------------------------------- the metrics reference table


@dataclass(frozen=True)
class Declared:
    name: str
    kind: str
    labels: tuple[str, ...]
    help: str
    module: str


def declared_metrics() -> list[Declared]:
    """Every Counter/Gauge/Histogram declared in the metric modules, in file order."""
    out = []
    for rel in METRIC_MODULES:
        tree = ast.parse((ROOT / rel).read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id not in ("Counter", "Gauge", "Histogram"):
                continue
            args = [ast.literal_eval(a) for a in node.args[:2]]
            labels: tuple[str, ...] = ()
            if len(node.args) > 2:
                labels = tuple(ast.literal_eval(node.args[2]))
            for kw in node.keywords:
                if kw.arg == "labelnames":
                    labels = tuple(ast.literal_eval(kw.value))
            out.append(Declared(args[0], node.func.id.lower(), labels, args[1], rel))
    return sorted(out, key=lambda d: d.name)


def reference_table() -> str:
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for d in declared_metrics():
        labels = ", ".join(f"`{lb}`" for lb in d.labels) or "—"
        meaning = d.help.replace("|", "\\|")
        rows.append(f"| `{d.name}` | {d.kind} | {labels} | {meaning} |")
    return "\n".join(rows) + "\n"


_TABLE = re.compile(r"<!-- metrics-table -->\n(.*?)<!-- /metrics-table -->", re.S)


def test_the_metrics_reference_is_what_the_modules_declare() -> None:
    """docs/operations.md's table is generated: ``python -m tests.test_observability`` prints
    it. A metric added, removed, renamed or relabelled and not in the table fails here."""
    m = _TABLE.search(OPERATIONS.read_text())
    assert m, "docs/operations.md has no <!-- metrics-table --> block"
    assert m.group(1) == reference_table()


def test_each_metric_is_declared_once_in_a_metric_module() -> None:
    names = [d.name for d in declared_metrics()]
    assert len(names) == len(set(names))
    elsewhere = []
    for path in ROOT.glob("*/**/*.py"):
        rel = path.relative_to(ROOT).as_posix()
        # build/: what `pip wheel .` leaves in the tree
        if rel.startswith((".venv", "tests/", "build/")) or rel in METRIC_MODULES:
            continue
        if re.search(r"\b(Counter|Gauge|Histogram)\(\s*\"sluice_", path.read_text()):
            elsewhere.append(rel)
    assert elsewhere == []


if __name__ == "__main__":
    print(reference_table(), end="")
