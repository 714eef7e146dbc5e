"""The monitoring files: the Prometheus alerting rules (``deploy/prometheus/alerts.yml``, with
their promtool unit tests in ``alerts_test.yml``) and the Grafana dashboard
(``deploy/grafana/transferd.json``).

* ``promtool check rules`` accepts the rules, ``promtool test rules`` passes (each alert fires on a
  synthetic sick series and not on the healthy ones), and promtool parses every query of the
  dashboard as PromQL.
* Every rule has a severity and points the operator to its section of docs/OPERATIONS.md; the
  dashboard is importable (a Prometheus datasource variable that every panel and query uses).
* Against a live scrape of a real receiver and real senders that ran rooms (successes, a failure,
  refusals, dropped frames, a heartbeat miss, a live room): every metric the rules and the
  dashboard query is exported, with the labels they select and group by, and of the type their
  functions need (``rate`` of counters, ``histogram_quantile`` of ``_bucket`` series, ...).

``promtool`` is an external tool (Debian package ``prometheus``): when it is missing the tests
that need it fail under CI (``CI`` set) and are skipped, with the reason, elsewhere; so are the
tests that read the rules without PyYAML.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from transferd.errors import BadRequest
from transferd.protocol.room import RoomState

from .harness import Cluster, fill_random
from .rooms import expect, make_room, submit_all

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "transferd.json"
OPERATIONS = ROOT / "docs" / "OPERATIONS.md"
APT = "apt-get install -y --no-install-recommends prometheus"
SEVERITIES = {"warning", "critical"}
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h", "$job": ".*", "$instance": ".*"}
TARGET_LABELS = {"job", "instance"}  # added by Prometheus to every scraped series


def missing(why: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        missing(f"promtool is not installed ({APT})")
    assert path is not None
    return path


def rules() -> list[dict[str, Any]]:
    try:
        import yaml
    except ImportError:
        missing("PyYAML is not installed (it comes with the sglang extra: pip install -e '.[test,sglang]')")
    data = yaml.safe_load(RULES.read_text())
    return [rule for group in data["groups"] for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out += p.get("panels", [])  # a collapsed row keeps its panels inside
    return out


def dashboard_queries(dash: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(where, expr, legend) of every query: panel targets and query variables, whose
    ``label_values(selector, label)`` is read as the selector and the label."""
    out = []
    for p in panels(dash):
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r} {t['refId']}", t["expr"], t.get("legendFormat", "")))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q)
            assert m, f"variable {v['name']}: {q!r} is not label_values(selector, label)"
            out.append((f"variable {v['name']}", m.group(1), "{{" + m.group(2) + "}}"))
    return out


def promql(expr: str) -> str:
    """A dashboard query with Grafana's variables replaced, as Prometheus would receive it."""
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"an unknown Grafana variable in {expr!r}"
    return expr


# -- what a query refers to ----------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_FUNCTION_OF = re.compile(r"\b(rate|irate|increase|histogram_quantile|min_over_time|max_over_time|delta|deriv)"
                          r"\s*\((?:[^(),{}]*,)?\s*([a-zA-Z_:][a-zA-Z0-9_:]*)")
_TEMPLATE_LABEL = re.compile(r"\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)|\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")


def metric_names(expr: str) -> set[str]:
    return {name for name in _IDENT.findall(_STRING.sub('""', expr)) if name.startswith("transferd_")}


def selected_labels(expr: str) -> dict[str, set[str]]:
    """The label names each metric's selectors match on: ``{name: {label, ...}}``."""
    out: dict[str, set[str]] = {}
    for name, body in _SELECTOR.findall(_STRING.sub('""', expr)):
        out.setdefault(name, set()).update(_MATCHER.findall(body))
    return out


def grouping_labels(expr: str) -> set[str]:
    out: set[str] = set()
    for body in _GROUPING.findall(expr):
        out.update(x.strip() for x in body.split(",") if x.strip())
    return out


