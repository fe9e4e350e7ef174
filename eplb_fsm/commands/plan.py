"""``eplb-fsm plan``: plan a placement for a load file and report its quality.

Reads a logical load (L, N), runs a policy, and prints the balancedness of the initial
placement (slot i < N holds expert i, slot N + j holds expert j mod N), of the new one,
the best any placement could reach (the bound), and how long the policy took.
``--out`` saves ``phy2log``, ``log2phy`` and ``replica_count`` (.npz, .pt or .json).

Sizes: ``--slots P`` physical slots per layer (experts + redundant; ``--redundant R``
gives P = N + R instead; ``--replicas`` is the old name of ``--slots``), at most
:data:`MAX_SLOTS` per layer, :data:`MAX_RANKS` ranks and :data:`MAX_CELLS` layers x slots
in all (the policy takes a few seconds at those sizes; larger ones are refused, not run).

Bad input (unreadable file, wrong shape, negative or NaN loads, P % G != 0, P < N,
G % nodes != 0, sizes over the limits, ...) prints ``eplb-fsm plan: error: --OPTION:
why`` on stderr and exits with status 2, before the policy runs.
torch is imported only when the verb runs, so ``eplb-fsm --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

OUT_SUFFIXES = (".npz", ".pt", ".json")
#: largest physical slots per layer, ranks, and layers x slots a plan may ask for
MAX_SLOTS = 16_384
MAX_RANKS = 4_096
MAX_CELLS = 1 << 20


class _UsageError(Exception):
    """A bad option value; ``str(exc)`` starts with the option name."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--load",
        default="example",
        metavar="FILE",
        help="logical load (L, N): a .npy/.npz/.pt/.json file, an ESFT trace directory, esft:TASK (the bundled "
        "ESFT traces of intent, law, summary or translation) or example; default: example (the bundled ESFT "
        "intent aggregate, 26 x 64)",
    )
    from eplb_fsm.policy.registry import available_policies  # names only, no torch

    parser.add_argument("--ranks", type=int, required=True, metavar="G",
                        help=f"number of EP ranks (at most {MAX_RANKS})")
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--slots", type=int, default=None, metavar="P",
                      help=f"physical slots per layer, experts + redundant (at most {MAX_SLOTS})")
    size.add_argument("--redundant", type=int, default=None, metavar="R",
                      help="redundant slots per layer: --slots = experts in the load + R")
    size.add_argument("--replicas", type=int, dest="slots", help=argparse.SUPPRESS)  # the old name of --slots
    parser.add_argument("--nodes", type=int, default=1, metavar="N",
                        help="number of nodes; must divide --ranks (default 1)")
    parser.add_argument("--groups", type=int, default=1, metavar="K", help="expert groups (default 1)")
    parser.add_argument("--policy", default="default", choices=available_policies(),
                        help="placement policy: %(choices)s (default: default)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--out", metavar="FILE", help="save phy2log, log2phy, replica_count (.npz, .pt or .json)")


def _check_options(args: argparse.Namespace, num_layers: int, num_experts: int) -> None:
    if args.slots is None:  # --redundant R
        if args.redundant < 0:
            raise _UsageError(f"--redundant: must be >= 0, got {args.redundant}")
        args.slots = num_experts + args.redundant
    for option in ("ranks", "slots", "nodes", "groups"):
        if getattr(args, option) < 1:
            raise _UsageError(f"--{option}: must be >= 1, got {getattr(args, option)}")
    if args.ranks > MAX_RANKS:
        raise _UsageError(f"--ranks: at most {MAX_RANKS} (a plan for more would run for minutes), got {args.ranks}")
    if args.slots > MAX_SLOTS:
        raise _UsageError(f"--slots: at most {MAX_SLOTS} per layer (a plan for more would run for minutes), "
                          f"got {args.slots}")
    if num_layers * args.slots > MAX_CELLS:
        raise _UsageError(f"--slots: {num_layers} layers x {args.slots} slots is over the limit of {MAX_CELLS} "
                          "(a plan that large would run for minutes)")
    if args.slots < num_experts:
        raise _UsageError(
            f"--slots: must be >= the number of experts in the load ({num_experts}), got {args.slots}"
        )
    if args.slots % args.ranks:
        raise _UsageError(f"--slots: {args.slots} is not divisible by --ranks {args.ranks}")
    if args.ranks % args.nodes:
        raise _UsageError(f"--nodes: --ranks {args.ranks} is not divisible by --nodes {args.nodes} "
                          "(every node holds the same number of ranks)")
    if args.groups % args.nodes == 0:  # hierarchical mode
        if num_experts % args.groups:
            raise _UsageError(
                f"--groups: {args.groups} does not divide the number of experts ({num_experts}) "
                "(hierarchical mode: --groups divisible by --nodes)"
            )


