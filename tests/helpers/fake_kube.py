"""A small in-process fake of the Kubernetes API endpoints the Kubernetes provisioner uses, served
over real HTTP so that the official ``kubernetes`` client (its URL building, JSON (de)serialisation
of ``V1Deployment``, ``V1Scale``, ``V1Pod``, error statuses) is what the tests exercise.

Served: list Deployments by label selector; read and patch a Deployment's ``scale``
subresource; list Pods by label selector; read, patch (merge) and delete a Pod. A ReplicaSet
controller runs after every change: it creates pods (``Pending``, unscheduled) up to the
Deployment's replicas and deletes the surplus in the ReplicaSet's order (unscheduled before
scheduled, Pending before Running, not ready before ready, lower
``controller.kubernetes.io/pod-deletion-cost`` first, newer first). The test plays kubelet: it
moves pods to Running and sets their Ready condition. Deleted pods vanish at once (no grace).
"""

from __future__ import annotations

import itertools
import json
import re
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
_EPOCH = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass
class FakePod:
    name: str
    labels: dict[str, str]
    created_seq: int
    annotations: dict[str, str] = field(default_factory=dict)
    phase: str = "Pending"
    node_name: str = ""
    is_ready: bool = False

    def as_json(self, namespace: str) -> dict[str, Any]:
        created = _EPOCH + timedelta(seconds=self.created_seq)
        return {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": self.name, "namespace": namespace, "labels": self.labels,
                         "annotations": self.annotations, "uid": f"uid-{self.name}",
                         "creationTimestamp": created.isoformat().replace("+00:00", "Z")},
            "spec": {"containers": [{"name": "worker", "image": "pdserve:dev"}],
                     **({"nodeName": self.node_name} if self.node_name else {})},
            "status": {"phase": self.phase, "conditions": [
                {"type": "Ready", "status": "True" if self.is_ready else "False"}]},
        }


@dataclass
class FakeDeployment:
    name: str
    labels: dict[str, str]
    replicas: int = 0


