"""The Grafana dashboard, the alerting rules and the example configs in dashboards/, checked
against pinpool's real metrics and, where installed, the real Prometheus tools.

promtool and prometheus come from Debian's ``prometheus`` package (``apt-get install
prometheus``); the tests that need them are skipped, with that reason, when they are missing.
"""

from __future__ import annotations

import json
import math
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import pinpool
from pinpool.testing import FakePressure, FakeRegistrar, FakeRuntime

from .. import preloaded
from ..conftest import needs_mlock

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"
DASHBOARD_JSON = DASHBOARDS / "pinpool.json"
ALERTS = DASHBOARDS / "alerts.yml"
MiB = 1 << 20

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
_INSTALL = "install Debian's prometheus package: apt-get install --no-install-recommends prometheus"
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason=f"needs promtool on PATH ({_INSTALL})")
needs_prometheus = pytest.mark.skipif(
    PROMTOOL is None or PROMETHEUS is None, reason=f"needs the prometheus server and promtool on PATH ({_INSTALL})"
)

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# What the integration test puts in place of Grafana's variables.
SUBSTITUTIONS = {"$__rate_interval": "1m", "$job": "pinpool", "$instance": ".*", "$pool": ".*"}
# Grafana units the panels may use (a subset of grafana-data's valueFormats categories).
UNITS = {"bytes", "decbytes", "Bps", "binBps", "s", "ms", "short", "none", "percentunit", "ops", "cps"}
# Panel types whose queries the linter checks; "row" and text panels have none.
QUERY_PANELS = {"timeseries", "stat", "gauge", "table", "heatmap", "bargauge"}
METRIC = re.compile(r"\bpinpool_[a-z0-9_]+")


def load_dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD_JSON.read_text(encoding="utf-8"))
    return data


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    found: list[dict[str, Any]] = []
    for panel in dashboard.get("panels", []):
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def targets(dashboard: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(p["title"], t) for p in panels(dashboard) for t in p.get("targets", [])]


def query_variables(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for v in dashboard["templating"]["list"] if v["type"] == "query"]


def substitute(expr: str) -> str:
    for name, value in SUBSTITUTIONS.items():  # $__rate_interval first: no variable is a prefix of another
        expr = expr.replace("${" + name[1:] + "}", value).replace(name, value)
    return expr


# -- (a) generated, not edited ----------------------------------------------------------------------


def test_generated_json_is_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, str(DASHBOARDS / "generate.py"), "--check"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, f"run python dashboards/generate.py:\n{result.stdout}{result.stderr}"