def _check_out(out_arg: str | None) -> None:
    """``--out`` must be a .npz/.pt/.json file (not a directory) in an existing directory."""
    if out_arg is None:
        return
    out = Path(out_arg)
    if out.is_dir():
        raise _UsageError(f"--out: {out} is a directory; give the file to write (.npz, .pt or .json)")
    if out.suffix.lower() not in OUT_SUFFIXES:
        raise _UsageError(f"--out: unknown file type {out.suffix or '(none)'!r}; use .npz, .pt or .json")
    if not out.parent.is_dir():
        raise _UsageError(f"--out: directory {out.parent} does not exist")


def _save(path: Path, phy2log, log2phy, replica_count) -> None:
    suffix = path.suffix.lower()
    try:
        if suffix == ".npz":
            import numpy as np

            with open(path, "wb") as f:
                np.savez(f, phy2log=phy2log.numpy(), log2phy=log2phy.numpy(), replica_count=replica_count.numpy())
        elif suffix == ".pt":
            import torch

            with open(path, "wb") as f:
                torch.save({"phy2log": phy2log, "log2phy": log2phy, "replica_count": replica_count}, f)
        else:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(
                    {
                        "phy2log": phy2log.tolist(),
                        "log2phy": log2phy.tolist(),
                        "replica_count": replica_count.tolist(),
                    },
                    f,
                )
    except OSError as exc:
        raise _UsageError(f"--out: cannot write {path}: {exc}") from None


def _report_text(report: dict) -> str:
    mode = "hierarchical" if report["hierarchical"] else "global"
    lines = [
        f"load          {report['load']}  ({report['layers']} layers x {report['experts']} experts)",
        f"placement     {report['slots']} slots on {report['ranks']} ranks ({report['slots_per_rank']} per rank), "
        f"{report['nodes']} node(s), {report['groups']} group(s), {mode} mode",
        f"policy        {report['policy']}  {report['policy_time_s'] * 1e3:.2f} ms",
        "balancedness  (mean rank load / max rank load, 1.0 = perfect)",
        f"  initial     {report['balancedness_initial']:.4f}",
        f"  new         {report['balancedness']:.4f}  (worst layer {report['balancedness_worst_layer']:.4f})",
        f"  bound       {report['balancedness_bound']:.4f}  (no placement can do better)",
    ]
    if report.get("out"):
        lines.append(f"saved         {report['out']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        report = _plan(args)
    except _UsageError as exc:
        print(f"eplb-fsm plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        print(_report_text(report))
    return 0


def _plan(args: argparse.Namespace) -> dict:
    import torch

    from eplb_fsm.maps import initial_phy2log
    from eplb_fsm.policy.bounds import balancedness_bound, balancedness_per_layer, placement_balancedness
    from eplb_fsm.policy.registry import get_policy
    from eplb_fsm.sim.loads import load_matrix

    _check_out(args.out)
    try:
        policy = get_policy(args.policy)
    except ValueError as exc:
        raise _UsageError(f"--policy: {exc}") from None
    try:
        load = load_matrix(args.load)
    except ValueError as exc:
        raise _UsageError(f"--load: {exc}") from None
    num_layers, num_experts = load.shape
    _check_options(args, num_layers, num_experts)

    weight = torch.from_numpy(load)
    start = time.perf_counter()
    try:
        phy2log, log2phy, replica_count = policy.rebalance_experts(
            weight, args.slots, args.groups, args.nodes, args.ranks
        )
    except ValueError as exc:  # a rule the options check above did not know about
        raise _UsageError(f"--load/--slots/--ranks: {exc}") from None
    elapsed = time.perf_counter() - start

    initial = initial_phy2log(num_layers, num_experts, args.slots)
    report = {
        "load": str(args.load),
        "layers": num_layers,
        "experts": num_experts,
        "replicas": args.slots,
        "slots": args.slots,
        "ranks": args.ranks,
        "slots_per_rank": args.slots // args.ranks,
        "nodes": args.nodes,
        "groups": args.groups,
        "hierarchical": args.groups % args.nodes == 0 and args.groups > 1,
        "policy": args.policy,
        "policy_time_s": elapsed,
        "balancedness_initial": placement_balancedness(initial, load, args.ranks),
        "balancedness": placement_balancedness(phy2log, load, args.ranks),
        "balancedness_worst_layer": float(balancedness_per_layer(phy2log, load, args.ranks).min()),
        "balancedness_bound": balancedness_bound(load, args.slots, args.ranks),
    }
    if args.out is not None:
        _save(Path(args.out), phy2log, log2phy, replica_count)
        report["out"] = str(args.out)
    return report
