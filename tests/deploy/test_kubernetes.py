"""deploy/kubernetes, rendered by kustomize (`kubectl kustomize`): every object validates
against the Kubernetes schemas (kubernetes-validate, strict) or, for LeaderWorkerSet and
KEDA's ScaledObject, against their CRDs' schemas (tests/deploy/crds, vendored with their
source); the pods fit the image (user, volumes, entrypoint: their args parse as
`jaxserve serve` flags into a valid EngineConfig) and jaxserve's start-up (probes on
/health, graceful termination, accelerators per tensor-parallel size); the multi-host
environment, expanded as LWS and the kubelet expand it, is what jaxserve's multi-host
start-up reads, and starts two processes as one jax.distributed group; the autoscalers
target what is rendered and read exported metrics."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import dockerfile
import jsonschema
import kubernetes_validate
import pytest
import yaml

from jaxserve.cli import serve as cli
from jaxserve.api.metrics import Metrics
from jaxserve.engine import multihost

ROOT = Path(__file__).parents[2]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
TARGETS = ("base", "overlays/gpu", "overlays/tpu", "overlays/tpu-multihost")
CRDS = Path(__file__).parent / "crds"
K8S_VERSION = kubernetes_validate.latest_version()
ACCELERATOR = {"base": None, "overlays/gpu": "nvidia.com/gpu", "overlays/tpu": "google.com/tpu",
               "overlays/tpu-multihost": "google.com/tpu"}

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None,
                                reason="rendering needs kubectl (its built-in kustomize)")


def render(target: str) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(KUSTOMIZE / target)], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {t: render(t) for t in TARGETS}


def strict(schema):
    """A CRD's structural schema, closed as the API server's pruning would make it:
    an object with properties takes no other keys (so a misspelt field is an error)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def crd_validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    found = {}
    for path in CRDS.glob("*.json"):
        crd = json.loads(path.read_text())
        for version, schema in crd["versions"].items():
            found[(f"{crd['group']}/{version}", crd["kind"])] = \
                jsonschema.Draft7Validator(strict(schema))
    return found


CRD_VALIDATORS = crd_validators()