def test_check_fails_on_a_hand_edited_json(tmp_path: Path) -> None:
    edited = tmp_path / "pinpool.json"
    edited.write_text(DASHBOARD_JSON.read_text(encoding="utf-8").replace('"title": "pinpool"', '"title": "mine"'))
    result = subprocess.run(
        [sys.executable, str(DASHBOARDS / "generate.py"), "--check", "--output", str(edited)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 1
    assert "out of date" in result.stderr and "generate.py" in result.stderr
    assert '-  "title": "mine"' in result.stderr  # the diff shows what changed


def test_output_is_deterministic() -> None:
    text = DASHBOARD_JSON.read_text(encoding="utf-8")
    assert text.endswith("}\n")
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"


# -- (b) lint: the grafana/dashboard-linter rules ---------------------------------------------------


def test_time_series_are_per_instance() -> None:
    """64 ranks pinning pools of one name are 64 lines, not one sum that hides the stuck rank."""
    checked = 0
    for panel in panels(load_dashboard()):
        if panel["type"] != "timeseries":
            continue
        for t in panel["targets"]:
            groupings = re.findall(r"\b(?:sum|max|min|avg|count) by \(([^)]*)\)", t["expr"])
            assert groupings, (panel["title"], t["expr"])
            for labels in groupings:
                assert {"instance", "pool"} <= {label.strip() for label in labels.split(",")}, (panel["title"], t)
            assert t["legendFormat"].startswith("{{instance}} {{pool}}"), (panel["title"], t["legendFormat"])
            checked += 1
    assert checked >= 10
    least = next(p for p in panels(load_dashboard()) if p["title"] == "Least-pinned instance")
    assert least["targets"][0]["expr"].startswith("min by (pool) (sum by (instance, pool) (pinpool_pinned_bytes")


def lint(dashboard: dict[str, Any]) -> list[str]:
    """Problems found by the dashboard-linter rules (template-datasource, template-job/instance,
    template-label-promql, template-on-time-change-reload, panel-datasource, panel-units,
    panel-title-description, target-job/instance, target-rate-interval, target-counter-agg), plus
    pinpool's own: fixed uid, schemaVersion >= 39, the pool filter on every selector."""
    problems: list[str] = []
    if dashboard.get("uid") != "pinpool":
        problems.append(f"uid must be fixed to 'pinpool', is {dashboard.get('uid')!r}")
    if not isinstance(dashboard.get("schemaVersion"), int) or dashboard["schemaVersion"] < 39:
        problems.append(f"schemaVersion must be >= 39, is {dashboard.get('schemaVersion')!r}")
    if dashboard.get("title") != "pinpool":
        problems.append(f"title must be 'pinpool', is {dashboard.get('title')!r}")

    variables = dashboard.get("templating", {}).get("list", [])
    by_name = {v.get("name"): v for v in variables}
    datasources = [v for v in variables if v.get("type") == "datasource"]
    if len(datasources) != 1:
        problems.append(f"want exactly one templated datasource variable, found {len(datasources)}")
    problems.extend(
        f"datasource variable must be name=datasource, label 'Data source', query prometheus: {ds}"
        for ds in datasources
        if (ds.get("name"), ds.get("label"), ds.get("query")) != ("datasource", "Data source", "prometheus")
    )
    for name in ("job", "instance", "pool"):
        variable = by_name.get(name)
        if variable is None:
            problems.append(f"missing the {name} template variable")
            continue
        where = f"variable {name}"
        if variable.get("type") != "query":
            problems.append(f"{where}: should be a Prometheus query, is {variable.get('type')!r}")
        if variable.get("datasource") != DATASOURCE:
            problems.append(f"{where}: should use datasource ${{datasource}}, uses {variable.get('datasource')!r}")
        if variable.get("label") != name.title():
            problems.append(f"{where}: should be labeled {name.title()!r}, is {variable.get('label')!r}")
        if not variable.get("multi") or not variable.get("includeAll"):
            problems.append(f"{where}: should be multi-select with an All option")
        if variable.get("allValue") != ".+":
            problems.append(f"{where}: allValue should be '.+', is {variable.get('allValue')!r}")
        if variable.get("refresh") != 2:
            problems.append(f"{where}: should refresh on time range change (2), is {variable.get('refresh')!r}")
        query = variable.get("query")
        form = rf"label_values\(pinpool_\w+(\{{[^}}]*\}})?, {name}\)"
        if not isinstance(query, str) or not re.fullmatch(form, query):
            problems.append(f"{where}: query should be label_values(<pinpool metric>, {name}), is {query!r}")
    for name, needs in (("instance", ['job=~"$job"']), ("pool", ['job=~"$job"', 'instance=~"$instance"'])):
        query = str(by_name.get(name, {}).get("query", ""))
        problems.extend(f"variable {name}: query must filter {m}" for m in needs if m not in query)

    ids = [p.get("id") for p in panels(dashboard)]
    if len(set(ids)) != len(ids):
        problems.append(f"panel ids are not unique: {ids}")
    for panel in panels(dashboard):
        title = panel.get("title") or f"panel {panel.get('id')}"
        if panel.get("type") not in QUERY_PANELS:
            continue
        if not panel.get("title") or not panel.get("description"):
            problems.append(f"{title}: needs a title and a description")
        if panel.get("datasource") != DATASOURCE:
            problems.append(f"{title}: does not use the templated datasource, uses {panel.get('datasource')!r}")
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
        if unit not in UNITS:
            problems.append(f"{title}: has no or an invalid unit (fieldConfig.defaults.unit): {unit!r}")
        if "gridPos" not in panel:
            problems.append(f"{title}: has no gridPos")
        panel_targets = panel.get("targets", [])
        if not panel_targets:
            problems.append(f"{title}: has no targets")
        ref_ids = [t.get("refId") for t in panel_targets]
        if len(set(ref_ids)) != len(ref_ids):
            problems.append(f"{title}: refIds are not unique: {ref_ids}")
        if panel.get("type") == "heatmap":
            if panel.get("options", {}).get("yAxis", {}).get("unit") not in UNITS:
                problems.append(f"{title}: heatmap needs options.yAxis.unit")
            if any(t.get("format") != "heatmap" for t in panel_targets):
                problems.append(f"{title}: heatmap targets need format=heatmap")
        for target in panel_targets:
            problems.extend(f"{title} [{target.get('refId')}]: {p}" for p in lint_target(target))
    return problems


def lint_target(target: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    if target.get("datasource") != DATASOURCE:
        problems.append(f"does not use the templated datasource, uses {target.get('datasource')!r}")
    expr = target.get("expr")
    if not isinstance(expr, str) or not expr:
        return [*problems, "has no expr"]
    if len(re.findall(r"\bpinpool_\w+", expr)) != len(re.findall(r"\bpinpool_\w+\{", expr)):
        problems.append(f"every selector needs the job/instance/pool matchers: {expr}")
    problems.extend(
        f"selector {{{matchers}}} lacks {needed}"
        for matchers in re.findall(r"\bpinpool_\w+\{([^}]*)\}", expr)
        for needed in ('job=~"$job"', 'instance=~"$instance"', 'pool=~"$pool"')
        if needed not in matchers
    )
    problems.extend(
        f"range [{window}] should be [$__rate_interval]: {expr}"
        for window in re.findall(r"\[([^\]]*)\]", expr)
        if window != "$__rate_interval"
    )
    problems.extend(
        f"{call[1]}() should take one selector over [$__rate_interval]: {expr}"
        for call in re.finditer(r"\b(rate|irate|increase)\(", expr)
        if not re.match(r"pinpool_\w+\{[^}]*\}\[\$__rate_interval\]\)", expr[call.end() :])
    )
    # target-counter-agg: a counter (and a histogram's series) only under rate/irate/increase.
    problems.extend(
        f"{match.group(0)[:-1]} is not aggregated with rate, irate or increase: {expr}"
        for match in re.finditer(r"\bpinpool_\w+(_total|_bucket|_sum|_count)\{", expr)
        if not re.search(r"\b(rate|irate|increase)\($", expr[: match.start()])
    )
    if expr.count("(") != expr.count(")") or expr.count("{") != expr.count("}"):
        problems.append(f"unbalanced brackets: {expr}")
    return problems


def test_dashboard_lint() -> None:
    problems = lint(load_dashboard())
    assert not problems, "\n".join(problems)


def _mutate(dashboard: dict[str, Any], how: str) -> None:
    panel = next(p for p in dashboard["panels"] if p["type"] == "timeseries")
    target = panel["targets"][0]
    variables = dashboard["templating"]["list"]
    if how == "fixed panel datasource":
        panel["datasource"] = {"type": "prometheus", "uid": "abc123"}
    elif how == "fixed target datasource":
        target["datasource"] = {"type": "prometheus", "uid": "abc123"}
    elif how == "no unit":
        del panel["fieldConfig"]["defaults"]["unit"]
    elif how == "fixed rate window":
        target["expr"] = 'rate(pinpool_registered_bytes_total{job=~"$job", instance=~"$instance", pool=~"$pool"}[5m])'
    elif how == "no job matcher":
        target["expr"] = 'pinpool_pinned_bytes{instance=~"$instance", pool=~"$pool"}'
    elif how == "raw counter":
        target["expr"] = 'pinpool_rollbacks_total{job=~"$job", instance=~"$instance", pool=~"$pool"}'
    elif how == "no datasource variable":
        variables[:] = [v for v in variables if v["type"] != "datasource"]
    elif how == "no instance variable":
        variables[:] = [v for v in variables if v["name"] != "instance"]
    elif how == "uid":
        dashboard["uid"] = None
    elif how == "old schema":
        dashboard["schemaVersion"] = 36
    elif how == "no description":
        panel["description"] = ""


@pytest.mark.parametrize(
    "how",
    [
        "fixed panel datasource", "fixed target datasource", "no unit", "fixed rate window", "no job matcher",
        "raw counter", "no datasource variable", "no instance variable", "uid", "old schema", "no description",
    ],
)  # fmt: skip
def test_lint_catches(how: str) -> None:
    dashboard = load_dashboard()
    _mutate(dashboard, how)
    assert lint(dashboard), f"the lint missed: {how}"


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses every panel query (variables substituted) as a recording rule."""
    dashboard = load_dashboard()
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for n, (_title, target) in enumerate(targets(dashboard)):
        lines += [f"      - record: dashboard:query_{n}", f"        expr: {json.dumps(substitute(target['expr']))}"]
    rules = tmp_path / "queries.yml"
    rules.write_text("\n".join(lines) + "\n")
    result = subprocess.run([PROMTOOL or "promtool", "check", "rules", str(rules)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# -- (c) every name exists in a real exposition -----------------------------------------------------


@pytest.fixture(scope="module")
def exposition() -> str:
    """What a registry exposes after a pin, a failed pin, a cancelled pin, an unpin failure,
    with one pool still open."""
    registry = CollectorRegistry()

    def pool(**kw: Any) -> pinpool.PinnedPool:
        return pinpool.PinnedPool(
            size=4 * MiB, chunk_bytes=MiB, name="expo", registry=registry, register_workers=1, **kw
        )

    with pool(runtime=FakeRuntime()):
        pass
    with pytest.raises(pinpool.PinError), pool(runtime=FakeRuntime(fail_register_on=2), max_retries=0):
        pass
    with pytest.raises(pinpool.UnpinError), pool(runtime=FakeRuntime(fail_unregister_on=1)):
        pass

    async def cancelled() -> None:
        with anyio.move_on_after(0.05):
            async with pinpool.PinnedPool(
                size=64 * MiB, chunk_bytes=MiB, runtime=FakeRuntime(register_delay=0.01), name="expo",
                registry=registry, register_workers=1,
            ):  # fmt: skip
                pytest.fail("the body must not run")

    anyio.run(cancelled)
    with pool(runtime=FakeRuntime(), node_slots=2, node_dir=tempfile.mkdtemp(prefix="pinpool-node-")):
        pass  # node pacing: pinpool_node_wait_seconds{kind="slot"}
    # Transfer registrars: a registration refused, an unregistration failed, and registrations held.
    with pytest.raises(pinpool.PinError):
        with pool(runtime=FakeRuntime(), registrars=[FakeRegistrar("engine", fail_register_on=2)], max_retries=0):
            pass
    with (
        pytest.raises(pinpool.UnpinError),
        pool(runtime=FakeRuntime(), registrars=[FakeRegistrar("engine", fail_unregister_on=1)]),
    ):
        pass
    # An elastic pool with its policy loop: a grow, a shrink, a reading of pressure it woke on.
    pressure = FakePressure()
    with (
        pool(runtime=FakeRuntime(), registrars=[FakeRegistrar("engine")]),
        pool(runtime=FakeRuntime(), reserve=8 * MiB, grow_step=2 * MiB, elastic=pinpool.ElasticPolicy(step=2 * MiB),
             on_give_up=lambda nbytes: [], pressure=pressure) as elastic,
    ):  # fmt: skip
        elastic.grow_sync(nbytes=2 * MiB)
        elastic.shrink_sync(to_pages=4 * MiB)
        pressure.set(FakePressure.reading(0.5, used=1 << 30, limit=8 << 30))
        deadline = time.monotonic() + 30
        while registry.get_sample_value("pinpool_memory_pressure_psi", {"pool": "expo", "runtime": "fake"}) is None:
            assert time.monotonic() < deadline, "the policy loop never read the pressure set"
            time.sleep(0.002)
        return generate_latest(registry).decode()


def exposed(text: str) -> tuple[set[str], set[str], dict[str, str]]:
    """Sample names, label names, and the family (with type) each sample name belongs to."""
    samples: set[str] = set()
    labels: set[str] = set()
    family_of: dict[str, str] = {}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.add(sample.name)
            labels.update(sample.labels)
            # The base name plus the suffix its type allows (a counter's _created is not one).
            if any(sample.name == family.name + s for s in suffixes.get(family.type, ())):
                family_of[sample.name] = f"{family.name} ({family.type})"
    return samples, labels, family_of


def referenced_names() -> dict[str, set[str]]:
    dashboard = load_dashboard()
    names: dict[str, set[str]] = {}
    texts = [("dashboard", t["expr"]) for _, t in targets(dashboard)]
    texts += [("dashboard variable", v["query"]) for v in query_variables(dashboard)]
    texts += [("alerts.yml", ALERTS.read_text(encoding="utf-8"))]
    for where, text in texts:
        for name in METRIC.findall(text):
            names.setdefault(name, set()).add(where)
    return names


def test_every_referenced_metric_exists(exposition: str) -> None:
    samples, _labels, family_of = exposed(exposition)
    names = referenced_names()
    assert len(names) >= 10, sorted(names)  # the regex found the queries
    missing = {name: sorted(where) for name, where in names.items() if name not in samples}
    assert not missing, f"not in the exposition: {missing}"
    # Each is a proper series of its family: counters with _total, histograms by _bucket/_sum/_count.
    wrong = sorted(name for name in names if name not in family_of)
    assert not wrong, f"not a base name + its type's suffix: {wrong}"


def test_every_referenced_label_exists(exposition: str) -> None:
    _samples, exposed_labels, _family = exposed(exposition)
    known = exposed_labels | {"job", "instance"}  # target labels Prometheus adds
    dashboard = load_dashboard()
    texts = [t["expr"] for _, t in targets(dashboard)] + [v["query"] for v in query_variables(dashboard)]
    texts.append(ALERTS.read_text(encoding="utf-8"))
    used: set[str] = set()
    for text in texts:
        for group in re.findall(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)", text):
            used.update(label.strip() for label in group.split(",") if label.strip())
        used.update(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"", text))
        used.update(re.findall(r"\$labels\.(\w+)", text))
        used.update(re.findall(r"label_values\(.*, (\w+)\)", text))
    assert {"pool", "phase", "reason", "cause", "le", "job", "instance", "registrar", "op"} <= used
    assert used <= known, f"labels not exposed by pinpool (nor job/instance): {sorted(used - known)}"


# -- (d) promtool check metrics -------------------------------------------------------------------------


@needs_promtool
def test_promtool_check_metrics(exposition: str) -> None:
    result = subprocess.run(
        [PROMTOOL or "promtool", "check", "metrics"], input=exposition, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


# -- (e) rules -----------------------------------------------------------------------------------------


@needs_promtool
def test_promtool_check_rules() -> None:
    result = subprocess.run([PROMTOOL or "promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 7 rules found" in result.stdout


@needs_promtool
def test_promtool_rule_unit_tests() -> None:
    result = subprocess.run(
        [PROMTOOL or "promtool", "test", "rules", str(DASHBOARDS / "alerts_test.yml")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def alert_names() -> list[str]:
    return re.findall(r"^\s*- alert: (\w+)$", ALERTS.read_text(encoding="utf-8"), flags=re.MULTILINE)


def test_every_alert_is_unit_tested_firing_and_not() -> None:
    names = alert_names()
    assert names == [
        "PinpoolRegistrationFailures", "PinpoolUnpinFailures", "PinpoolRollbacks", "PinpoolSlowChunkRegistration",
        "PinpoolPoolBelowTarget", "PinpoolTransferRegistrationFailures", "PinpoolElasticPoolAtFloor",
    ]  # fmt: skip
    tests = (DASHBOARDS / "alerts_test.yml").read_text(encoding="utf-8")
    blocks = re.split(r"\n\s*- eval_time:", tests)[1:]
    for name in names:
        mine = [b for b in blocks if re.search(rf"alertname: {name}\n", b)]
        assert any("exp_alerts: []" in b for b in mine), f"{name}: no not-firing case"
        assert any("exp_labels:" in b for b in mine), f"{name}: no firing case"
    text = ALERTS.read_text(encoding="utf-8")
    for rule in re.split(r"\n\s*- alert: ", text)[1:]:
        assert re.search(r"\n\s*for: \d+m\n", rule), rule
        assert re.search(r"severity: (warning|critical)\n", rule), rule
        assert "summary:" in rule and "description:" in rule and "docs/operations.md" in rule, rule
        assert "{{ $labels.pool }}" in rule, rule


@needs_promtool
def test_example_prometheus_config() -> None:
    result = subprocess.run(
        [PROMTOOL or "promtool", "check", "config", str(DASHBOARDS / "prometheus.yml")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    text = (DASHBOARDS / "prometheus.yml").read_text(encoding="utf-8")
    assert "127.0.0.1:9464" in text and "alerts.yml" in text


def test_grafana_provisioning_files() -> None:
    datasource = (DASHBOARDS / "provisioning" / "datasources" / "prometheus.yml").read_text(encoding="utf-8")
    assert "type: prometheus" in datasource and "url: http://prometheus:9090" in datasource
    provider = (DASHBOARDS / "provisioning" / "dashboards" / "pinpool.yml").read_text(encoding="utf-8")
    assert "type: file" in provider and re.search(r"^\s+path: /\S+", provider, flags=re.MULTILINE)
    for text in (datasource, provider):
        assert text.startswith("#") and "\napiVersion: 1\n" in text and "\t" not in text


# -- (e2) the compose stack: checked by its configuration here, not started (no Docker engine in CI) ---------

COMPOSE = DASHBOARDS / "compose.yaml"
METRICS_PORT = 9464  # the one metrics port: docs, CLI examples, scrape configs


def load_yaml(path: Path) -> Any:
    yaml = pytest.importorskip("yaml", reason="needs PyYAML (a dependency of the dev tools: mkdocs)")
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def compose_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """A service's bind mounts as {path in the container: path on the host}, relative to compose.yaml."""
    mounts: dict[str, Path] = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):  # a bind mount; anything else is a named volume
            mounts[target] = (COMPOSE.parent / source).resolve()
    return mounts


def test_compose_stack_is_wired() -> None:
    compose = load_yaml(COMPOSE)
    services = compose["services"]
    assert set(services) == {"prometheus", "grafana"}
    named = set(compose.get("volumes") or {})
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in named, f"{name}: named volume {source} is not declared"
        for target, source in compose_mounts(service).items():
            assert source.exists(), f"{name}: mounts {source} (at {target}), which does not exist"
            assert source.is_relative_to(DASHBOARDS), f"{name}: mounts {source} from outside dashboards/"

    # Grafana's data source is the prometheus service by its name on the compose network, on the
    # port Prometheus listens on in its container: never localhost (inside Grafana's container
    # that is Grafana itself).
    grafana = compose_mounts(services["grafana"])
    datasources = load_yaml(grafana["/etc/grafana/provisioning/datasources"] / "prometheus.yml")["datasources"]
    urls = [urllib.parse.urlsplit(d["url"]) for d in datasources if d["type"] == "prometheus"]
    assert [(u.scheme, u.hostname, u.port) for u in urls] == [("http", "prometheus", 9090)], urls
    assert all(u.hostname not in {"localhost", "127.0.0.1", "::1"} for u in urls)
    assert any(port.endswith(":9090") for port in services["prometheus"]["ports"])

    # The dashboard provider's folder holds pinpool.json in the container.
    providers = load_yaml(grafana["/etc/grafana/provisioning/dashboards"] / "pinpool.yml")["providers"]
    folder = providers[0]["options"]["path"]
    assert grafana[f"{folder}/pinpool.json"] == DASHBOARD_JSON
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{folder}/pinpool.json"

    # Prometheus reads the compose config and, beside it (rule_files are relative), alerts.yml.
    prometheus = compose_mounts(services["prometheus"])
    config_path = prometheus["/etc/prometheus/prometheus.yml"]
    config = load_yaml(config_path)
    assert config["rule_files"] == ["alerts.yml"]
    assert prometheus["/etc/prometheus/alerts.yml"] == ALERTS == config_path.parent / "alerts.yml"
    # The scraped processes run on the host: host.docker.internal, which Linux needs declared.
    assert "host.docker.internal:host-gateway" in services["prometheus"]["extra_hosts"]
    targets = {
        job["job_name"]: t for job in config["scrape_configs"] for s in job["static_configs"] for t in s["targets"]
    }
    assert targets["pinpool"] == f"host.docker.internal:{METRICS_PORT}"
    assert all(t.startswith("host.docker.internal:") for t in targets.values()), targets
    # Grafana's $__rate_interval needs the scrape interval: the data source says the same.
    assert datasources[0]["jsonData"]["timeInterval"] == config["global"]["scrape_interval"]


EXAMPLE_SERVER_PORT = 8080  # examples/kv_offload_server.py's default (8000 is mkdocs serve's)


def test_the_example_servers_port_is_scraped() -> None:
    source = (ROOT / "examples" / "kv_offload_server.py").read_text(encoding="utf-8")
    assert f"DEFAULT_PORT = {EXAMPLE_SERVER_PORT}" in source
    config = load_yaml(DASHBOARDS / "prometheus-compose.yml")
    targets = {job["job_name"]: s["targets"] for job in config["scrape_configs"] for s in job["static_configs"]}
    assert targets["kv-offload-server"] == [f"host.docker.internal:{EXAMPLE_SERVER_PORT}"]


def test_one_metrics_port_everywhere() -> None:
    """9464 in every doc, config and command that names pinpool's metrics port; no other."""
    texts = {p: p.read_text(encoding="utf-8") for p in [*ROOT.glob("docs/*.md"), *DASHBOARDS.glob("*.y*ml")]}
    texts[DASHBOARDS / "README.md"] = (DASHBOARDS / "README.md").read_text(encoding="utf-8")
    texts[ROOT / "README.md"] = (ROOT / "README.md").read_text(encoding="utf-8")
    # serve(9464, ...), --metrics-port 9464, http://127.0.0.1:9464/metrics
    ports = re.compile(r"(?:serve\(|--metrics-port[ =])(\d+)|:(\d+)/metrics\b")
    found = {
        (path.relative_to(ROOT).as_posix(), int(a or b)) for path, text in texts.items() for a, b in ports.findall(text)
    }
    # 8080: examples/kv_offload_server.py serves /metrics on its own HTTP port.
    wrong = sorted((path, port) for path, port in found if port not in {METRICS_PORT, EXAMPLE_SERVER_PORT})
    assert not wrong, f"metrics port other than {METRICS_PORT}: {wrong}"
    assert ("dashboards/README.md", METRICS_PORT) in found and ("docs/observability.md", METRICS_PORT) in found
    readme = texts[DASHBOARDS / "README.md"]
    assert f"--metrics-port {METRICS_PORT}" in readme and "docker compose -f dashboards/compose.yaml up" in readme


@needs_promtool
def test_compose_prometheus_config() -> None:
    result = subprocess.run(
        [PROMTOOL or "promtool", "check", "config", str(DASHBOARDS / "prometheus-compose.yml")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def compose_client() -> list[str] | None:
    """`docker compose` (v2) or Debian's `docker-compose` (v1): both parse a file without an engine."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True, timeout=60).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def test_compose_config_parses(tmp_path: Path) -> None:
    client = compose_client()
    if client is None:
        pytest.skip("needs docker compose or docker-compose (Debian: apt-get install docker-compose)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_"))}
    result = subprocess.run(
        [*client, "-f", str(COMPOSE), "config"], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # v1 prints the short syntax back, v2 the long one (host_ip: 127.0.0.1, host.docker.internal=host-gateway).
    assert "host.docker.internal" in result.stdout and "host-gateway" in result.stdout, result.stdout
    assert "127.0.0.1" in result.stdout and "prometheus:" in result.stdout, result.stdout


def test_readme_names_every_panel_and_alert() -> None:
    readme = (DASHBOARDS / "README.md").read_text(encoding="utf-8")
    missing = [p["title"] for p in panels(load_dashboard()) if p["title"] not in readme]
    missing += [name for name in alert_names() if name not in readme]
    assert not missing, f"dashboards/README.md does not mention: {missing}"
    assert "generate.py --check" in readme and "promtool test rules" in readme


# -- (f) the dashboard's queries against a real Prometheus scraping a real pinpool ------------------------

_CHILD = textwrap.dedent(
    """
    import sys
    import tempfile
    import time

    import anyio

    import pinpool
    from pinpool.metrics import serve
    from pinpool.testing import FakePressure, FakeRegistrar, FakeRuntime

    MiB = 1 << 20
    deadline = time.monotonic() + float(sys.argv[1])


    def pool(**kw):
        return pinpool.PinnedPool(size=4 * MiB, chunk_bytes=MiB, name="it", **kw)


    async def cancelled():
        with anyio.move_on_after(0.05):
            async with pinpool.PinnedPool(
                size=64 * MiB, chunk_bytes=MiB, runtime=FakeRuntime(register_delay=0.01), name="it", register_workers=1
            ):
                raise AssertionError("the body must not run")


    node_dir = tempfile.mkdtemp(prefix="pinpool-node-")
    server, _thread = serve(0, addr="127.0.0.1")
    try:
        with pool(runtime=FakeRuntime(fail_register_on=2), register_workers=1, max_retries=0):
            raise AssertionError("the body must not run")
    except pinpool.PinError:
        pass
    anyio.run(cancelled)
    try:
        with pool(runtime=FakeRuntime(fail_unregister_on=1), register_workers=1):
            pass
    except pinpool.UnpinError:
        pass
    try:  # a transfer engine refuses a registration
        with pool(runtime=FakeRuntime(), registrars=[FakeRegistrar("engine", fail_register_on=2)], max_retries=0):
            raise AssertionError("the body must not run")
    except pinpool.PinError:
        pass
    pressure = FakePressure()  # an elastic pool's policy loop reads it: PSI 0.5 %, calm
    pressure.set(FakePressure.reading(0.5, used=1 << 30, limit=8 << 30))
    elastic = pool(runtime=FakeRuntime(), reserve=8 * MiB, grow_step=2 * MiB, elastic=pinpool.ElasticPolicy(),
                   on_give_up=lambda nbytes: [], pressure=pressure)
    with pool(runtime=FakeRuntime(), registrars=[FakeRegistrar("engine")]), elastic:  # stay open
        print(server.server_port, flush=True)
        # Keep pinning short-lived pools so rates and quantiles have increases to work on.
        for _ in range(1000):
            if time.monotonic() > deadline:
                break
            elastic.grow_sync(nbytes=2 * MiB)
            elastic.shrink_sync(to_pages=4 * MiB)
            with pool(runtime=FakeRuntime(register_delay=0.003, unregister_delay=0.001), register_workers=2,
                      node_slots=2, node_dir=node_dir, registrars=[FakeRegistrar("engine", register_delay=0.002)]):
                time.sleep(0.05)
            time.sleep(0.2)
    """
)

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only, whatever http_proxy says


def api(port: int, path: str, **params: str) -> Any:
    url = f"http://127.0.0.1:{port}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with _NO_PROXY.open(url, timeout=5) as response:
        body = json.loads(response.read().decode())
    assert body.get("status") == "success", body
    return body["data"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(series["value"][1])) for series in result)


@needs_prometheus
def test_dashboard_queries_against_real_prometheus(tmp_path: Path) -> None:
    dashboard = load_dashboard()
    queries = [(title, t["refId"], substitute(t["expr"])) for title, t in targets(dashboard)]
    child_log = (tmp_path / "child.log").open("w")
    prometheus_log = (tmp_path / "prometheus.log").open("w")
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, "90"], stdout=subprocess.PIPE, stderr=child_log, text=True, cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"},
    )  # fmt: skip
    prometheus: subprocess.Popen[bytes] | None = None
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], 60)
        line = child.stdout.readline() if ready else ""
        assert line.strip().isdigit(), f"the child did not start: {line!r}\n{(tmp_path / 'child.log').read_text()}"
        child_port, prometheus_port = int(line), free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            textwrap.dedent(
                f"""
                global:
                  scrape_interval: 1s
                  scrape_timeout: 1s
                  evaluation_interval: 1s
                rule_files:
                  - {ALERTS}
                scrape_configs:
                  - job_name: pinpool
                    static_configs:
                      - targets: ["127.0.0.1:{child_port}"]
                """
            )
        )
        prometheus = subprocess.Popen(
            [
                PROMETHEUS or "prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{prometheus_port}", "--log.level=warn",
            ],
            stdout=prometheus_log, stderr=subprocess.STDOUT,
        )  # fmt: skip

        deadline = time.monotonic() + 60
        pending = list(queries)
        while pending and time.monotonic() < deadline:
            assert prometheus.poll() is None, (tmp_path / "prometheus.log").read_text()
            assert child.poll() is None, (tmp_path / "child.log").read_text()
            time.sleep(0.5)
            try:
                for title, ref, expr in list(pending):
                    result = api(prometheus_port, "/api/v1/query", query=expr)["result"]
                    results[(title, ref)] = result
                    if result and finite(result):
                        pending.remove((title, ref, expr))
            except OSError:  # not listening yet
                continue
        assert not pending, "queries with no (finite) result:\n" + "\n".join(
            f"{title} [{ref}]: {expr} -> {results.get((title, ref))}" for title, ref, expr in pending
        )
        pools = {series["metric"].get("pool") for result in results.values() for series in result}
        assert "it" in pools, pools

        # The variables' label_values() queries find the job, the instance and the pool.
        want = {"job": "pinpool", "instance": f"127.0.0.1:{child_port}", "pool": "it"}
        for variable in query_variables(dashboard):
            match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"])
            assert match, variable["query"]
            values = api(prometheus_port, f"/api/v1/label/{match[2]}/values", **{"match[]": substitute(match[1])})
            assert want[variable["name"]] in values, (variable["query"], values)

        # alerts.yml loads and evaluates against the real series without errors, and the event
        # alerts see the child's failures (new series: pending, "for" is 1m).
        groups = api(prometheus_port, "/api/v1/rules")["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        assert sorted(rule["name"] for rule in rules) == sorted(alert_names())
        assert all(rule["health"] == "ok" for rule in rules), rules
        deadline = time.monotonic() + 20
        expected = {
            "PinpoolRegistrationFailures", "PinpoolUnpinFailures", "PinpoolRollbacks",
            "PinpoolTransferRegistrationFailures",
        }  # fmt: skip
        active: set[str] = set()
        while not expected <= active and time.monotonic() < deadline:
            alerts = api(prometheus_port, "/api/v1/alerts")["alerts"]
            active = {a["labels"]["alertname"] for a in alerts if a["labels"].get("pool") == "it"}
            time.sleep(0.5)
        assert expected <= active, active
    finally:
        for process in (prometheus, child):
            if process is not None and process.poll() is None:
                process.kill()
            if process is not None:
                process.wait(timeout=30)
        if child.stdout is not None:
            child.stdout.close()
        child_log.close()
        prometheus_log.close()


# -- (g) the dashboard's picture in the docs: dashboards/render.py --------------------------------------

PICTURE = ROOT / "docs" / "_static" / "dashboard.svg"


def load_render() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("dashboards_render", DASHBOARDS / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def drawn_titles() -> list[str]:
    return [p["title"] for p in panels(load_dashboard()) if p["type"] in ("stat", "timeseries")]


def svg_texts(svg: str) -> list[str]:
    import xml.etree.ElementTree as ElementTree

    root = ElementTree.fromstring(svg)  # well-formed, or this raises
    return [element.text or "" for element in root.iter("{http://www.w3.org/2000/svg}text")]


def test_the_picture_is_drawn_from_the_answers_where_the_dashboard_puts_the_panels() -> None:
    render, dashboard = load_render(), load_dashboard()
    start, step = 1000.0, render.SCRAPE_SECONDS
    rising = [[start + k * step, str(min(1.0, k / 5))] for k in range(10)]
    later = [[start + (20 + k) * step, "1"] for k in range(5)]  # the pool closed between: a gap
    answers = {
        (p["title"], t["refId"]): []
        if "failures" in p["title"]
        else [{"metric": {"pool": "kv"}, "values": rising + later}]
        for p in panels(dashboard)
        if p["type"] in render.DRAWN
        for t in p["targets"]
    }
    svg = render.render(dashboard, answers, start, start + 30 * step, held=start + 9 * step)
    texts = svg_texts(svg)
    assert all(title in texts for title in drawn_titles())
    assert "Chunk registration latency distribution" not in texts  # the heatmap is not drawn
    failures = sum("failures" in title for title in drawn_titles())  # their answers are empty: "No data"
    assert failures == 2 and texts.count("No data") == failures
    assert "100%" in texts  # the stat of a percentunit panel at the held moment
    drawn = [p for p in panels(dashboard) if p["type"] == "timeseries" and "failures" not in p["title"]]
    assert svg.count("<polyline") == 2 * sum(len(p["targets"]) for p in drawn)  # each line in two runs: the gap


def test_the_committed_picture_shows_every_panel_it_can() -> None:
    """Regenerate it (dashboards/render.py) when the dashboard's panels change."""
    texts = svg_texts(PICTURE.read_text(encoding="utf-8"))
    assert [title for title in drawn_titles() if title not in texts] == []


@needs_prometheus
@needs_mlock
def test_the_picture_from_a_real_scrape(tmp_path: Path) -> None:
    out = tmp_path / "dashboard.svg"
    done = preloaded.run(
        [sys.executable, str(DASHBOARDS / "render.py"), "--out", str(out), "--size", "64MiB"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    texts = svg_texts(out.read_text())
    assert all(title in texts for title in drawn_titles())
    assert "64 MiB" in texts and "host:9464 kv" in texts  # the stat row while held, a legend
