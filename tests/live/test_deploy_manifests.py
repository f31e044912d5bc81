"""deploy/: the Kubernetes manifests build (`kubectl kustomize`, Debian's kubectl, which .ci/run
installs) and validate against Kubernetes' own schemas (kubernetes-validate, offline); what they
say agrees with what the service does (its probes, port, settings, metrics); and the compose,
Prometheus and Grafana files refer to things that exist."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from helpers import REPO_ROOT

from attnlens.app.server.middleware import ENGINE_GAUGES, Metrics
from attnlens.app.server.settings import Settings
from attnlens.app.server.shutdown import END_WAIT_S

DEPLOY = REPO_ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
OVERLAYS = ["overlays/cpu", "overlays/gpu"]
KUBERNETES_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]  # the oldest we claim, the newest schema


KUBECTL = shutil.which("kubectl")


def build(path: Path) -> list[dict]:
    """The resources `kubectl kustomize` builds from the kustomization in `path` (a skip without kubectl)."""
    if KUBECTL is None:
        pytest.skip("no kubectl here (bash .ci/run installs Debian's): its kustomize builds the manifests")
    out = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [r for r in yaml.safe_load_all(out.stdout) if r]


def rendered(path: str) -> dict[str, dict]:
    return {r["kind"]: r for r in build(K8S / path)}


def container(resources: dict[str, dict]) -> dict:
    (c,) = resources["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


def settings_from(config_map: dict) -> Settings:
    """Settings as the service reads them from these environment variables, and nothing else."""
    env = config_map["data"]
    fields = {f"ATTNLENS_{name.upper()}" for name in Settings.model_fields}
    unknown = [k for k in env if k not in fields]
    assert not unknown, f"the service reads no {unknown} (app/server/settings.py)"
    return Settings(**{k.removeprefix("ATTNLENS_").lower(): v for k, v in env.items()})


def exported_metric_names() -> set[str]:
    """Every series name /metrics exports (histograms with their _bucket/_sum/_count)."""
    text = Metrics().render().decode()
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    return names | {f"{n}{s}" for n in names for s in ("_bucket", "_sum", "_count")} \
        | {name for name, _, _ in ENGINE_GAUGES}


# --- validating -------------------------------------------------------------------------
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", OVERLAYS)
def test_manifests_validate_against_kubernetes_schemas(path, version):
    resources = build(K8S / path)
    assert {r["kind"] for r in resources} == {"ConfigMap", "Deployment", "Service", "Ingress",
                                              "PodDisruptionBudget", "HorizontalPodAutoscaler"}
    for resource in resources:
        kubernetes_validate.validate(resource, version, strict=True)  # raises, naming the field


def test_a_wrong_field_fails_validation():
    deployment = rendered("overlays/cpu")["Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/readyz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


# --- agreeing with the service ----------------------------------------------------------------
@pytest.mark.parametrize("path", OVERLAYS)
def test_probes_port_and_settings_are_the_services_own(path):
    r = rendered(path)
    c = container(r)
    settings = settings_from(r["ConfigMap"])
    (port,) = c["ports"]
    assert port["containerPort"] == settings.port and settings.host == "0.0.0.0"
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port["name"]}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    startup = c["startupProbe"]
    assert startup["httpGet"]["port"] == port["name"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # loading and warm-up
    # the settings come from the generated ConfigMap (by its hashed name), the key from a Secret
    assert c["envFrom"] == [{"configMapRef": {"name": r["ConfigMap"]["metadata"]["name"]}}]
    assert re.fullmatch(r"attnlens-settings-[a-z0-9]{10}", r["ConfigMap"]["metadata"]["name"])
    env = {e["name"]: e for e in c["env"]}
    assert env["ATTNLENS_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "attnlens-api-key", "key": "api-key"}
    assert all(n.startswith("ATTNLENS_") or n == "OMP_NUM_THREADS" for n in env)
    assert set(env) - {"OMP_NUM_THREADS"} <= {f"ATTNLENS_{n.upper()}" for n in Settings.model_fields}
    # a rolling update lets the drain finish: preStop + grace + the streams' error events < the kill
    pod = r["Deployment"]["spec"]["template"]["spec"]
    sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] > sleep + settings.shutdown_grace_s + END_WAIT_S
    assert "replicas" not in r["Deployment"]["spec"]  # the HPA owns the count


def test_the_gpu_overlay_takes_one_gpu_per_pod_and_the_cpu_one_none():
    gpu, cpu = container(rendered("overlays/gpu")), container(rendered("overlays/cpu"))
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert settings_from(rendered("overlays/gpu")["ConfigMap"]).device == "cuda"
    assert "nvidia.com/gpu" not in json.dumps(cpu)
    assert settings_from(rendered("overlays/cpu")["ConfigMap"]).device == "cpu"
    assert cpu["resources"]["requests"] == cpu["resources"]["limits"]  # Guaranteed: the CPU is the work
    # every GPU in use: a rolling update frees one before it takes one
    assert rendered("overlays/gpu")["Deployment"]["spec"]["strategy"]["rollingUpdate"] == \
        {"maxSurge": 0, "maxUnavailable": 1}


@pytest.mark.parametrize("path", OVERLAYS)
def test_service_ingress_pdb_and_hpa_point_at_the_pods(path):
    r = rendered(path)
    pod_labels = r["Deployment"]["spec"]["template"]["metadata"]["labels"]
    port_name = container(r)["ports"][0]["name"]
    service = r["Service"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == port_name
    backend = r["Ingress"]["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": service["metadata"]["name"], "port": {"name": service["spec"]["ports"][0]["name"]}}
    assert r["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    hpa = r["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": r["Deployment"]["metadata"]["name"]}
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "attnlens_generations_running_or_waiting"
    # it scales before requests queue: the target is below a pod's MAX_CONCURRENT
    target = float(metric["pods"]["target"]["averageValue"])
    assert 0 < target < settings_from(r["ConfigMap"]).max_concurrent


def test_ingress_keeps_streams_unbuffered_and_matches_the_nginx_config():
    annotations = rendered("overlays/gpu")["Ingress"]["metadata"]["annotations"]
    a = {k.removeprefix("nginx.ingress.kubernetes.io/"): v for k, v in annotations.items()}
    settings = settings_from(rendered("overlays/gpu")["ConfigMap"])
    assert a["proxy-buffering"] == "off"
    assert int(a["proxy-read-timeout"]) >= 600
    assert int(a["proxy-body-size"]) <= settings.max_body_bytes
    conf = (DEPLOY / "nginx" / "attnlens.conf").read_text()
    directive = re.search(r"^proxy_next_upstream ([^;]+);", conf, re.M).group(1)
    assert a["proxy-next-upstream"] == directive
    assert "non_idempotent" in directive.split() and not {"http_500", "http_502", "http_504"} & set(directive.split())
    assert a["proxy-next-upstream-tries"] == re.search(r"^proxy_next_upstream_tries (\d+);", conf, re.M).group(1)
    assert int(re.search(r"^client_max_body_size (\d+);", conf, re.M).group(1)) <= settings.max_body_bytes


# --- monitoring ---------------------------------------------------------------------------------
def test_the_adapter_rule_serves_the_hpa_metric_from_a_series_the_service_exports():
    values = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    series = re.match(r"'?([a-z_]+)\{", rule["seriesQuery"]).group(1)
    assert series in exported_metric_names()
    hpa_metric = rendered("overlays/cpu")["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert rule["name"]["as"] == hpa_metric and re.fullmatch(rule["name"]["matches"], series)
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    # the Kubernetes scrape job gives every series those two labels
    (job,) = yaml.safe_load((K8S / "monitoring" / "prometheus-scrape.yaml").read_text())["scrape_configs"]
    assert {"namespace", "pod"} <= {r.get("target_label") for r in job["relabel_configs"]}
    assert job["authorization"]["type"] == "Bearer"  # /metrics needs the API key


def test_the_dashboard_queries_only_what_the_service_exports():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "attnlens.json").read_text())
    exported = exported_metric_names()
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs
    for expr in exprs:
        for name in set(re.findall(r"\b(attnlens_[a-z_]+)", expr)):
            assert name in exported, (name, expr)
    variable = dashboard["templating"]["list"][0]
    assert re.search(r"\b(attnlens_[a-z_]+)", variable["query"]["query"]).group(1) in exported
    datasource = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml")
                                .read_text())["datasources"][0]
    assert all(p["datasource"]["uid"] == datasource["uid"] for p in dashboard["panels"])


# --- compose --------------------------------------------------------------------------------
@pytest.mark.parametrize("file", ["compose.yaml", "compose.gpu.yaml"])
def test_compose_files_mount_what_exists_and_set_what_the_service_reads(file):
    compose = yaml.safe_load((DEPLOY / file).read_text())
    services = compose["services"]
    replicas = {name: s for name, s in services.items() if s.get("image") == "attnlens:latest"}
    assert replicas
    fields = {f"ATTNLENS_{n.upper()}" for n in Settings.model_fields}
    for s in replicas.values():
        assert set(s["environment"]) <= fields
        grace = float(s["environment"]["ATTNLENS_SHUTDOWN_GRACE_S"])
        assert float(s["stop_grace_period"].removesuffix("s")) > grace + END_WAIT_S
        assert (DEPLOY / s["build"]["context"] / "Dockerfile").is_file()
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert (DEPLOY / source).exists(), source
    assert set(services["nginx"]["depends_on"]) == set(replicas)


def test_compose_gpu_gives_each_replica_its_own_gpu_under_one_name():
    services = yaml.safe_load((DEPLOY / "compose.gpu.yaml").read_text())["services"]
    gpus = {name: s for name, s in services.items() if name.startswith("gpu")}
    ids = [s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for s in gpus.values()]
    assert sorted(i for (i,) in ids) == [str(n) for n in range(len(gpus))]
    assert all(s["networks"]["default"]["aliases"] == ["attnlens"] for s in gpus.values())  # upstream.conf's name
    assert all(s["environment"]["ATTNLENS_DEVICE"] == "cuda" for s in gpus.values())


def test_prometheus_for_compose_scrapes_every_replica_with_the_key():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert job["dns_sd_configs"][0]["names"] == ["attnlens"] and "attnlens" in compose["services"]
    assert job["dns_sd_configs"][0]["port"] == 8000
    secret = job["authorization"]["credentials_file"].removeprefix("/run/secrets/")
    assert secret in compose["services"]["prometheus"]["secrets"] and secret in compose["secrets"]
