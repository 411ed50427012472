"""Workers as the pods of one Kubernetes Deployment per deployment and role, through the official
``kubernetes`` client (``pip install 'pdserve[kubernetes]'``).

The worker Deployments come from the manifests (``infra/k8s``: pod template with GPU requests,
node selector, tolerations, gRPC health probes; no ``replicas``, which this provisioner owns).
They are found by their labels ``pdserve.io/deployment`` and ``pdserve.io/role``. Each pod runs
``pdserve serve worker`` with its own pod name as worker id (downward API), and finds its pool
manager through a Service.

- **start** raises the Deployment's replicas by one through the ``scale`` subresource and waits
  for the ReplicaSet's new pod: its name is the worker id the pool manager tracks.
- **stop** removes exactly the named pod (the pool manager drained it first, or it failed, or it
  never became ready): it gets the lowest ``controller.kubernetes.io/pod-deletion-cost``, then
  the replicas go down by one, so the ReplicaSet deletes that pod; should the ReplicaSet pick
  another one (it deletes unscheduled and pending pods before any running one, whatever their
  cost: never a serving worker), the named pod is deleted too and the ReplicaSet replaces the
  one it took.
- **handles** lists the Deployment's pods that are not terminating and have not ended.

The client is synchronous: every call runs on a worker thread. This module has been tested
against an in-process fake of the endpoints it uses (``tests/helpers/fake_kube.py``), not against
a real cluster.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.common.errors import PdserveError
from pdserve.pool.provisioner import WorkerLaunch

if TYPE_CHECKING:
    from kubernetes.client import ApiClient, AppsV1Api, CoreV1Api, V1ObjectMeta, V1Pod

logger = logging.getLogger(__name__)

LABEL_DEPLOYMENT = "pdserve.io/deployment"
LABEL_ROLE = "pdserve.io/role"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
LOWEST_DELETION_COST = -(2**31)
"""The annotation is an int32; the ReplicaSet deletes lower-cost pods first."""
_ENDED_PHASES = frozenset({"Succeeded", "Failed"})


class ProvisionError(PdserveError):
    """The cluster did not do what the provisioner asked in time (no worker Deployment, no new
    pod). The pool manager logs it and tries again on its next pass."""


@dataclass(frozen=True, slots=True)
class KubernetesWorkerSpec:
    namespace: str
    pod_appear_timeout_s: float = 30.0
    """How long ``start`` waits for the ReplicaSet to create the new pod."""
    removal_timeout_s: float = 10.0
    """How long ``stop`` waits for the ReplicaSet to delete the named pod before deleting it."""
    poll_interval_s: float = 0.2


class KubernetesProvisioner:
    """``Provisioner`` over the worker Deployments of one namespace."""

    def __init__(self, spec: KubernetesWorkerSpec, api_client: ApiClient) -> None:
        from kubernetes.client import AppsV1Api, CoreV1Api

        self.spec = spec
        self._api_client = api_client
        self._apps: AppsV1Api = AppsV1Api(api_client)
        self._core: CoreV1Api = CoreV1Api(api_client)
        self._claimed: set[str] = set()
        """Pods ``start`` returned (so two starts never return the same new pod)."""
        self._lock = asyncio.Lock()

    @classmethod
    def connect(cls, namespace: str = "", api_url: str = "") -> KubernetesProvisioner:
        """In a pod: its service account and namespace. Else the kubeconfig (its context's
        namespace). ``api_url``: a plain API server URL instead (``kubectl proxy``, tests)."""
        from kubernetes import client, config

        if api_url:
            configuration = client.Configuration(host=api_url)
            return cls(KubernetesWorkerSpec(namespace or "default"),
                       client.ApiClient(configuration))
        try:
            config.load_incluster_config()
            in_cluster_namespace = _read_service_account_namespace()
        except config.ConfigException:
            config.load_kube_config()
            in_cluster_namespace = config.list_kube_config_contexts()[1]["context"].get(
                "namespace", "default")
        return cls(KubernetesWorkerSpec(namespace or in_cluster_namespace), client.ApiClient())

    # -- Provisioner --------------------------------------------------------------------------

    async def start(self, launch: WorkerLaunch) -> str:
        async with self._lock:
            return await asyncio.to_thread(self._start, launch)

    async def stop(self, handle: str) -> None:
        async with self._lock:
            await asyncio.to_thread(self._stop, handle)

    async def handles(self, deployment: str, role: str) -> list[str]:
        pods = await asyncio.to_thread(self._live_pods, deployment, role)
        return sorted(_meta(pod).name or "" for pod in pods)

    async def close(self) -> None:
        await asyncio.to_thread(self._api_client.close)

    # -- the calls ----------------------------------------------------------------------------

    def _deployment_name(self, deployment: str, role: str) -> str:
        selector = f"{LABEL_DEPLOYMENT}={deployment},{LABEL_ROLE}={role}"
        found = self._apps.list_namespaced_deployment(self.spec.namespace,
                                                      label_selector=selector).items
        if len(found) != 1:
            raise ProvisionError(f"expected one worker Deployment labelled {selector} in "
                                 f"namespace {self.spec.namespace}, found {len(found)}")
        return str(_meta(found[0]).name)

    def _live_pods(self, deployment: str, role: str) -> list[V1Pod]:
        selector = f"{LABEL_DEPLOYMENT}={deployment},{LABEL_ROLE}={role}"
        pods = self._core.list_namespaced_pod(self.spec.namespace, label_selector=selector).items
        return [pod for pod in pods if _meta(pod).deletion_timestamp is None
                and (pod.status is None or pod.status.phase not in _ENDED_PHASES)]

    def _scale_by(self, name: str, delta: int) -> int:
        scale = self._apps.read_namespaced_deployment_scale(name, self.spec.namespace)
        current = (scale.spec.replicas if scale.spec is not None else None) or 0
        replicas = max(0, current + delta)
        self._apps.patch_namespaced_deployment_scale(
            name, self.spec.namespace, {"spec": {"replicas": replicas}})
        return replicas

    def _start(self, launch: WorkerLaunch) -> str:
        name = self._deployment_name(launch.deployment, launch.role)
        before = {_meta(pod).name for pod in self._live_pods(launch.deployment, launch.role)}
        replicas = self._scale_by(name, +1)
        deadline = time.monotonic() + self.spec.pod_appear_timeout_s
        while True:
            for pod in self._live_pods(launch.deployment, launch.role):
                pod_name = str(_meta(pod).name)
                if pod_name not in before and pod_name not in self._claimed:
                    self._claimed.add(pod_name)
                    logger.info("scaled %s to %d: new %s worker pod %s", name, replicas,
                                launch.role, pod_name)
                    return pod_name
            if time.monotonic() >= deadline:
                # The replicas stay raised: the pod is adopted once the ReplicaSet makes it.
                raise ProvisionError(f"{name} scaled to {replicas} but no new pod appeared in "
                                     f"{self.spec.pod_appear_timeout_s:.0f} s")
            time.sleep(self.spec.poll_interval_s)

    def _read_pod(self, name: str) -> V1Pod | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self._core.read_namespaced_pod(name, self.spec.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _stop(self, handle: str) -> None:
        from kubernetes.client.exceptions import ApiException

        self._claimed.discard(handle)
        pod = self._read_pod(handle)
        if pod is None or _meta(pod).deletion_timestamp is not None:
            return
        labels: dict[str, Any] = _meta(pod).labels or {}
        name = self._deployment_name(labels.get(LABEL_DEPLOYMENT, ""), labels.get(LABEL_ROLE, ""))
        self._core.patch_namespaced_pod(handle, self.spec.namespace, {
            "metadata": {"annotations": {DELETION_COST: str(LOWEST_DELETION_COST)}}})
        replicas = self._scale_by(name, -1)
        deadline = time.monotonic() + self.spec.removal_timeout_s
        while time.monotonic() < deadline:
            pod = self._read_pod(handle)
            if pod is None or _meta(pod).deletion_timestamp is not None:
                logger.info("scaled %s to %d, removing worker pod %s", name, replicas, handle)
                return
            time.sleep(self.spec.poll_interval_s)
        logger.warning("the ReplicaSet of %s kept pod %s: deleting it", name, handle)
        try:
            self._core.delete_namespaced_pod(handle, self.spec.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise


def _meta(obj: Any) -> V1ObjectMeta:
    """An API object's metadata, which the API server always sets on what it returns."""
    meta: V1ObjectMeta | None = obj.metadata
    assert meta is not None, f"{type(obj).__name__} without metadata"
    return meta


def _read_service_account_namespace() -> str:
    path = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
    try:
        with open(path, encoding="utf-8") as file:
            return file.read().strip() or "default"
    except OSError:
        return "default"
