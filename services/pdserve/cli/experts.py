"""``pdserve experts``: per-GPU expert load before and after a placement, as a table and a heat map.

Two modes:

* from a load file (no server needed): ``pdserve experts --loads eplb_loads.json.gz --key
  zipf_s0.9 --config ep320`` places the matrix with the published greedy baseline (before) and
  with pdserve's refined method (after) on a DeepSeek-V3-shaped pool;
* ``pdserve experts live --address HOST:PORT --deployment NAME``: the placement the governor has in
  force (``GetExpertPlacement``): its version, balancedness per layer under the governor's load
  estimate, and expert copies per GPU. With ``--loads``/``--key`` as well (a matrix of the
  deployment's shape) it shows per-GPU load under the placement in force (before) and under the
  governor's what-if placement for those loads (after).

Loads are token counts per ``[layer][expert]``; a file holds one matrix or a JSON object of named
matrices (gzip when the name ends in ``.gz``). A GPU's relative load is its load over the mean
GPU load of the layer (1.0 = perfectly even; the heaviest GPU of a layer is its straggler). The heat
map (GPU x layer, before and after, matplotlib Agg) goes to ``--png``.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.common.errors import InvalidArgumentError
from pdserve.common.plotting import pyplot

CONFIGS: dict[str, tuple[int, int, int, int, str]] = {
    "ep320": (320, 320, 40, 8, "global"),
    "ep144": (288, 144, 18, 8, "global"),
    "ep32": (288, 32, 4, 8, "hierarchical"),
}
"""(slots, GPUs, nodes, groups, policy) of DeepSeek-V3-shaped pools: decode on 40 nodes with 64
redundant slots, production decode on 18 nodes with 32, prefill on 4 nodes with 32 and the 8
expert groups kept on nodes (DeepSeek-V3 inference system overview)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    default = os.environ.get("PDSERVE_ADDRESS", "127.0.0.1:50051")
    parser.add_argument("mode", nargs="?", choices=["live"],
                        help="live: the placement the governor has in force")
    parser.add_argument("--address", default=default,
                        help="governor (or pdserve up) address, live mode [PDSERVE_ADDRESS]")
    parser.add_argument("--deployment", default="",
                        help="live mode: deployment (NAME:prefill for its prefill pool)")
    parser.add_argument("--loads", type=Path, default=None,
                        help="load matrix file (.json or .json.gz; [layer][expert] token counts)")
    parser.add_argument("--key", default="", help="matrix name inside a file of several")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="ep320",
                        help="pool shape for --loads without live (default ep320)")
    parser.add_argument("--png", type=Path, default=Path("experts_heatmap.png"),
                        help="heat map output (default experts_heatmap.png); '-' for none")
    parser.add_argument("--max-rows", type=int, default=48,
                        help="GPUs listed, heaviest first (0 = all, in GPU order)")


def run(args: argparse.Namespace) -> int:
    if args.mode == "live":
        return asyncio.run(_live(args))
    if args.loads is None:
        raise InvalidArgumentError(
            "--loads: required without 'live' (or use 'pdserve experts live')", field="loads"
        )
    return _offline(args)


# -- loads ------------------------------------------------------------------------------------


def read_loads(path: Path, key: str) -> np.ndarray:
    """``float64[layers, experts]`` from ``path`` (one matrix, or ``key`` of an object of them)."""
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt") as handle:
            document = json.load(handle)
    except FileNotFoundError:
        raise InvalidArgumentError(f"--loads: no such file {path}", field="loads") from None
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"--loads: {path} is not (gzipped) JSON: {exc}",
                                   field="loads") from None
    if isinstance(document, dict):
        if not key:
            raise InvalidArgumentError(
                f"--key: required, {path.name} holds {', '.join(sorted(document))}", field="key")
        if key not in document:
            raise InvalidArgumentError(
                f"--key: {key!r} not in {path.name} (it holds {', '.join(sorted(document))})",
                field="key")
        document = document[key]
    matrix = np.asarray(document, dtype=np.float64)
    if matrix.ndim != 2:
        raise InvalidArgumentError(
            f"--loads: expected a [layers][experts] matrix, got shape {matrix.shape}",
            field="loads")
    return matrix


