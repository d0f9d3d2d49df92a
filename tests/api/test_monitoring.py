"""The monitoring that deploy/ ships: every metric the Grafana dashboard, the
Prometheus alerts and the autoscalers (KEDA's query, the Prometheus adapter's rule)
query is on the session server's live /metrics; the alert rules
behave as their unit tests say (promtool, where installed); the compose file is valid
under the Compose specification's schema and mounts files that exist."""
from __future__ import annotations

import importlib.resources
import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import jsonschema
import pytest
import yaml

from jaxserve.api.metrics import Metrics
from tests.api.test_metrics_vllm import DASHBOARD, _queries, samples

ROOT = Path(__file__).parents[2]
ALERTS = ROOT / "deploy" / "monitoring" / "alerts.yaml"
COMPOSE = ROOT / "deploy" / "compose" / "compose.yaml"
KEDA = ROOT / "deploy" / "kubernetes" / "components" / "keda" / "scaledobject.yaml"
ADAPTER = ROOT / "deploy" / "kubernetes" / "components" / "hpa" / "prometheus-adapter-values.yaml"
# Prometheus's own series (not an exporter's), which alerts may use.
PROMETHEUS_SERIES = {"up"}
# Exported only with --speculative-config (as vLLM's): checked against a registry made
# with speculative decoding on, since the session server runs without it.
SPEC_PREFIX = "vllm:spec_decode_"


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: selectors (name{...}) and prefixed names."""
    found = set(re.findall(r"[A-Za-z_][A-Za-z0-9_:]*(?=\{)", expr))
    found |= set(re.findall(r"\b(?:vllm|jaxserve):[A-Za-z0-9_:]+", expr))
    return found


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"]
            for rule in group["rules"]]


def test_dashboards_alerts_and_autoscalers_query_metrics_a_live_server_exports(server):
    live = {name for name, _ in samples(httpx.get(server.url + "/metrics").text)}
    spec = {s.name for f in Metrics("m", num_speculative_tokens=2).registry.collect()
            for s in f.samples}
    queried: dict[str, set[str]] = {}   # metric -> where it is queried

    def add(expr: str, where: str) -> None:
        for name in metric_names(expr):
            queried.setdefault(name, set()).add(where)

    for expr in _queries(json.loads(DASHBOARD.read_text())):
        add(expr, "dashboard")
    for rule in alert_rules():
        add(rule["expr"], rule["alert"])
    for trigger in yaml.safe_load(KEDA.read_text())["spec"]["triggers"]:
        add(trigger["metadata"]["query"], "keda")
    for rule in yaml.safe_load(ADAPTER.read_text())["rules"]["custom"]:
        add(rule["seriesQuery"], "prometheus-adapter")
    assert {"keda", "prometheus-adapter"} <= set().union(*queried.values())
    missing = {name: where for name, where in queried.items()
               if name not in PROMETHEUS_SERIES
               and name not in (spec if name.startswith(SPEC_PREFIX) else live)}
    assert not missing, f"queried but not exported: {missing}"
    # What the issue asks alerts for, each on its metric.
    alerted = {n for rule in alert_rules() for n in metric_names(rule["expr"])}
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_waiting",
                 "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_hits_total", "vllm:spec_decode_num_accepted_tokens_total",
                 "jaxserve:num_compilations"):
        assert name in alerted, name


def test_alert_rules_are_well_formed():
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)) >= 9
    for r in rules:
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r["alert"]
        assert r["labels"]["severity"] in ("info", "warning", "critical"), r["alert"]
        assert r["annotations"]["summary"], r["alert"]
        assert re.fullmatch(r"\d+[smh]", r.get("for", "0s")), r["alert"]


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (Debian package prometheus)")
def test_alert_rules_fire_as_their_unit_tests_say():
    for args in (["check", "rules", "alerts.yaml"], ["test", "rules", "alerts_test.yaml"]):
        out = subprocess.run(["promtool", *args], cwd=ALERTS.parent, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr


def compose_schema() -> dict:
    # The Compose specification's JSON schema, as check-jsonschema vendors it
    # (from the compose-spec/compose-spec repository, schema/compose-spec.json).
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    return json.loads(vendor.joinpath("compose-spec.json").read_text())


def test_compose_file_validates_and_mounts_what_exists():
    compose = yaml.safe_load(COMPOSE.read_text())
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert not errors, errors
    # The schema must be able to fail: an unknown service key is refused.
    assert list(validator.iter_errors({"services": {"x": {"imagee": "y"}}}))

    here = COMPOSE.parent
    services = compose["services"]
    build = services["jaxserve"]["build"]
    assert (here / build["context"] / build["dockerfile"]).is_file()
    for svc in services.values():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (here / source).exists(), volume
            else:
                assert source in compose["volumes"], volume
    # Prometheus loads the alerts where compose mounts them; Grafana's provider reads
    # the folder the dashboard is mounted at.
    prom = yaml.safe_load((here / "prometheus.yml").read_text())
    mounts = {v.split(":")[1]: v.split(":")[0] for s in services.values()
              for v in s.get("volumes", [])}
    (rules,) = prom["rule_files"]
    assert (here / mounts[rules]).resolve() == ALERTS
    provider = yaml.safe_load((here / "grafana/provisioning/dashboards/jaxserve.yaml").read_text())
    dash_dir = provider["providers"][0]["options"]["path"]
    assert (here / mounts[dash_dir]).resolve() == DASHBOARD.parent
    target = prom["scrape_configs"][0]["static_configs"][0]["targets"][0]
    assert target.split(":")[0] in services