class FakeKubernetes:
    """The cluster state and its ReplicaSet controller; ``url`` once served."""

    def __init__(self, namespace: str = "pdserve") -> None:
        self.namespace = namespace
        self.deployments: dict[str, FakeDeployment] = {}
        self.pods: dict[str, FakePod] = {}
        self.deleted: list[tuple[str, str]] = []
        """(pod name, by whom: "replicaset" or "api") in order."""
        self.last_annotations: dict[str, dict[str, str]] = {}
        """Annotations each deleted pod had when it went."""
        self.requests: list[tuple[str, str]] = []
        """(method, path) of every request served."""
        self.lock = threading.RLock()
        self.url = ""
        self._seq = itertools.count()

    def add_deployment(self, name: str, labels: dict[str, str], replicas: int = 0) -> None:
        with self.lock:
            self.deployments[name] = FakeDeployment(name, dict(labels), replicas)
            self.reconcile()

    # -- playing kubelet ------------------------------------------------------------------------

    def run(self, pod_name: str, *, is_ready: bool = True) -> None:
        with self.lock:
            pod = self.pods[pod_name]
            pod.node_name, pod.phase, pod.is_ready = "node-1", "Running", is_ready

    def live_pods(self, deployment: str) -> list[str]:
        with self.lock:
            labels = self.deployments[deployment].labels
            return sorted(p.name for p in self.pods.values() if _matches(p.labels, labels))

    # -- the ReplicaSet controller -------------------------------------------------------------

    def reconcile(self) -> None:
        with self.lock:
            for deployment in self.deployments.values():
                owned = [p for p in self.pods.values() if _matches(p.labels, deployment.labels)]
                for _ in range(deployment.replicas - len(owned)):
                    name = f"{deployment.name}-7d9f8b6c5-{secrets.token_hex(3)[:5]}"
                    self.pods[name] = FakePod(name, dict(deployment.labels), next(self._seq))
                surplus = len(owned) - deployment.replicas
                for pod in sorted(owned, key=_deletion_rank)[:max(0, surplus)]:
                    self._delete(pod, "replicaset")

    def _delete(self, pod: FakePod, by: str) -> None:
        del self.pods[pod.name]
        self.deleted.append((pod.name, by))
        self.last_annotations[pod.name] = dict(pod.annotations)

    # -- HTTP ---------------------------------------------------------------------------------

    def handle(self, method: str, path: str, query: dict[str, str],
               body: Any) -> tuple[int, dict[str, Any]]:
        self.requests.append((method, path))
        ns = re.escape(self.namespace)
        with self.lock:
            if m := re.fullmatch(rf"/apis/apps/v1/namespaces/{ns}/deployments", path):
                selector = _parse_selector(query.get("labelSelector", ""))
                items = [self._deployment_json(d) for d in self.deployments.values()
                         if _matches(d.labels, selector)]
                return 200, {"apiVersion": "apps/v1", "kind": "DeploymentList",
                             "metadata": {}, "items": items}
            if m := re.fullmatch(rf"/apis/apps/v1/namespaces/{ns}/deployments/([^/]+)/scale", path):
                deployment = self.deployments.get(m[1])
                if deployment is None:
                    return _not_found("deployments", m[1])
                if method == "PATCH":
                    deployment.replicas = int(body["spec"]["replicas"])
                    self.reconcile()
                return 200, self._scale_json(deployment)
            if re.fullmatch(rf"/api/v1/namespaces/{ns}/pods", path):
                selector = _parse_selector(query.get("labelSelector", ""))
                items = [p.as_json(self.namespace) for p in self.pods.values()
                         if _matches(p.labels, selector)]
                return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {},
                             "items": items}
            if m := re.fullmatch(rf"/api/v1/namespaces/{ns}/pods/([^/]+)", path):
                pod = self.pods.get(m[1])
                if pod is None:
                    return _not_found("pods", m[1])
                if method == "PATCH":
                    pod.annotations.update((body.get("metadata") or {}).get("annotations") or {})
                elif method == "DELETE":
                    self._delete(pod, "api")
                    self.reconcile()
                return 200, pod.as_json(self.namespace)
        return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                     "message": f"no route {method} {path}", "reason": "NotFound", "code": 404}

    def _deployment_json(self, deployment: FakeDeployment) -> dict[str, Any]:
        return {
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": deployment.name, "namespace": self.namespace,
                         "labels": deployment.labels},
            "spec": {"replicas": deployment.replicas,
                     "selector": {"matchLabels": deployment.labels},
                     "template": {"metadata": {"labels": deployment.labels},
                                  "spec": {"containers": [{"name": "worker",
                                                           "image": "pdserve:dev"}]}}},
            "status": {"replicas": deployment.replicas},
        }

    def _scale_json(self, deployment: FakeDeployment) -> dict[str, Any]:
        selector = ",".join(f"{k}={v}" for k, v in deployment.labels.items())
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": deployment.name, "namespace": self.namespace},
                "spec": {"replicas": deployment.replicas},
                "status": {"replicas": deployment.replicas, "selector": selector}}


def _deletion_rank(pod: FakePod) -> tuple[int, int, int, int, int]:
    phase_rank = {"Pending": 0, "Unknown": 1, "Running": 2}.get(pod.phase, 0)
    cost = int(pod.annotations.get(DELETION_COST, "0"))
    return (bool(pod.node_name), phase_rank, pod.is_ready, cost, -pod.created_seq)


def _parse_selector(text: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in text.split(",") if part)


def _matches(labels: dict[str, str], selector: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def _not_found(kind: str, name: str) -> tuple[int, dict[str, Any]]:
    return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                 "message": f'{kind} "{name}" not found', "reason": "NotFound", "code": 404}


@contextmanager
def serve(fake: FakeKubernetes) -> Iterator[FakeKubernetes]:
    """Serve ``fake`` on a free loopback port (``fake.url``) for the duration."""

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            path, _, raw_query = self.path.partition("?")
            query = dict(pair.split("=", 1) for pair in raw_query.split("&") if "=" in pair)
            query = {k: _unquote(v) for k, v in query.items()}
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            status, payload = fake.handle(self.command, path, query, body)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = do_DELETE = _serve

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    fake.url = f"http://127.0.0.1:{server.server_port}"
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _unquote(value: str) -> str:
    from urllib.parse import unquote_plus

    return unquote_plus(value)
