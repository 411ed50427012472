"""Contracts of the expert placement (EPLB): shapes, consistency, groups on nodes, balance,
moves."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.capacity.eplb import PlacementMethod, plan_expert_placement
from pdserve.capacity.eplb_memory import DecodeCapacity, ExpertMemoryModel, choose_num_slots
from pdserve.capacity.eplb_placement import (
    ExpertPlacement,
    PlacementPolicy,
    PlacementTopology,
    gpu_balancedness,
    gpu_loads,
    node_balancedness,
)
from pdserve.capacity.eplb_replan import replan_with_migration
from pdserve.common.errors import InvalidArgumentError

HIER = PlacementPolicy.HIERARCHICAL
GLOBAL = PlacementPolicy.GLOBAL

# (name, topology, num_experts): one slot per GPU, two per GPU, many per GPU with groups on nodes.
TOPOLOGIES = [
    ("one_slot_per_gpu", PlacementTopology(40, 40, 5, 4, GLOBAL), 32),
    ("two_slots_per_gpu", PlacementTopology(72, 36, 6, 4, GLOBAL), 64),
    ("hierarchical", PlacementTopology(72, 8, 2, 4, HIER), 64),
    ("hierarchical_four_groups_per_node", PlacementTopology(80, 8, 2, 8, HIER), 64),
]


def zipf_loads(seed: int, num_layers: int, num_experts: int, skew: float) -> np.ndarray:
    """Token counts per (layer, expert): Zipf popularity over a random permutation per layer."""
    rng = np.random.default_rng(seed)
    rank = np.argsort(rng.random((num_layers, num_experts)), axis=1) + 1.0
    popularity = rank**-skew
    popularity /= popularity.sum(axis=1, keepdims=True)
    return np.stack([rng.multinomial(4096, row) for row in popularity]).astype(float)


def assert_contracts(placement: ExpertPlacement, num_layers: int, num_experts: int) -> None:
    topology = placement.topology
    slot_map = placement.slot_to_expert
    assert slot_map.shape == (num_layers, topology.num_slots)
    assert slot_map.min() >= 0 and slot_map.max() < num_experts
    counts = placement.expert_num_copies
    assert counts.shape == (num_layers, num_experts)
    assert counts.min() >= 1, "every expert keeps a copy"
    assert (counts.sum(axis=1) == topology.num_slots).all()
    to_slots = placement.expert_to_slots
    assert to_slots.shape[:2] == (num_layers, num_experts)
    for layer in range(num_layers):
        seen = np.zeros(topology.num_slots, dtype=int)
        for expert in range(num_experts):
            slots = to_slots[layer, expert]
            valid = slots[slots >= 0]
            assert (slots[len(valid) :] == -1).all(), "padding only at the end"
            assert len(valid) == counts[layer, expert]
            assert (slot_map[layer, valid] == expert).all()
            seen[valid] += 1
        assert (seen == 1).all(), "expert_to_slots covers every slot exactly once"
        per_gpu = np.bincount(topology.gpu_of_slot()[seen == 1], minlength=topology.num_gpus)
        assert (per_gpu == topology.slots_per_gpu).all()


def assert_groups_on_nodes(placement: ExpertPlacement, num_experts: int) -> None:
    topology = placement.topology
    node_of_slot = topology.node_of_gpu()[topology.gpu_of_slot()]
    group_of_expert = np.arange(num_experts) // (num_experts // topology.num_groups)
    for layer in range(placement.num_layers):
        group_nodes: dict[int, set[int]] = {}
        for slot, expert in enumerate(placement.slot_to_expert[layer]):
            group_nodes.setdefault(int(group_of_expert[expert]), set()).add(int(node_of_slot[slot]))
        assert all(len(nodes) == 1 for nodes in group_nodes.values()), group_nodes
        per_node = np.bincount(
            [next(iter(n)) for n in group_nodes.values()], minlength=topology.num_nodes
        )
        assert (per_node == topology.num_groups // topology.num_nodes).all()


def no_expert_twice_on_a_gpu(placement: ExpertPlacement) -> bool:
    blocks = placement.slot_to_expert.reshape(placement.num_layers, placement.topology.num_gpus, -1)
    ordered = np.sort(blocks, axis=2)
    return not (ordered[:, :, 1:] == ordered[:, :, :-1]).any()


@pytest.mark.parametrize(
    ("name", "topology", "num_experts"), TOPOLOGIES, ids=[t[0] for t in TOPOLOGIES]
)
@pytest.mark.parametrize("method", list(PlacementMethod))
def test_placement_contracts(
    name: str, topology: PlacementTopology, num_experts: int, method: PlacementMethod
) -> None:
    loads = zipf_loads(seed=1, num_layers=6, num_experts=num_experts, skew=1.0)
    placement = plan_expert_placement(loads, topology, method)
    assert_contracts(placement, 6, num_experts)
    if topology.policy is HIER:
        assert_groups_on_nodes(placement, num_experts)
    assert not placement.slot_to_expert.flags.writeable


@pytest.mark.parametrize(
    ("name", "topology", "num_experts"), TOPOLOGIES, ids=[t[0] for t in TOPOLOGIES]
)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("skew", [0.0, 0.6, 1.2])
def test_refined_at_least_as_balanced_as_greedy(
    name: str, topology: PlacementTopology, num_experts: int, seed: int, skew: float
) -> None:
    loads = zipf_loads(seed=seed, num_layers=5, num_experts=num_experts, skew=skew)
    greedy = plan_expert_placement(loads, topology, PlacementMethod.GREEDY)
    refined = plan_expert_placement(loads, topology, PlacementMethod.REFINED)
    assert (gpu_balancedness(refined, loads) >= gpu_balancedness(greedy, loads) - 1e-12).all()
    if topology.policy is HIER:
        assert_groups_on_nodes(refined, num_experts)


def test_refined_beats_greedy_somewhere_with_many_slots_per_gpu() -> None:
    """The local search has work to do when copies share GPUs: it must find something."""
    topology = PlacementTopology(72, 8, 2, 4, HIER)
    loads = zipf_loads(seed=3, num_layers=8, num_experts=64, skew=1.0)
    greedy = gpu_balancedness(plan_expert_placement(loads, topology, PlacementMethod.GREEDY), loads)
    refined = gpu_balancedness(plan_expert_placement(loads, topology), loads)
    assert refined.mean() > greedy.mean()


def test_one_slot_per_gpu_matches_greedy_optimum() -> None:
    """With one slot per GPU copy counts alone decide balance and greedy replication is optimal."""
    topology = PlacementTopology(40, 40, 5, 4, GLOBAL)
    loads = zipf_loads(seed=4, num_layers=4, num_experts=32, skew=1.2)
    greedy = gpu_balancedness(plan_expert_placement(loads, topology, PlacementMethod.GREEDY), loads)
    refined = gpu_balancedness(plan_expert_placement(loads, topology), loads)
    np.testing.assert_allclose(refined, greedy)


def test_global_refined_spreads_hot_gpus_over_nodes() -> None:
    topology = PlacementTopology(72, 36, 6, 4, GLOBAL)
    loads = zipf_loads(seed=5, num_layers=4, num_experts=64, skew=1.0)
    greedy = node_balancedness(
        plan_expert_placement(loads, topology, PlacementMethod.GREEDY), loads
    )
    refined = node_balancedness(plan_expert_placement(loads, topology), loads)
    assert (refined >= greedy - 1e-12).all() and refined.mean() > greedy.mean()


def test_refined_never_puts_an_expert_twice_on_a_gpu_when_greedy_does_not() -> None:
    topology = PlacementTopology(72, 36, 6, 4, GLOBAL)
    loads = zipf_loads(seed=6, num_layers=4, num_experts=64, skew=0.9)
    greedy = plan_expert_placement(loads, topology, PlacementMethod.GREEDY)
    if no_expert_twice_on_a_gpu(greedy):
        assert no_expert_twice_on_a_gpu(plan_expert_placement(loads, topology))


def test_plans_are_deterministic() -> None:
    topology = PlacementTopology(72, 8, 2, 4, HIER)
    loads = zipf_loads(seed=7, num_layers=3, num_experts=64, skew=0.8)
    first = plan_expert_placement(loads, topology)
    second = plan_expert_placement(loads, topology)
    assert (first.slot_to_expert == second.slot_to_expert).all()


def test_balancedness_metrics_by_hand() -> None:
    """Two GPUs of two slots on two nodes; expert 0 (load 6) has two copies."""
    topology = PlacementTopology(4, 2, 2, 1, GLOBAL)
    placement = ExpertPlacement.from_slot_map(np.array([[0, 1, 0, 2]]), 3, topology)
    loads = np.array([[6.0, 4.0, 2.0]])
    np.testing.assert_allclose(gpu_loads(placement, loads), [[7.0, 5.0]])
    np.testing.assert_allclose(gpu_balancedness(placement, loads), [6.0 / 7.0])
    np.testing.assert_allclose(node_balancedness(placement, loads), [6.0 / 7.0])
    assert placement.expert_to_slots[0, 0].tolist() == [0, 2]
    assert placement.expert_to_slots[0, 1].tolist() == [1, -1]
    np.testing.assert_allclose(gpu_balancedness(placement, np.zeros((1, 3))), [1.0])


@pytest.mark.parametrize(
    ("name", "topology", "num_experts"), TOPOLOGIES, ids=[t[0] for t in TOPOLOGIES]
)
def test_replan_with_unchanged_loads_moves_nothing(
    name: str, topology: PlacementTopology, num_experts: int
) -> None:
    loads = zipf_loads(seed=8, num_layers=4, num_experts=num_experts, skew=1.0)
    current = plan_expert_placement(loads, topology)
    plan = replan_with_migration(current, loads, expert_bytes=1000)
    assert plan.num_experts_moved == 0 and plan.bytes_moved == 0
    assert (plan.placement.slot_to_expert == current.slot_to_expert).all()


@pytest.mark.parametrize(
    ("name", "topology", "num_experts"), TOPOLOGIES, ids=[t[0] for t in TOPOLOGIES]
)
def test_replan_after_drift_reaches_target_and_counts_moves(
    name: str, topology: PlacementTopology, num_experts: int
) -> None:
    loads = zipf_loads(seed=9, num_layers=4, num_experts=num_experts, skew=1.0)
    current = plan_expert_placement(loads, topology)
    drifted = loads * np.random.default_rng(10).uniform(0.5, 2.0, loads.shape)
    plan = replan_with_migration(current, drifted, expert_bytes=1000, balance_tolerance=0.01)
    assert_contracts(plan.placement, 4, num_experts)
    if topology.policy is HIER:
        assert_groups_on_nodes(plan.placement, num_experts)
    achieved = gpu_balancedness(plan.placement, drifted)
    assert (achieved >= plan.target_balancedness - 0.01 - 1e-9).all()
    changed = (plan.placement.slot_to_expert != current.slot_to_expert).sum(axis=1)
    assert (changed == plan.layer_num_experts_moved).all()
    assert plan.num_experts_moved == changed.sum() and plan.bytes_moved == 1000 * changed.sum()
    scratch = plan_expert_placement(drifted, topology)
    assert plan.num_experts_moved < (scratch.slot_to_expert != current.slot_to_expert).sum()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_nodes=st.integers(1, 3),
    gpus_per_node=st.integers(1, 3),
    groups_per_node=st.integers(1, 2),
    group_size=st.integers(1, 4),
    extra_slots_per_gpu=st.integers(0, 2),
    is_hierarchical=st.booleans(),
    seed=st.integers(0, 2**16),
    skew=st.floats(0.0, 1.5),
)
def test_property_contracts_and_no_worse_than_greedy(
    num_nodes: int,
    gpus_per_node: int,
    groups_per_node: int,
    group_size: int,
    extra_slots_per_gpu: int,
    is_hierarchical: bool,
    seed: int,
    skew: float,
) -> None:
    num_groups = num_nodes * groups_per_node
    num_experts = num_groups * group_size
    num_gpus = num_nodes * gpus_per_node
    slots_per_gpu = -(-num_experts // num_gpus) + extra_slots_per_gpu
    policy = HIER if is_hierarchical else GLOBAL
    topology = PlacementTopology(slots_per_gpu * num_gpus, num_gpus, num_nodes, num_groups, policy)
    loads = zipf_loads(seed, num_layers=3, num_experts=num_experts, skew=skew)
    loads[0] = 0.0  # a layer with no traffic at all
    greedy = plan_expert_placement(loads, topology, PlacementMethod.GREEDY)
    refined = plan_expert_placement(loads, topology)
    for placement in (greedy, refined):
        assert_contracts(placement, 3, num_experts)
        if is_hierarchical:
            assert_groups_on_nodes(placement, num_experts)
    assert (gpu_balancedness(refined, loads) >= gpu_balancedness(greedy, loads) - 1e-12).all()
    assert gpu_balancedness(refined, loads)[0] == 1.0


BAD_TOPOLOGIES = [
    (
        {"num_slots": 300, "num_gpus": 32, "num_nodes": 4, "num_groups": 8, "policy": HIER},
        "multiple of num_gpus",
    ),
    (
        {"num_slots": 288, "num_gpus": 36, "num_nodes": 5, "num_groups": 8, "policy": GLOBAL},
        "multiple of num_nodes",
    ),
    (
        {"num_slots": 288, "num_gpus": 32, "num_nodes": 4, "num_groups": 6, "policy": HIER},
        "num_groups divisible by num_nodes",
    ),
    (
        {"num_slots": 0, "num_gpus": 32, "num_nodes": 4, "num_groups": 8, "policy": HIER},
        "num_slots must be a positive",
    ),
    (
        {"num_slots": 288, "num_gpus": 32, "num_nodes": 4, "num_groups": 8, "policy": "diagonal"},
        "unknown placement policy",
    ),
]


@pytest.mark.parametrize(("fields", "constraint"), BAD_TOPOLOGIES)
def test_bad_topology_names_the_constraint(fields: dict, constraint: str) -> None:
    with pytest.raises(InvalidArgumentError, match=constraint):
        PlacementTopology(**fields)


def _with(row: int, col: int, value: float) -> np.ndarray:
    loads = np.ones((2, 64))
    loads[row, col] = value
    return loads


BAD_LOADS = [
    (_with(0, 3, -1.0), PlacementTopology(288, 32, 4, 8, HIER), ">= 0"),
    (_with(1, 0, np.nan), PlacementTopology(288, 32, 4, 8, HIER), "finite"),
    (_with(1, 0, np.inf), PlacementTopology(288, 32, 4, 8, HIER), "finite"),
    (np.ones(64), PlacementTopology(288, 32, 4, 8, HIER), "2-D matrix"),
    (np.ones((2, 0)), PlacementTopology(288, 32, 4, 8, HIER), "2-D matrix"),
    (
        np.ones((2, 64)),
        PlacementTopology(32, 32, 4, 8, HIER),
        r"num_slots must be >= num_experts.*32.*64",
    ),
    (
        np.ones((2, 60)),
        PlacementTopology(288, 32, 4, 8, HIER),
        r"num_experts divisible by num_groups.*60.*8",
    ),
    ([["a"] * 64], PlacementTopology(288, 32, 4, 8, HIER), "numeric"),
]


@pytest.mark.parametrize(("loads", "topology", "constraint"), BAD_LOADS)
def test_bad_loads_name_the_constraint(
    loads: np.ndarray, topology: PlacementTopology, constraint: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=constraint):
        plan_expert_placement(loads, topology)


def test_bad_topology_message_names_values() -> None:
    with pytest.raises(InvalidArgumentError, match=r"num_slots=300, num_gpus=32"):
        PlacementTopology(300, 32, 4, 8, HIER)
    with pytest.raises(InvalidArgumentError, match=r"num_groups=6, num_nodes=4"):
        PlacementTopology(288, 32, 4, 6, HIER)
    with pytest.raises(InvalidArgumentError, match=r"num_gpus=36, num_nodes=5"):
        PlacementTopology(288, 36, 5, 8, GLOBAL)


def test_replan_rejects_mismatched_loads_and_bad_arguments() -> None:
    topology = PlacementTopology(72, 8, 2, 4, HIER)
    loads = zipf_loads(seed=11, num_layers=2, num_experts=64, skew=1.0)
    current = plan_expert_placement(loads, topology)
    with pytest.raises(InvalidArgumentError, match="one row per layer"):
        replan_with_migration(current, loads[:1], expert_bytes=1)
    with pytest.raises(InvalidArgumentError, match="one column per expert"):
        replan_with_migration(current, loads[:, :32], expert_bytes=1)
    with pytest.raises(InvalidArgumentError, match="expert_bytes"):
        replan_with_migration(current, loads, expert_bytes=-1)
    with pytest.raises(InvalidArgumentError, match="balance_tolerance"):
        replan_with_migration(current, loads, expert_bytes=1, balance_tolerance=1.5)


def test_memory_cost_only_above_the_minimum_slots_per_gpu() -> None:
    expert_bytes = 3 * 7168 * 2048
    ep32 = ExpertMemoryModel(
        num_experts=256,
        num_gpus=32,
        num_moe_layers=58,
        expert_bytes=expert_bytes,
        kv_bytes_per_block=1 << 20,
    )
    assert ep32.redundant_slots_per_gpu(256) == 0 and ep32.kv_blocks_given_up_per_gpu(256) == 0
    assert ep32.redundant_slots_per_gpu(288) == 1
    assert ep32.kv_blocks_given_up_per_gpu(288) == -(-58 * expert_bytes // (1 << 20))
    ep144 = ExpertMemoryModel(
        num_experts=256,
        num_gpus=144,
        num_moe_layers=58,
        expert_bytes=expert_bytes,
        kv_bytes_per_block=1 << 20,
    )
    assert ep144.kv_blocks_given_up_per_gpu(288) == 0, (
        "256 experts on 144 GPUs need 2 slots per GPU anyway"
    )
    with pytest.raises(InvalidArgumentError, match="multiple of num_gpus"):
        ep32.kv_blocks_given_up_per_gpu(300)


def test_choose_num_slots_trades_balance_against_kv() -> None:
    memory = ExpertMemoryModel(
        num_experts=64, num_gpus=8, num_moe_layers=10, expert_bytes=100, kv_bytes_per_block=100
    )
    balance = {64: 0.6, 72: 0.8, 80: 0.85}
    roomy = DecodeCapacity(
        kv_blocks_per_gpu=10_000, blocks_per_sequence=10.0, max_sequences_per_gpu=100.0
    )
    best, options = choose_num_slots(memory, roomy, balance)
    assert best.num_slots == 80, "with KV to spare the most balanced plan wins"
    assert [o.kv_blocks_given_up_per_gpu for o in options] == [0, 10, 20]
    tight = DecodeCapacity(
        kv_blocks_per_gpu=600, blocks_per_sequence=10.0, max_sequences_per_gpu=100.0
    )
    best, _ = choose_num_slots(memory, tight, balance)
    assert best.num_slots == 64, "when KV binds, every redundant slot costs sequences"
    assert best.goodput_proxy == pytest.approx(min(600 / 10.0, 0.6 * 100.0))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    is_hierarchical=st.booleans(),
    slots_per_gpu=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    drift=st.floats(0.0, 1.0),
    tolerance=st.sampled_from([0.0, 0.01, 0.05]),
)
def test_property_replan_keeps_contracts_and_target(
    is_hierarchical: bool, slots_per_gpu: int, seed: int, drift: float, tolerance: float
) -> None:
    num_experts, num_gpus, num_nodes, num_groups = 32, 16, 4, 8
    if slots_per_gpu * num_gpus < num_experts:
        slots_per_gpu = num_experts // num_gpus
    policy = HIER if is_hierarchical else GLOBAL
    topology = PlacementTopology(slots_per_gpu * num_gpus, num_gpus, num_nodes, num_groups, policy)
    loads = zipf_loads(seed, num_layers=3, num_experts=num_experts, skew=1.0)
    current = plan_expert_placement(loads, topology)
    rng = np.random.default_rng(seed + 1)
    drifted = loads * np.exp(rng.normal(0.0, drift, loads.shape))
    plan = replan_with_migration(current, drifted, expert_bytes=7, balance_tolerance=tolerance)
    assert_contracts(plan.placement, 3, num_experts)
    if is_hierarchical:
        assert_groups_on_nodes(plan.placement, num_experts)
    achieved = gpu_balancedness(plan.placement, drifted)
    assert (achieved >= plan.target_balancedness - tolerance - 1e-9).all()
    changed = (plan.placement.slot_to_expert != current.slot_to_expert).sum(axis=1)
    assert (changed == plan.layer_num_experts_moved).all() and plan.bytes_moved == 7 * changed.sum()
