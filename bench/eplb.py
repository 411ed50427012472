"""Benchmark redundant-expert placement (EPLB): greedy baseline vs refined, and migration-aware
re-plans.

Configurations shaped like DeepSeek-V3 serving (256 routed experts, 58 MoE layers, 8 groups):

    ep320  decode, global,        320 GPUs on 40 nodes, 320 slots (64 redundant, 1 per GPU)
    ep144  decode, global,        144 GPUs on 18 nodes, 288 slots (32 redundant, 2 per GPU)
    ep32   prefill, hierarchical,  32 GPUs on  4 nodes, 288 slots (32 redundant, 9 per GPU)

Load matrices come from ``<repo>/../shared/data/eplb_loads.json.gz`` (or ``--loads PATH``); without
the file, seeded synthetic matrices of the same shape and recipe are generated. Prints:

1. per (config, matrix): mean and worst-layer GPU balancedness, mean node balancedness and time
   per 58-layer plan for the baseline and the refined method, with an upper bound on what any
   placement can reach;
2. migration: ``--steps`` steps of seeded drift (every expert's load times U[0.8, 1.25] per step);
   the migration-aware re-plan against a re-plan from scratch every step (experts moved counted
   as changed slots, raw and after relabelling the scratch plan onto the deployed one);
3. the redundant-slot choice of the HBM-vs-KV goodput proxy under stated, illustrative inputs.

Writes bench/out/eplb.png (if matplotlib is installed). The last stdout line is one JSON object.

    python bench/eplb.py [--loads PATH] [--steps 20] [--drift-matrix zipf_s0.9] [--seed 0]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

import numpy as np

from pdserve.capacity.eplb import PlacementMethod, plan_expert_placement
from pdserve.capacity.eplb_memory import DecodeCapacity, ExpertMemoryModel, choose_num_slots
from pdserve.capacity.eplb_migration import align_to_current
from pdserve.capacity.eplb_packing import replicate_greedy
from pdserve.capacity.eplb_placement import (
    PlacementPolicy,
    PlacementTopology,
    gpu_balancedness,
    node_balancedness,
)
from pdserve.capacity.eplb_replan import DEEPSEEK_V3_EXPERT_BYTES, replan_with_migration
from pdserve.common.plotting import MISSING_NOTE, pyplot

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_LOADS = ROOT.parent / "shared" / "data" / "eplb_loads.json.gz"
OUT_DIR = ROOT / "bench" / "out"
MATRIX_KEYS = (
    "zipf_s0.0",
    "zipf_s0.3",
    "zipf_s0.6",
    "zipf_s0.9",
    "zipf_s1.2",
    "grouped_zipf_g0.8_s0.6",
)
NUM_LAYERS, NUM_EXPERTS, NUM_GROUPS = 58, 256, 8
CONFIGS = {
    "ep320": PlacementTopology(320, 320, 40, NUM_GROUPS, PlacementPolicy.GLOBAL),
    "ep144": PlacementTopology(288, 144, 18, NUM_GROUPS, PlacementPolicy.GLOBAL),
    "ep32": PlacementTopology(288, 32, 4, NUM_GROUPS, PlacementPolicy.HIERARCHICAL),
}
# Illustrative decode inputs for the HBM trade-off (not measurements): DeepSeek-V3 MLA KV cache in
# BF16, 61 layers x (512 + 64) x 2 bytes per token, 64-token blocks; 40 GiB of HBM per GPU left
# for KV at the minimum expert slots; sequences of 4,096 tokens on average; 256 sequences per GPU
# as the MoE compute limit at the step-time target if load were perfectly even.
KV_BYTES_PER_BLOCK = 61 * 576 * 2 * 64
KV_BYTES_PER_GPU = 40 * 2**30
BLOCKS_PER_SEQUENCE = 4096 / 64
MAX_SEQUENCES_PER_GPU = 256.0


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def synthetic_loads(seed: int) -> dict[str, np.ndarray]:
    """Token counts per (layer, expert) following the recipe of the shared data set.

    Popularity proportional to (rank + 1) ** -s over a fresh permutation per layer (the grouped
    case ranks experts within each of the 8 groups of 32 consecutive experts and multiplies a
    Zipf(0.8) factor over the groups), then 16,384 tokens each pick 8 distinct experts by
    Gumbel-top-k.
    """
    rng = np.random.default_rng(seed)
    group_size = NUM_EXPERTS // NUM_GROUPS
    tiny = np.finfo(np.float32).tiny
    matrices = {}
    for key in MATRIX_KEYS:
        skew = float(key.rsplit("_s", 1)[1])
        is_grouped = key.startswith("grouped")
        rows = []
        for _ in range(NUM_LAYERS):
            if is_grouped:
                # Ranks within each group (this reproduces the shared matrices' spread).
                rank = np.concatenate([rng.permutation(group_size) for _ in range(NUM_GROUPS)])
                group_factor = (rng.permutation(NUM_GROUPS) + 1.0) ** -0.8
                popularity = (rank + 1.0) ** -skew * np.repeat(group_factor, group_size)
            else:
                popularity = (rng.permutation(NUM_EXPERTS) + 1.0) ** -skew
            uniform = np.maximum(rng.random((16_384, NUM_EXPERTS), dtype=np.float32), tiny)
            scores = np.log(popularity).astype(np.float32) - np.log(-np.log(uniform))
            chosen = np.argpartition(-scores, 8, axis=1)[:, :8]
            rows.append(np.bincount(chosen.ravel(), minlength=NUM_EXPERTS))
        matrices[key] = np.array(rows, dtype=float)
    return matrices


def load_matrices(path: Path | None, seed: int) -> tuple[dict[str, np.ndarray], str]:
    candidate = path if path is not None else DEFAULT_LOADS
    if candidate.is_file():
        with gzip.open(candidate, "rt") as handle:
            raw = json.load(handle)
        return {key: np.asarray(raw[key], dtype=float) for key in MATRIX_KEYS}, str(candidate.name)
    if path is not None:
        raise SystemExit(f"--loads {path}: no such file")
    log(f"{candidate.name} not found; generating seeded synthetic matrices (seed {seed})")
    return synthetic_loads(seed), f"synthetic(seed={seed})"


def balance_bound(loads: np.ndarray, topology: PlacementTopology) -> np.ndarray:
    """Upper bound on GPU balancedness per layer that no placement can beat.

    The heaviest GPU carries at least: the mean; the largest copy under the replication that
    minimises it (greedy, optimal for that); for the hierarchical policy the heaviest node's share
    under the best group-to-node split (exact by sorted pairing when two groups share a node,
    otherwise the mean node load); and, when GPUs must hold only single-copy experts, the best
    such GPU. With ``R`` redundant slots at least ``E - R`` experts keep one copy, and with ``k``
    slots per GPU at least ``g = E - R - (k - 1) * P`` GPUs hold ``k`` of them; those GPUs are at
    best the ``g * k`` lightest experts, sorted-paired for ``k = 2`` (optimal), averaged otherwise.
    Exact for one slot per GPU.
    """
    num_layers, num_experts = loads.shape
    mean = loads.sum(axis=1) / topology.num_gpus
    counts = replicate_greedy(loads, topology.num_slots)
    bound = np.maximum(mean, (loads / counts).max(axis=1))
    if topology.policy is PlacementPolicy.HIERARCHICAL:
        groups = np.sort(loads.reshape(num_layers, topology.num_groups, -1).sum(axis=2), axis=1)
        if topology.num_groups == 2 * topology.num_nodes:
            node_max = (groups + groups[:, ::-1]).max(axis=1)
        else:
            node_max = groups.sum(axis=1) / topology.num_nodes
        bound = np.maximum(bound, node_max / topology.gpus_per_node)
    k = topology.slots_per_gpu
    num_full_gpus = num_experts - (topology.num_slots - num_experts) - (k - 1) * topology.num_gpus
    if k >= 2 and num_full_gpus > 0:
        lightest = np.sort(loads, axis=1)[:, : num_full_gpus * k]
        if k == 2:
            full_max = (lightest + lightest[:, ::-1]).max(axis=1)
        else:
            full_max = lightest.sum(axis=1) / num_full_gpus
        bound = np.maximum(bound, full_max)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(bound > 0, mean / bound, 1.0)


def run_placement_table(matrices: dict[str, np.ndarray]) -> tuple[dict, dict, list[dict]]:
    ours, baseline, rows = {}, {}, []
    header = (
        f"{'config':<6} {'matrix':<23}| {'baseline mean  min':>18} | {'refined mean  min':>17} |"
        f" {'gain':>6} | {'bound':>6} | {'node base':>9} {'node ref':>8} |"
        f" {'s base':>7} {'s ref':>6}"
    )
    print("GPU balancedness = mean GPU load / max GPU load per layer (mean and worst of 58 layers)")
    print(header)
    print("-" * len(header))
    for name, topology in CONFIGS.items():
        for key in MATRIX_KEYS:
            loads = matrices[key]
            log(f"placing {name}/{key}")
            result = {}
            for method in PlacementMethod:
                start = time.perf_counter()
                placement = plan_expert_placement(loads, topology, method)
                seconds = time.perf_counter() - start
                balance = gpu_balancedness(placement, loads)
                result[method] = (balance, node_balancedness(placement, loads).mean(), seconds)
            base, ref = result[PlacementMethod.GREEDY], result[PlacementMethod.REFINED]
            assert (ref[0] >= base[0] - 1e-12).all(), f"refined worse than greedy on {name}/{key}"
            bound = balance_bound(loads, topology).mean()
            label = f"{name}/{key}"
            for target, (balance, _, seconds) in ((baseline, base), (ours, ref)):
                target[label] = {
                    "balancedness_mean": round(float(balance.mean()), 5),
                    "balancedness_min": round(float(balance.min()), 5),
                    "seconds": round(seconds, 4),
                }
            gain = ref[0].mean() / base[0].mean() - 1.0
            rows.append(
                {"label": label, "base": base[0].mean(), "ours": ref[0].mean(), "bound": bound,
                 "node_base": base[1], "node_ours": ref[1]}
            )
            print(
                f"{name:<6} {key:<23}| {base[0].mean():>11.4f} {base[0].min():6.4f} |"
                f" {ref[0].mean():>10.4f} {ref[0].min():6.4f} | {100 * gain:+5.2f}% |"
                f" {bound:6.4f} |"
                f" {base[1]:9.4f} {ref[1]:8.4f} | {base[2]:7.3f} {ref[2]:6.3f}",
                flush=True,
            )
    print(
        "gain: refined mean over baseline mean. bound: mean over layers of an upper bound on the"
        " balancedness any placement reaches (exact for ep320)."
    )
    return ours, baseline, rows


def run_migration(
    matrices: dict[str, np.ndarray], key: str, num_steps: int, seed: int
) -> tuple[dict, dict]:
    summary, series = {}, {}
    num_slots_total = {name: NUM_LAYERS * topology.num_slots for name, topology in CONFIGS.items()}
    print()
    print(
        f"Migration over {num_steps} steps of drift on {key} (each load x U[0.8, 1.25] per step,"
        f" seed {seed}); a moved expert = a (layer, slot) whose expert changes,"
        f" {DEEPSEEK_V3_EXPERT_BYTES / 1e6:.1f} MB each"
    )
    header = (
        f"{'config':<6} {'step':>4} | {'stay':>6} | {'migration bal  moved':>20} |"
        f" {'scratch bal  moved':>18}"
        f" {'aligned':>8} | {'target':>6}"
    )
    for name, topology in CONFIGS.items():
        print(header)
        print("-" * len(header))
        rng = np.random.default_rng(seed)
        loads = matrices[key].copy()
        deployed = plan_expert_placement(loads, topology)
        scratch_deployed = deployed
        record = {
            "migration_balance": [],
            "migration_moved": [],
            "scratch_balance": [],
            "scratch_moved": [],
            "aligned_moved": [],
            "seconds_migration": [],
            "seconds_scratch": [],
        }
        for step in range(1, num_steps + 1):
            loads = loads * rng.uniform(0.8, 1.25, size=loads.shape)
            log(f"drift {name} step {step}/{num_steps}")
            stay = gpu_balancedness(deployed, loads).mean()
            start = time.perf_counter()
            plan = replan_with_migration(
                deployed, loads, DEEPSEEK_V3_EXPERT_BYTES, balance_tolerance=0.01
            )
            record["seconds_migration"].append(time.perf_counter() - start)
            start = time.perf_counter()
            scratch = plan_expert_placement(loads, topology)
            record["seconds_scratch"].append(time.perf_counter() - start)
            scratch_moved = int((scratch.slot_to_expert != scratch_deployed.slot_to_expert).sum())
            aligned = align_to_current(
                np.asarray(scratch.slot_to_expert),
                np.asarray(scratch_deployed.slot_to_expert),
                topology.num_gpus,
                topology.num_nodes if topology.policy is PlacementPolicy.HIERARCHICAL else 1,
            )
            aligned_moved = int((aligned != scratch_deployed.slot_to_expert).sum())
            migration_balance = gpu_balancedness(plan.placement, loads).mean()
            scratch_balance = gpu_balancedness(scratch, loads).mean()
            for field, value in (
                ("migration_balance", migration_balance),
                ("migration_moved", plan.num_experts_moved),
                ("scratch_balance", scratch_balance),
                ("scratch_moved", scratch_moved),
                ("aligned_moved", aligned_moved),
            ):
                record[field].append(float(value))
            print(
                f"{name:<6} {step:>4} | {stay:6.4f} | {migration_balance:>13.4f}"
                f" {plan.num_experts_moved:6d} |"
                f" {scratch_balance:>11.4f} {scratch_moved:6d} {aligned_moved:8d} |"
                f" {plan.target_balancedness.mean():6.4f}",
                flush=True,
            )
            deployed, scratch_deployed = plan.placement, scratch
        moved = np.mean(record["migration_moved"])
        summary[name] = {
            "balancedness_mean_migration": round(float(np.mean(record["migration_balance"])), 5),
            "balancedness_mean_scratch": round(float(np.mean(record["scratch_balance"])), 5),
            "experts_moved_per_step_migration": round(float(moved), 1),
            "experts_moved_per_step_scratch": round(float(np.mean(record["scratch_moved"])), 1),
            "experts_moved_per_step_scratch_aligned": round(
                float(np.mean(record["aligned_moved"])), 1
            ),
            "fraction_of_slots_moved_per_step_migration": round(
                float(moved / num_slots_total[name]), 5
            ),
            "gigabytes_moved_per_step_migration": round(
                float(moved * DEEPSEEK_V3_EXPERT_BYTES / 1e9), 2
            ),
            "seconds_per_replan": round(float(np.mean(record["seconds_migration"])), 3),
        }
        series[name] = record
        s = summary[name]
        print(
            f"{name}: mean balancedness migration {s['balancedness_mean_migration']:.4f} vs scratch"
            f" {s['balancedness_mean_scratch']:.4f}; experts moved per step"
            f" {s['experts_moved_per_step_migration']:.0f}"
            f" vs {s['experts_moved_per_step_scratch']:.0f} from scratch"
            f" ({s['experts_moved_per_step_scratch_aligned']:.0f} after relabelling);"
            f" {s['gigabytes_moved_per_step_migration']:.1f} GB per step over the pool"
        )
        print()
    return summary, series


def run_memory_tradeoff(matrices: dict[str, np.ndarray], key: str) -> dict:
    print(
        f"HBM trade-off on {key} (illustrative inputs: {KV_BYTES_PER_GPU / 2**30:.0f} GiB KV"
        f" per GPU, {KV_BYTES_PER_BLOCK / 1e6:.2f} MB per 64-token MLA block,"
        f" {BLOCKS_PER_SEQUENCE:.0f} blocks per sequence,"
        f" compute limit {MAX_SEQUENCES_PER_GPU:.0f} sequences per GPU at perfect balance)"
    )
    print(
        f"{'config':<6} {'slots':>5} {'redund.':>7} {'blocks lost':>11} {'balance':>7}"
        f" {'kv seq':>7} {'compute seq':>11} {'proxy':>6}"
    )
    loads = matrices[key]
    choices = {}
    for name, slot_counts in (("ep320", (320, 640)), ("ep144", (288, 432, 576))):
        base = CONFIGS[name]
        balance = {}
        for num_slots in slot_counts:
            topology = PlacementTopology(
                num_slots, base.num_gpus, base.num_nodes, base.num_groups, base.policy
            )
            log(f"trade-off {name} with {num_slots} slots")
            balance[num_slots] = float(
                gpu_balancedness(plan_expert_placement(loads, topology), loads).mean()
            )
        memory = ExpertMemoryModel(
            NUM_EXPERTS, base.num_gpus, NUM_LAYERS, DEEPSEEK_V3_EXPERT_BYTES, KV_BYTES_PER_BLOCK
        )
        capacity = DecodeCapacity(
            KV_BYTES_PER_GPU // KV_BYTES_PER_BLOCK, BLOCKS_PER_SEQUENCE, MAX_SEQUENCES_PER_GPU
        )
        best, options = choose_num_slots(memory, capacity, balance)
        for option in options:
            mark = "  <- chosen" if option is best else ""
            print(
                f"{name:<6} {option.num_slots:5d} {option.num_redundant_slots:7d}"
                f" {option.kv_blocks_given_up_per_gpu:11d} {option.balancedness:7.4f}"
                f" {option.kv_limited_sequences:7.1f} {option.compute_limited_sequences:11.1f}"
                f" {option.goodput_proxy:6.1f}{mark}"
            )
        choices[name] = best.num_slots
    print()
    return choices


def write_plot(rows: list[dict], series: dict) -> str:
    plt = pyplot()
    if plt is None:
        return MISSING_NOTE
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(1, 4, figsize=(24, 5.5))
    positions = np.arange(len(rows))
    axes[0].bar(positions - 0.27, [r["base"] for r in rows], 0.27, label="baseline (greedy)")
    axes[0].bar(positions, [r["ours"] for r in rows], 0.27, label="refined")
    axes[0].bar(
        positions + 0.27, [r["bound"] for r in rows], 0.27, label="upper bound", color="lightgray"
    )
    axes[0].set_xticks(positions, [r["label"] for r in rows], rotation=75, fontsize=7)
    axes[0].set_ylabel("mean GPU balancedness")
    axes[0].set_title("Balancedness per config / load matrix")
    axes[0].legend(fontsize=8)
    axes[3].bar(positions - 0.2, [r["node_base"] for r in rows], 0.4, label="baseline (greedy)")
    axes[3].bar(positions + 0.2, [r["node_ours"] for r in rows], 0.4, label="refined")
    axes[3].set_xticks(positions, [r["label"] for r in rows], rotation=75, fontsize=7)
    axes[3].set_ylabel("mean node balancedness")
    axes[3].set_title("Node balancedness (hot GPUs spread over nodes)")
    axes[3].legend(fontsize=8)
    for name, record in series.items():
        steps = np.arange(1, len(record["migration_moved"]) + 1)
        (line,) = axes[1].plot(
            steps, np.cumsum(record["migration_moved"]), label=f"{name} migration-aware"
        )
        axes[1].plot(
            steps,
            np.cumsum(record["scratch_moved"]),
            "--",
            color=line.get_color(),
            label=f"{name} from scratch",
        )
        axes[1].plot(
            steps,
            np.cumsum(record["aligned_moved"]),
            ":",
            color=line.get_color(),
            label=f"{name} scratch relabelled",
        )
        axes[2].plot(
            steps,
            record["migration_balance"],
            color=line.get_color(),
            label=f"{name} migration-aware",
        )
        axes[2].plot(
            steps,
            record["scratch_balance"],
            "--",
            color=line.get_color(),
            label=f"{name} from scratch",
        )
    axes[1].set_yscale("log")
    axes[1].set_xlabel("drift step")
    axes[1].set_ylabel("cumulative expert copies moved")
    axes[1].set_title("Weights moved")
    axes[1].legend(fontsize=7)
    axes[2].set_xlabel("drift step")
    axes[2].set_ylabel("mean GPU balancedness")
    axes[2].set_title("Balance under drift")
    axes[2].legend(fontsize=7)
    figure.tight_layout()
    path = OUT_DIR / "eplb.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"plot written to {path.relative_to(ROOT)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--loads", type=Path, default=None, help="eplb_loads.json.gz (default: shared data)"
    )
    parser.add_argument(
        "--steps", type=int, default=20, help="drift steps for the migration comparison"
    )
    parser.add_argument("--drift-matrix", default="zipf_s0.9", choices=MATRIX_KEYS)
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the drift (and of synthetic loads)"
    )
    args = parser.parse_args()
    started = time.perf_counter()
    matrices, source = load_matrices(args.loads, args.seed)
    print(f"loads: {source}; {NUM_LAYERS} layers x {NUM_EXPERTS} experts per matrix")
    ours, baseline, rows = run_placement_table(matrices)
    migration, series = run_migration(matrices, args.drift_matrix, args.steps, args.seed)
    choices = run_memory_tradeoff(matrices, args.drift_matrix)
    print(write_plot(rows, series))
    print(f"total {time.perf_counter() - started:.1f} s")
    migration.update(
        {
            "matrix": args.drift_matrix,
            "steps": args.steps,
            "expert_bytes": DEEPSEEK_V3_EXPERT_BYTES,
            "balance_tolerance": 0.01,
        }
    )
    ours.update({"baseline": baseline, "migration": migration, "chosen_num_slots": choices})
    print(json.dumps(ours, sort_keys=False))


if __name__ == "__main__":
    main()
