"""infra/k8s: ``kubectl kustomize`` renders every overlay, every object validates (strict: no
unknown field) against the Kubernetes API schemas of the newest version kubernetes-validate ships,
and the objects say what the pool managers' Kubernetes provisioner and an operator rely on."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.requirements import missing, require_tool

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = sorted(p.name for p in (ROOT / "infra" / "k8s" / "overlays").iterdir() if p.is_dir())
CONTROL_PLANE = ("router", "kv-transfer", "prefill-pool", "decode-pool", "governor")


@functools.cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    kubectl = require_tool("kubectl", "kubectl 1.27 or newer, with kustomize built in")
    result = subprocess.run([kubectl, "kustomize", str(ROOT / "infra" / "k8s" / "overlays" /
                                                       overlay)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def by_kind(objects: tuple[dict[str, Any], ...], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_overlays_exist() -> None:
    assert {"sim-workers", "vllm-workers"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas(overlay: str) -> None:
    try:
        import kubernetes_validate
        from kubernetes_validate.utils import latest_version
    except ImportError:
        missing("kubernetes-validate (pip install kubernetes-validate)")
    version = latest_version()
    objects = render(overlay)
    assert len(objects) > 20
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']} is not valid "
                        f"Kubernetes {version}: {exc.message} at {list(exc.path)}")
    assert all(o["metadata"].get("namespace") == "pdserve" for o in objects
               if o["kind"] != "Namespace")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_control_plane_has_replicas_probes_services_and_budgets(overlay: str) -> None:
    objects = render(overlay)
    deployments, services = by_kind(objects, "Deployment"), by_kind(objects, "Service")
    budgets = by_kind(objects, "PodDisruptionBudget")
    for name in CONTROL_PLANE:
        deployment = deployments[name]
        assert deployment["spec"]["replicas"] >= 2, name
        probes = container(deployment)
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert "grpc" in probes[probe], (name, probe)
        assert name in services and budgets[name]["spec"]["minAvailable"] == 1
        env = {e["name"] for e in probes["env"]}
        assert "PDSERVE_DATABASE_URL" in env
    assert "ConfigMap" in {o["kind"] for o in objects} and "pdserve-secrets" in by_kind(
        objects, "Secret")
    # Without mutual TLS the internal methods need the service token: every control-plane
    # service reads it from the mounted Secret (worker pods get credentials at registration).
    settings = next(o for o in objects if o["kind"] == "ConfigMap"
                    and o["metadata"]["name"] == "pdserve-settings")["data"]
    token_path = settings["PDSERVE_SERVICE_TOKENS_PATH"]
    assert token_path.rpartition("/")[2] in by_kind(objects, "Secret")["pdserve-secrets"][
        "stringData"]
    for name in CONTROL_PLANE:
        mounts = [m["mountPath"] for m in container(deployments[name])["volumeMounts"]]
        assert any(token_path.startswith(mount + "/") for mount in mounts), name
    assert "pdserve-db-upgrade" in by_kind(objects, "Job")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_deployments_are_left_to_the_provisioner(overlay: str) -> None:
    objects = render(overlay)
    deployments = by_kind(objects, "Deployment")
    for role in ("prefill", "decode"):
        workers = deployments[f"{role}-worker"]
        labels = workers["spec"]["template"]["metadata"]["labels"]
        assert labels["pdserve.io/role"] == role and labels["pdserve.io/deployment"]
        assert workers["metadata"]["labels"]["pdserve.io/role"] == role
        assert "replicas" not in workers["spec"], "the pool manager owns the replicas"
        spec = container(workers)
        env = {e["name"]: e for e in spec["env"]}
        assert env["PDSERVE_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env["PDSERVE_POOL_ADDRESS"]["value"].split(":")[0] in by_kind(objects, "Service")
        assert "secretKeyRef" in env["PDSERVE_JOIN_TOKEN"]["valueFrom"]
        assert "grpc" in spec["readinessProbe"] and "grpc" in spec["livenessProbe"]
        pod = workers["spec"]["template"]["spec"]
        gpus = spec["resources"].get("limits", {}).get("nvidia.com/gpu")
        if overlay == "vllm-workers":
            assert gpus == "1" and pod["nodeSelector"] and pod["tolerations"]
            assert env["PDSERVE_ENGINE"]["value"] == "vllm"
        elif overlay == "sim-workers":
            assert gpus is None and "nodeSelector" not in pod and "tolerations" not in pod
            assert env["PDSERVE_ENGINE"]["value"] == "sim"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rbac_lets_the_pool_managers_scale_and_remove_exactly_a_pod(overlay: str) -> None:
    objects = render(overlay)
    (role,) = by_kind(objects, "Role").values()
    verbs = {(group, resource): set(rule["verbs"]) for rule in role["rules"]
             for group in rule["apiGroups"] for resource in rule["resources"]}
    assert {"get", "patch"} <= verbs[("apps", "deployments/scale")]
    assert {"list"} <= verbs[("apps", "deployments")]
    assert {"list", "patch", "delete"} <= verbs[("", "pods")]
    (binding,) = by_kind(objects, "RoleBinding").values()
    account = binding["subjects"][0]["name"]
    deployments = by_kind(objects, "Deployment")
    for name in ("prefill-pool", "decode-pool"):
        assert deployments[name]["spec"]["template"]["spec"]["serviceAccountName"] == account
    for name in ("router", "governor", "prefill-worker", "decode-worker"):
        assert deployments[name]["spec"]["template"]["spec"]["serviceAccountName"] != account


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_state_stores_are_reachable_from_the_control_plane_only(overlay: str) -> None:
    objects = render(overlay)
    (policy,) = by_kind(objects, "NetworkPolicy").values()
    selected = policy["spec"]["podSelector"]["matchLabels"]
    assert selected == {"pdserve.io/tier": "state"}
    sources = [peer["podSelector"]["matchLabels"] for rule in policy["spec"]["ingress"]
               for peer in rule["from"]]
    assert sources == [{"pdserve.io/tier": "control-plane"}]
    tiers = {o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"]["pdserve.io/tier"]
             for o in objects if o["kind"] in ("Deployment", "StatefulSet")}
    assert tiers["redis"] == tiers["postgres"] == "state"
    assert {tiers[name] for name in CONTROL_PLANE} == {"control-plane"}
    assert tiers["prefill-worker"] == tiers["decode-worker"] == "worker"