def test_the_query_readers_read_what_they_should() -> None:
    expr = ('sum by (instance, reason) (rate(transferd_rooms_total{outcome="failed", job=~"transferd_x"}[5m]))'
            ' / on (job) group_left histogram_quantile(0.9, transferd_room_duration_seconds_bucket)')
    assert metric_names(expr) == {"transferd_rooms_total", "transferd_room_duration_seconds_bucket"}
    assert selected_labels(expr) == {"transferd_rooms_total": {"outcome", "job"}}
    assert grouping_labels(expr) == {"instance", "reason", "job"}
    assert _FUNCTION_OF.findall(expr) == [("rate", "transferd_rooms_total"),
                                          ("histogram_quantile", "transferd_room_duration_seconds_bucket")]


# -- the files themselves --------------------------------------------------------------------------

def test_promtool_checks_and_unit_tests_the_alerting_rules() -> None:
    tool = promtool()
    check = subprocess.run([tool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(rules())} rules found" in check.stdout
    test = subprocess.run([tool, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=120)
    assert test.returncode == 0, test.stdout + test.stderr
    assert "SUCCESS" in test.stdout


def test_every_alert_is_unit_tested_firing() -> None:
    tested = set(re.findall(r"^\s*alertname:\s*(\w+)\s*$", RULE_TESTS.read_text(), re.M))
    alerts = {r["alert"] for r in rules()}
    assert alerts == tested
    # and each of them has at least one expected firing (exp_alerts) in alerts_test.yml
    text = RULE_TESTS.read_text()
    for alert in alerts:
        assert re.search(rf"alertname: {alert}\n\s+exp_alerts:", text), f"{alert} is never expected to fire"


def test_every_dashboard_query_is_promql(tmp_path: Path) -> None:
    tool = promtool()
    queries = dashboard_queries(dashboard())
    rule_file = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": promql(expr)} for i, (_, expr, _) in enumerate(queries)]}]}
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(json.dumps(rule_file))  # JSON is YAML
    out = subprocess.run([tool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr + "\n" + "\n".join(q for _, q, _ in queries)
    assert f"SUCCESS: {len(queries)} rules found" in out.stdout


def test_every_alert_has_a_severity_and_a_runbook_section() -> None:
    text = re.sub(r"^```.*?^```", "", OPERATIONS.read_text(), flags=re.M | re.S)  # not the shell comments
    headings = {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}
    alerts = rules()
    assert len(alerts) >= 5
    for r in alerts:
        assert r["labels"]["severity"] in SEVERITIES, r["alert"]
        ann = r["annotations"]
        assert set(ann) == {"summary", "description", "runbook"}, r["alert"]
        assert ann["runbook"] == f"docs/OPERATIONS.md#{r['alert'].lower()}", r["alert"]
        assert r["alert"].lower() in headings, f"docs/OPERATIONS.md has no section {r['alert']}"
    # the daemon-down rule reads the scrape job that docs/OPERATIONS.md configures
    down = next(r for r in alerts if r["alert"] == "TransferdDown")
    assert down["expr"].strip() == 'up{job="transferd"} == 0'
    assert "job_name: transferd" in OPERATIONS.read_text()


def test_the_dashboard_is_importable_with_a_datasource_variable() -> None:
    dash = dashboard()
    assert dash["id"] is None and dash["uid"] and dash["title"] == "transferd"  # import makes the id
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ds = {"type": "prometheus", "uid": "${datasource}"}
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids))
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == ds, v["name"]
    for p in panels(dash):
        if p["type"] == "row":
            continue
        assert p["datasource"] == ds and p["targets"], p["title"]
        assert all(t["datasource"] == ds and t["expr"].strip() for t in p["targets"]), p["title"]
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
    titles = " / ".join(p["title"].lower() for p in panels(dash))
    for topic in ("rooms ended", "duration", "by kind", "by path", "in flight", "refused", "heartbeat",
                  "live rooms", "registered ranks", "daemons"):
        assert topic in titles, topic


# -- against a live scrape ---------------------------------------------------------------------------

def _scrape(port: int) -> str:
    text: str = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return text


def test_every_metric_queried_is_exported_by_live_daemons(cluster: Cluster) -> None:
    # a receiver that gives a silent sender up within a second
    ep, dc, dpool = cluster.receiver(heartbeat_interval_s=0.2, heartbeat_misses=3)
    fill_random(dpool, 1)
    pcs, spools = cluster.group("prefill0", 1, [ep])
    # a group whose data frames are all dropped (over ZeroMQ: the fault is applied there)
    lossy, lpools = cluster.group("lossy0", 1, [ep], data_stream="off", faults={"drop_frames": 1.0})
    for i, p in enumerate([*spools, *lpools]):
        fill_random(p, 10 + i)
    for k in range(2):
        r = make_room(100 + k, "prefill0", 9, 1, dst_start=20 * k, slot=k, spools=spools)
        expect(dc, r)
        submit_all(pcs, r)
        assert dc.wait(r.room, r.group, 20).state is RoomState.SUCCESS
        dc.release(r.room, r.group)
    bad = make_room(200, "lossy0", 5, 1, dst_start=60, slot=5, spools=lpools)
    expect(dc, bad)
    submit_all(lossy, bad)
    assert dc.wait(bad.room, bad.group, 20).code == "incomplete"
    dc.release(bad.room, bad.group)
    # refusals on both sides: engine requests the daemons refuse
    with pytest.raises(BadRequest, match="^timeout_s must be"):
        dc.call("wait", room=1, group="prefill0", timeout_s=-1)
    with pytest.raises(BadRequest, match="^timeout_s must be"):
        pcs[0].call("wait", room=1, timeout_s=-1)
    texts = [_scrape(lossy[0].stats()["metrics_port"])]  # its dropped frames, before it is paused
    # a heartbeat miss: the lossy sender paused until the receiver gives it up (SIGCONT at close)
    cluster.kill("sender-lossy0-r0", signal.SIGSTOP)
    cluster.until(lambda: dc.stats()["heartbeat_misses"], "the receiver to give the paused sender up")
    # a live room, waiting for a group that never comes
    waiting = make_room(300, "absent0", 4, 1, dst_start=80, slot=8, spools=spools)
    expect(dc, waiting)

    texts += [_scrape(dc.stats()["metrics_port"]), _scrape(pcs[0].stats()["metrics_port"])]
    dc.release(waiting.room, waiting.group)

    families: dict[str, str] = {}        # sample name -> its family's type
    labels: dict[str, set[str]] = {}     # sample name -> label names seen on it
    for text in texts:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                families[s.name] = fam.type
                labels.setdefault(s.name, set()).update(s.labels)

    queries = [(f"alert {r['alert']}", r["expr"], " ".join(r["annotations"].values())) for r in rules()]
    queries += dashboard_queries(dashboard())
    seen: set[str] = set()
    for where, expr, legend in queries:
        names = metric_names(expr)
        seen |= names
        unknown = names - families.keys()
        assert not unknown, f"{where}: not in the live scrape: {sorted(unknown)}"
        on_them = set().union(*(labels[n] for n in names)) | TARGET_LABELS | {"le"} if names else TARGET_LABELS
        for name, matched in selected_labels(expr).items():
            if name in families:
                assert matched <= labels[name] | TARGET_LABELS, f"{where}: {name} has no label {matched - labels[name]}"
        assert grouping_labels(expr) <= on_them, f"{where}: groups by {grouping_labels(expr) - on_them}"
        shown = {a or b for a, b in _TEMPLATE_LABEL.findall(legend)}
        assert shown <= on_them, f"{where}: shows labels {shown - on_them} that its series do not have"
        for fn, name in _FUNCTION_OF.findall(_STRING.sub('""', expr)):
            if not name.startswith("transferd_"):
                continue
            kind = families[name]
            if fn in ("rate", "irate", "increase"):
                assert kind == "counter" or (kind == "histogram" and name.endswith(("_bucket", "_sum", "_count"))), \
                    f"{where}: {fn} of {name}, a {kind}"
            elif fn == "histogram_quantile":
                assert kind == "histogram" and name.endswith("_bucket"), f"{where}: {fn} of {name}"
            else:
                assert kind == "gauge", f"{where}: {fn} of {name}, a {kind}"
    # the rules and the dashboard between them watch every family the daemons export
    exported = {n for n, t in families.items() if not n.endswith("_created")}
    exported -= {n for n in exported if families[n] == "histogram" and not n.endswith("_bucket")}
    assert exported - seen == set(), f"exported but neither alerted on nor shown: {sorted(exported - seen)}"