# -- placements and loads ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Side:
    """One side of the comparison: a label and per-GPU loads ``[layers, num_gpus]``."""

    label: str
    gpu_loads: np.ndarray

    @property
    def relative(self) -> np.ndarray:
        """Load over the layer's mean GPU load (1.0 for a layer without load)."""
        mean = self.gpu_loads.mean(axis=1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(mean > 0, self.gpu_loads / mean, 1.0)

    @property
    def balancedness(self) -> np.ndarray:
        """Per layer mean / max GPU load."""
        return 1.0 / self.relative.max(axis=1)


def gpu_loads_of(slot_to_expert: np.ndarray, loads: np.ndarray, num_gpus: int) -> np.ndarray:
    """``[layers, num_gpus]`` loads, each expert's load split evenly over its copies."""
    num_layers, num_slots = slot_to_expert.shape
    copies = np.zeros_like(loads)
    np.add.at(copies, (np.repeat(np.arange(num_layers), num_slots), slot_to_expert.reshape(-1)), 1)
    per_slot = np.take_along_axis(loads / np.maximum(copies, 1), slot_to_expert, axis=1)
    return per_slot.reshape(num_layers, num_gpus, -1).sum(axis=2)


def _offline(args: argparse.Namespace) -> int:
    from pdserve.capacity.eplb import PlacementMethod, plan_expert_placement
    from pdserve.capacity.eplb_placement import PlacementPolicy, PlacementTopology

    loads = read_loads(args.loads, args.key)
    num_slots, num_gpus, num_nodes, num_groups, policy = CONFIGS[args.config]
    topology = PlacementTopology(num_slots, num_gpus, num_nodes, num_groups,
                                 PlacementPolicy(policy))
    sides = []
    for label, method in (("baseline", PlacementMethod.GREEDY), ("ours", PlacementMethod.REFINED)):
        placement = plan_expert_placement(loads, topology, method)
        sides.append(Side(label, gpu_loads_of(placement.slot_to_expert, loads, num_gpus)))
    title = f"{args.config} ({policy}, {num_slots} slots on {num_gpus} GPUs, {num_nodes} nodes)"
    if args.key:
        title = f"{args.key} on {title}"
    _report(title, sides[0], sides[1], num_nodes, args)
    return 0


# -- live -------------------------------------------------------------------------------------


async def _live(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.api.v1 import governor_pb2, governor_pb2_grpc
    from pdserve.common.grpc_client import error_from_rpc_error

    if not args.deployment:
        raise InvalidArgumentError("--deployment: required in live mode", field="deployment")
    loads = read_loads(args.loads, args.key) if args.loads is not None else None
    try:
        async with grpc.aio.insecure_channel(args.address) as channel:
            stub = governor_pb2_grpc.CapacityGovernorServiceStub(channel)
            response = await stub.GetExpertPlacement(
                governor_pb2.GetExpertPlacementRequest(deployment=args.deployment), timeout=30)
            if not response.HasField("placement"):
                print(f"{args.deployment}: no expert placement yet (the governor places experts "
                      f"once MoE workers have reported enough tokens)")
                return 0
            current = response.placement
            slot_map = np.asarray(current.slot_to_expert, dtype=np.int64).reshape(
                current.num_layers, current.num_slots)
            _print_current(current, slot_map)
            if loads is None:
                return 0
            if loads.shape != (current.num_layers, current.num_experts):
                raise InvalidArgumentError(
                    f"--loads: the deployment has [{current.num_layers}][{current.num_experts}] "
                    f"(layers, experts), the matrix is {list(loads.shape)}", field="loads")
            proposal = await stub.WhatIfExpertPlacement(governor_pb2.WhatIfExpertPlacementRequest(
                expert_loads=loads.reshape(-1).tolist(), num_layers=current.num_layers,
                num_experts=current.num_experts, num_slots=current.num_slots,
                num_gpus=current.num_gpus, num_nodes=1, num_groups=1,
                policy=governor_pb2.PLACEMENT_POLICY_GLOBAL), timeout=120)
    except grpc.RpcError as exc:
        error = error_from_rpc_error(exc)
        print(f"pdserve experts: {error.code.name}: {error.message}", file=sys.stderr)
        return 1
    proposed = np.asarray(proposal.placement.slot_to_expert, dtype=np.int64).reshape(
        slot_map.shape)
    print()
    before = Side(f"v{current.version}", gpu_loads_of(slot_map, loads, current.num_gpus))
    after = Side("proposed", gpu_loads_of(proposed, loads, current.num_gpus))
    _report(f"{current.deployment}: in force vs proposed for {args.loads.name}", before, after, 1,
            args)
    return 0


def _print_current(current: object, slot_map: np.ndarray) -> None:
    balance = np.asarray(current.balancedness)  # type: ignore[attr-defined]
    num_gpus = current.num_gpus  # type: ignore[attr-defined]
    num_experts = current.num_experts  # type: ignore[attr-defined]
    print(f"{current.deployment}: expert placement v{current.version}, "  # type: ignore[attr-defined]
          f"{slot_map.shape[0]} MoE layers x {slot_map.shape[1]} slots on {num_gpus} GPUs, "
          f"{slot_map.shape[1] - num_experts} redundant slots per layer")
    if balance.size:
        print(f"balancedness under the governor's load estimate: mean {balance.mean():.4f}, "
              f"worst layer {balance.min():.4f} (layer {int(balance.argmin())})")
    per_gpu = slot_map.reshape(slot_map.shape[0], num_gpus, -1)
    distinct = np.array([[len(set(row.tolist())) for row in layer] for layer in per_gpu])
    copies = np.zeros((slot_map.shape[0], num_experts), dtype=int)
    np.add.at(copies, (np.repeat(np.arange(slot_map.shape[0]), slot_map.shape[1]),
                       slot_map.reshape(-1)), 1)
    replicated = (copies > 1).sum(axis=1)
    print(f"experts with more than one copy per layer: mean {replicated.mean():.1f}, "
          f"most copies of one expert: {copies.max()}")
    rows = [[str(g), f"{distinct[:, g].mean():.1f}"] for g in range(num_gpus)]
    print(_table(["gpu", "distinct_experts/layer"], rows))


# -- output -----------------------------------------------------------------------------------


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    body = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join([line, "  ".join("-" * w for w in widths), *body])


def _report(title: str, before: Side, after: Side, num_nodes: int,
            args: argparse.Namespace) -> None:
    num_gpus = before.gpu_loads.shape[1]
    gpus_per_node = num_gpus // max(1, num_nodes)
    print(title)
    for side in (before, after):
        balance = side.balancedness
        print(f"  {side.label:>9}: balancedness mean {balance.mean():.4f}, worst layer "
              f"{balance.min():.4f}; heaviest GPU {side.relative.max():.3f}x the layer mean")
    rel_before, rel_after = before.relative, after.relative
    order = list(range(num_gpus))
    if args.max_rows:
        order = sorted(order, key=lambda g: -rel_before[:, g].max())[: args.max_rows]
    rows = [[str(g), str(g // gpus_per_node),
             f"{rel_before[:, g].mean():.3f}", f"{rel_before[:, g].max():.3f}",
             f"{rel_after[:, g].mean():.3f}", f"{rel_after[:, g].max():.3f}"] for g in order]
    print("per-GPU load over the layer's mean GPU load (mean and max over layers)")
    print(_table(["gpu", "node", f"{before.label}_mean", f"{before.label}_max",
                  f"{after.label}_mean", f"{after.label}_max"], rows))
    if len(order) < num_gpus:
        print(f"... {num_gpus - len(order)} lighter GPUs not shown (--max-rows 0 lists all)")
    if str(args.png) != "-":
        if draw_heat_map(before, after, title, args.png):
            print(f"heat map: {args.png}")


def draw_heat_map(before: Side, after: Side, title: str, path: Path) -> bool:
    """Two panels, GPU (x) by layer (y), colour = load over the layer's mean GPU load.
    Returns False (and draws nothing) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    vmax = float(max(before.relative.max(), after.relative.max()))
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=True, constrained_layout=True)
    image = None
    for ax, side in zip(axes, (before, after), strict=True):
        image = ax.imshow(side.relative, aspect="auto", cmap="magma", vmin=0.0, vmax=vmax,
                          interpolation="nearest")
        ax.set_title(f"{side.label}: balancedness {side.balancedness.mean():.3f} "
                     f"(worst layer {side.balancedness.min():.3f})", fontsize=10)
        ax.set_xlabel("GPU")
    axes[0].set_ylabel("MoE layer")
    fig.colorbar(image, ax=axes, label="GPU load / layer mean")
    fig.suptitle(title, fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