def errors(doc: dict) -> list[str]:
    key = (doc["apiVersion"], doc["kind"])
    if key in CRD_VALIDATORS:
        return [f"{'/'.join(map(str, e.path))}: {e.message}"
                for e in CRD_VALIDATORS[key].iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [str(e).splitlines()[0]]
    return []


def test_every_rendered_object_validates(rendered):
    kinds = set()
    for target, docs in rendered.items():
        for doc in docs:
            assert errors(doc) == [], (target, doc["kind"], doc["metadata"]["name"])
            kinds.add(doc["kind"])
    assert kinds >= {"Deployment", "Service", "PersistentVolumeClaim",
                     "HorizontalPodAutoscaler", "ScaledObject", "LeaderWorkerSet"}


def test_the_validators_catch_a_misspelt_field(rendered):
    for target, kind in (("base", "Deployment"), ("overlays/tpu-multihost", "LeaderWorkerSet"),
                         ("overlays/tpu", "ScaledObject")):
        doc = next(d for d in rendered[target] if d["kind"] == kind)
        bad = json.loads(json.dumps(doc))
        bad["spec"]["replicaz"] = 2
        assert errors(bad), kind


# ---- the pods ---------------------------------------------------------------------------
def image_facts() -> dict:
    cmds = list(dockerfile.parse_file(str(ROOT / "deploy" / "docker" / "Dockerfile.cpu")))
    env = dict(zip(*[iter(next(c.value for c in reversed(cmds) if c.cmd == "ENV"))] * 2))
    return {"entrypoint": next(c.value for c in cmds if c.cmd == "ENTRYPOINT"),
            "uid": int(next(c.value[0] for c in cmds if c.cmd == "USER").split(":")[0]),
            "env": env}


def pod_templates(docs: list[dict]) -> list[tuple[str, dict]]:
    """(role, pod template) of each workload: "server" pods answer HTTP."""
    found = []
    for d in docs:
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "jaxserve":
            found.append(("server", d["spec"]["template"]))
        elif d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            found += [("server", lwt["leaderTemplate"]), ("worker", lwt["workerTemplate"])]
    return found


def serve_args(container: dict) -> object:
    """The container's command line as the image runs it, parsed by `jaxserve serve`."""
    entry = image_facts()["entrypoint"]
    assert "command" not in container and entry[:2] == ("jaxserve", "serve")
    ap = cli.parser("jaxserve serve")
    return cli.parse_args(ap, [*entry[2:], *container["args"]])


@pytest.mark.parametrize("target", TARGETS)
def test_pods_fit_the_image_and_the_start_up(rendered, target):
    docs = rendered[target]
    facts = image_facts()
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    service = next(d for d in docs
                   if d["kind"] == "Service" and d["metadata"]["name"] == "jaxserve")
    templates = pod_templates(docs)
    assert templates
    for role, tmpl in templates:
        spec = tmpl["spec"]
        (c,) = spec["containers"]
        args = serve_args(c)
        config = cli.engine_config(args)   # EngineConfig refuses bad values by name
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == facts["uid"]
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        for var in ("HF_HOME", "JAXSERVE_COMPILATION_CACHE"):
            claim = volumes[mounts[facts["env"][var]]]["persistentVolumeClaim"]["claimName"]
            assert claim in claims, var
        # graceful termination: the preStop pause and the drain fit the grace period
        pause = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
        assert pause + args.timeout_graceful_shutdown < spec["terminationGracePeriodSeconds"]
        # accelerators: one per tensor-parallel shard, over the group's pods
        resource = ACCELERATOR[target]
        if resource:
            per_pod = int(c["resources"]["limits"][resource])
            assert per_pod == int(c["resources"]["requests"][resource])
            pods = int(next(d for d in docs if d["kind"] == "LeaderWorkerSet")["spec"]
                       ["leaderWorkerTemplate"]["size"]) if "multihost" in target else 1
            assert per_pod * pods == config.tensor_parallel_size, target
        selected = all(tmpl["metadata"]["labels"].get(k) == v
                       for k, v in service["spec"]["selector"].items())
        assert selected == (role == "server"), role
        if role == "server":
            port = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
            assert port == args.port
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
            start = c["startupProbe"]
            assert start["periodSeconds"] * start["failureThreshold"] >= 20 * 60  # load + compile
            live = c["livenessProbe"]
            assert live["periodSeconds"] * live["failureThreshold"] >= 30
        else:   # workers serve no HTTP: an HTTP probe would fail them
            assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(c)


# ---- multi-host -------------------------------------------------------------------------
def lws_env(container: dict, lws_name: str, group: int, size: int, index: int,
            namespace: str = "default") -> dict[str, str]:
    """The container's environment once LWS put its variables first (as its pod webhook
    does) and the kubelet expanded $(VAR) references to earlier variables."""
    env = [{"name": "LWS_LEADER_ADDRESS",
            "value": f"{lws_name}-{group}.{lws_name}.{namespace}"},
           {"name": "LWS_GROUP_SIZE", "value": str(size)},
           {"name": "LWS_WORKER_INDEX", "value": str(index)}] + container["env"]
    out: dict[str, str] = {}
    for var in env:
        if "value" in var:
            out[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out.get(m[1], m[0]),
                                      var["value"])
    return out


def test_multihost_environment_is_what_jaxserve_reads(rendered, monkeypatch):
    import jax
    docs = rendered["overlays/tpu-multihost"]
    lws = next(d for d in docs if d["kind"] == "LeaderWorkerSet")
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    assert size == 2   # the 2-process start-up of tests/sharding/test_multihost.py
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    names = {multihost.ENV_ADDRESS, multihost.ENV_NUM_PROCESSES, multihost.ENV_PROCESS_ID}
    for index, (_, tmpl) in enumerate(pod_templates(docs)):
        (c,) = tmpl["spec"]["containers"]
        env = lws_env(c, lws["metadata"]["name"], 0, size, index)
        assert names <= set(env)
        for name in names:
            monkeypatch.setenv(name, env[name])
        multihost.initialize()
        port = {p["name"]: p["containerPort"] for p in c["ports"]}["coordinator"]
        assert calls[-1] == {"coordinator_address": f"jaxserve-0.jaxserve.default:{port}",
                             "num_processes": 2, "process_id": index}


# ---- the router ------------------------------------------------------------------------
def test_router_finds_the_server_pods(rendered):
    from vllm_router.launch_router import parse_router_args
    docs = rendered["overlays/gpu"]
    router = next(d for d in docs if d["kind"] == "Deployment"
                  and d["metadata"]["name"] == "jaxserve-router")
    (c,) = router["spec"]["template"]["spec"]["containers"]
    env = {"POD_NAMESPACE": "default"}   # the downward API's value, as the kubelet expands
    args = parse_router_args([re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], a)
                              for a in c["args"]])
    (_, server), = pod_templates(docs)
    assert args.service_discovery and args.selector == server["metadata"]["labels"]
    assert args.service_discovery_namespace == "default"
    (jaxserve,) = server["spec"]["containers"]
    assert args.service_discovery_port == serve_args(jaxserve).port
    port = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert port["http"] == args.port and port["metrics"] == args.prometheus_port
    # its Service selects it alone; its account may list the pods it discovers
    service = next(d for d in docs if d["kind"] == "Service"
                   and d["metadata"]["name"] == "jaxserve-router")
    labels = router["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert not service["spec"]["selector"].items() <= server["metadata"]["labels"].items()
    role = next(d for d in docs if d["kind"] == "Role")
    (rule,) = role["rules"]
    assert {"list", "watch"} <= set(rule["verbs"]) and rule["resources"] == ["pods"]
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    account = router["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"][0]["name"] == account


# ---- autoscaling ------------------------------------------------------------------------
def exported() -> set[str]:
    return {s.name for f in Metrics("m").registry.collect() for s in f.samples}


def test_autoscalers_target_the_workload_and_read_exported_metrics(rendered):
    adapter = yaml.safe_load((KUSTOMIZE / "components/hpa/prometheus-adapter-values.yaml")
                             .read_text())
    (rule,) = adapter["rules"]["custom"]
    served = {re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), name)
              for name in exported() if re.match(rule["name"]["matches"], name)}
    assert re.match(r"(\w|:)+", rule["seriesQuery"])[0] in exported()
    seen = set()
    for target, docs in rendered.items():
        workloads = {(d["kind"], d["metadata"]["name"]) for d in docs
                     if d["kind"] in ("Deployment", "LeaderWorkerSet")}
        for d in docs:
            if d["kind"] == "HorizontalPodAutoscaler":
                ref = d["spec"]["scaleTargetRef"]
                assert (ref["kind"], ref["name"]) in workloads, target
                for m in d["spec"]["metrics"]:
                    assert m["pods"]["metric"]["name"] in served, target
                seen.add("hpa")
            elif d["kind"] == "ScaledObject":
                ref = d["spec"]["scaleTargetRef"]
                assert (ref["kind"], ref["name"]) in workloads, target
                for trigger in d["spec"]["triggers"]:
                    names = re.findall(r"\b(?:vllm|jaxserve):\w+", trigger["metadata"]["query"])
                    assert names and set(names) <= exported(), target
                seen.add("keda")
    assert seen == {"hpa", "keda"}


def test_multihost_environment_starts_two_processes(rendered, tmp_path):
    """The same environment, the leader's address resolved to this machine (and the
    coordinator on a free port): two processes form one jax.distributed group."""
    import socket
    docs = rendered["overlays/tpu-multihost"]
    lws = next(d for d in docs if d["kind"] == "LeaderWorkerSet")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import jax; from jaxserve.engine import multihost; "
            "assert multihost.initialize(); "
            "print('group', jax.process_index(), jax.process_count())")
    procs = []
    for index, (_, tmpl) in enumerate(pod_templates(docs)):
        (c,) = tmpl["spec"]["containers"]
        env = lws_env(c, lws["metadata"]["name"], 0, lws["spec"]["leaderWorkerTemplate"]["size"],
                      index)
        host, _ = env[multihost.ENV_ADDRESS].rsplit(":", 1)
        assert host == "jaxserve-0.jaxserve.default"
        env[multihost.ENV_ADDRESS] = f"127.0.0.1:{port}"
        jaxserve_env = {k: v for k, v in env.items() if k.startswith("JAXSERVE_")}
        procs.append(subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env={**os.environ, **jaxserve_env, "JAX_PLATFORMS": "cpu"}))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for index, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"group {index} 2" in out, out[-2000:]
