"""The Kubernetes provisioner under the pool manager, against an in-process fake of the API
endpoints it uses served over real HTTP (``tests/helpers/fake_kube.py``): the official client
builds the requests and parses the answers. No real cluster is involved.

The test plays kubelet and the workers: it runs the pods the fake ReplicaSet creates and has each
register with the pool manager under its pod name, then heartbeat READY (or stay LOADING).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from helpers.fake_kube import FakeKubernetes, serve

from pdserve.common.types import WorkerLoad, WorkerRole, WorkerState
from pdserve.pool.manager import Heartbeat, PoolManager, PoolPolicy, Registration
from pdserve.state.stores import Stores, open_stores

kubernetes = pytest.importorskip("kubernetes", reason="pip install 'pdserve[kubernetes]'")

from pdserve.pool.provisioner_kubernetes import (  # noqa: E402
    DELETION_COST,
    LABEL_DEPLOYMENT,
    LABEL_ROLE,
    KubernetesProvisioner,
    KubernetesWorkerSpec,
)

DEPLOYMENT = "llama-3.1-8b"
WORKERS = "pdserve-decode-llama"
TOKEN = "join-token-for-tests"
NUM_BLOCKS = 1000


class Clock:
    def __init__(self) -> None:
        self.now_s = 1_000_000.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def fake() -> Iterator[FakeKubernetes]:
    cluster = FakeKubernetes("pdserve")
    cluster.add_deployment(WORKERS, {LABEL_DEPLOYMENT: DEPLOYMENT, LABEL_ROLE: "decode",
                                     "app.kubernetes.io/component": "decode-worker"})
    with serve(cluster):
        yield cluster


def _provisioner(fake: FakeKubernetes) -> KubernetesProvisioner:
    spec = KubernetesWorkerSpec("pdserve", pod_appear_timeout_s=5.0, removal_timeout_s=0.5,
                                poll_interval_s=0.01)
    config = kubernetes.client.Configuration(host=fake.url)
    return KubernetesProvisioner(spec, kubernetes.client.ApiClient(config))


@pytest.fixture
async def stores() -> Stores:
    return open_stores("memory://")


def _manager(stores: Stores, provisioner: KubernetesProvisioner, clock: Clock) -> PoolManager:
    policy = PoolPolicy(role=WorkerRole.DECODE, join_token=TOKEN, ready_timeout_s=600.0,
                        heartbeat_timeout_s=1e9)
    return PoolManager(policy, stores.backend, stores.prefix_index, clock, provisioner)


async def _join(manager: PoolManager, fake: FakeKubernetes, pod: str, state: WorkerState,
                num_running_seqs: int = 0) -> None:
    """Kubelet runs the pod; its worker registers under the pod name and reports ``state``."""
    fake.run(pod, is_ready=state is WorkerState.READY)
    if await manager._backend.workers.get(pod) is None:
        await manager.register(Registration(worker_id=pod, deployment=DEPLOYMENT,
                                            address=f"{pod}:50060", num_total_blocks=NUM_BLOCKS,
                                            state=WorkerState.LOADING), TOKEN)
    await _beat(manager, pod, state, num_running_seqs)


async def _beat(manager: PoolManager, pod: str, state: WorkerState,
                num_running_seqs: int = 0) -> None:
    await manager.heartbeat(Heartbeat(
        worker_id=pod, state=state, join_token=TOKEN, held_blocks={},
        load=WorkerLoad(num_running_seqs=num_running_seqs, num_free_blocks=NUM_BLOCKS,
                        num_total_blocks=NUM_BLOCKS)))


async def _scaled_to_three_ready(manager: PoolManager, fake: FakeKubernetes) -> list[str]:
    await manager.set_target(DEPLOYMENT, 3)
    await manager.actuate([DEPLOYMENT])
    pods = fake.live_pods(WORKERS)
    assert fake.deployments[WORKERS].replicas == 3 and len(pods) == 3
    for i, pod in enumerate(pods):
        await _join(manager, fake, pod, WorkerState.READY, num_running_seqs=5 + i)
    await manager.actuate([DEPLOYMENT])
    assert fake.live_pods(WORKERS) == pods and fake.deployments[WORKERS].replicas == 3
    return pods


async def test_scale_up_goes_through_the_scale_subresource(fake: FakeKubernetes,
                                                           stores: Stores) -> None:
    manager = _manager(stores, _provisioner(fake), Clock())
    pods = await _scaled_to_three_ready(manager, fake)
    scale_patches = [p for m, p in fake.requests if m == "PATCH" and p.endswith("/scale")]
    assert len(scale_patches) == 3  # one replica at a time, each pod claimed by its start
    workers = await manager.list_workers(DEPLOYMENT)
    assert sorted(w.worker_id for w in workers) == pods
    assert all(w.state is WorkerState.READY for w in workers)
    await manager.close()


async def test_scale_down_drains_the_policy_victim_then_removes_exactly_that_pod(
        fake: FakeKubernetes, stores: Stores) -> None:
    manager = _manager(stores, _provisioner(fake), Clock())
    pods = await _scaled_to_three_ready(manager, fake)
    # The drain policy's victim is the least loaded worker: give the last pod no sequences.
    victim = pods[-1]
    await _beat(manager, victim, WorkerState.READY, num_running_seqs=0)
    await manager.set_target(DEPLOYMENT, 2)
    await manager.actuate([DEPLOYMENT])
    # Drain first: nothing removed, the replicas unchanged, the victim DRAINING.
    assert fake.live_pods(WORKERS) == pods and fake.deployments[WORKERS].replicas == 3
    states = {w.worker_id: w.state for w in await manager.list_workers(DEPLOYMENT)}
    assert states[victim] is WorkerState.DRAINING
    assert [s for w, s in states.items() if w != victim] == [WorkerState.READY] * 2
    # Its streams ended: the worker reports DRAINED and the pool manager removes its pod.
    await _beat(manager, victim, WorkerState.DRAINED)
    assert fake.deleted == [(victim, "replicaset")]
    assert fake.last_annotations[victim][DELETION_COST] == str(-(2**31))
    assert fake.live_pods(WORKERS) == pods[:-1] and fake.deployments[WORKERS].replicas == 2
    await manager.actuate([DEPLOYMENT])
    assert fake.live_pods(WORKERS) == pods[:-1]
    await manager.close()


async def test_a_pending_pod_taken_by_the_replicaset_instead_is_replaced(
        fake: FakeKubernetes, stores: Stores) -> None:
    """The ReplicaSet deletes an unscheduled pod before any running one whatever its cost: the
    drained pod is then deleted by name and the taken one replaced (never a serving worker)."""
    manager = _manager(stores, _provisioner(fake), Clock())
    pods = await _scaled_to_three_ready(manager, fake)
    victim = pods[0]
    await _beat(manager, victim, WorkerState.READY, num_running_seqs=0)
    await manager.set_target(DEPLOYMENT, 3)
    await manager.set_target(DEPLOYMENT, 2)
    await manager.actuate([DEPLOYMENT])  # victim DRAINING
    # Meanwhile an operator-added pod sits unscheduled.
    fake.deployments[WORKERS].replicas += 1
    fake.reconcile()
    pending = (set(fake.live_pods(WORKERS)) - set(pods)).pop()
    await _beat(manager, victim, WorkerState.DRAINED)
    assert (victim, "api") in fake.deleted and (pending, "replicaset") in fake.deleted
    remaining = set(fake.live_pods(WORKERS))
    assert victim not in remaining and set(pods[1:]) <= remaining
    assert len(remaining) == fake.deployments[WORKERS].replicas == 3
    assert all(name != pods[1] and name != pods[2] for name, _ in fake.deleted)
    await manager.close()


async def test_a_pod_that_never_becomes_ready_is_replaced(fake: FakeKubernetes,
                                                          stores: Stores) -> None:
    clock = Clock()
    manager = _manager(stores, _provisioner(fake), clock)
    await manager.set_target(DEPLOYMENT, 2)
    await manager.actuate([DEPLOYMENT])
    good, stuck = fake.live_pods(WORKERS)
    await _join(manager, fake, good, WorkerState.READY)
    await _join(manager, fake, stuck, WorkerState.LOADING)
    clock.now_s += 599.0
    await manager.actuate([DEPLOYMENT])
    assert fake.live_pods(WORKERS) == sorted([good, stuck])  # still within its time
    clock.now_s += 2.0
    await manager.actuate([DEPLOYMENT])
    assert [name for name, _ in fake.deleted] == [stuck]
    pods = fake.live_pods(WORKERS)
    assert good in pods and stuck not in pods and len(pods) == 2
    assert fake.deployments[WORKERS].replicas == 2
    (replacement,) = set(pods) - {good}
    stuck_record = await manager._backend.workers.get(stuck)
    assert stuck_record is None or stuck_record.state is WorkerState.FAILED
    await _join(manager, fake, replacement, WorkerState.READY)
    clock.now_s += 10_000.0  # READY workers have no deadline
    await manager.actuate([DEPLOYMENT])
    assert sorted(fake.live_pods(WORKERS)) == sorted([good, replacement])
    await manager.close()


async def test_a_restarted_pool_manager_adopts_the_running_pods(fake: FakeKubernetes,
                                                               stores: Stores) -> None:
    first = _manager(stores, _provisioner(fake), Clock())
    pods = await _scaled_to_three_ready(first, fake)
    await first.close()
    second = _manager(stores, _provisioner(fake), Clock())
    await second.actuate([DEPLOYMENT])  # adopts; the pool is at its target: nothing changes
    assert fake.live_pods(WORKERS) == pods and fake.deployments[WORKERS].replicas == 3
    await _beat(second, pods[1], WorkerState.READY, num_running_seqs=0)
    await second.set_target(DEPLOYMENT, 2)
    await second.actuate([DEPLOYMENT])
    await _beat(second, pods[1], WorkerState.DRAINED)
    assert fake.deleted == [(pods[1], "replicaset")]
    await second.close()


async def test_no_worker_deployment_is_a_clear_error(stores: Stores) -> None:
    cluster = FakeKubernetes("pdserve")
    with serve(cluster):
        manager = _manager(stores, _provisioner(cluster), Clock())
        await manager.set_target(DEPLOYMENT, 1)
        with pytest.raises(Exception, match="expected one worker Deployment labelled"):
            await manager.actuate([DEPLOYMENT])
        await manager.close()
    await asyncio.sleep(0)
