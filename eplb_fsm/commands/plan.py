"""``eplb-fsm plan``: plan a placement for a load and report its quality.

Reads a logical load (L, N), runs a policy, and prints the balancedness of the initial
placement (slot i < N holds expert i, slot N + j holds expert j mod N), of the new one,
the best any placement could reach (the bound), how long the policy took, and how many
slots the new placement moves away from the initial one (a slot is moved when its expert
had no slot on that rank before: its weights would cross the network). The initial
placement is the policy's ``old_phy2log``: ``movement_aware`` repairs it, ``default``
ignores it and plans from scratch.
``--out`` saves ``phy2log``, ``log2phy`` and ``replica_count`` (.npz, .pt or .json).

Sizes: ``--slots P`` physical slots per layer (experts + redundant; ``--redundant R``
gives P = N + R instead; ``--replicas`` is the old name of ``--slots``), at most
:data:`MAX_SLOTS` per layer, :data:`MAX_RANKS` ranks and :data:`MAX_CELLS` layers x slots
in all (the policy takes a few seconds at those sizes; larger ones are refused, not run);
``movement_aware`` also at most :data:`MAX_MOVEMENT_CELLS` layers x experts x ranks (it
keeps a table of that size), and every policy at most :data:`MAX_LOG2PHY_CELLS` entries of
``log2phy`` (layers x experts x (P - N + 1)).

Bad input (unreadable file, wrong shape, negative or NaN loads, a layer whose total reaches
2**126 or with a nonzero load below 2**-126 (the policies plan in float32, where a smaller load
becomes a subnormal or 0), P % G != 0, P < N, G % nodes != 0, sizes over the limits, an
``--out`` folder that takes no new file, ...)
prints ``eplb-fsm plan: error: --OPTION: why`` on stderr and exits with status 2, before
the policy runs. ``--out`` is written to a temporary file in its folder, then renamed
over the target: a write that fails (a full disk) leaves the previous file as it was.
torch is imported only when the verb runs, so ``eplb-fsm --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

OUT_SUFFIXES = (".npz", ".pt", ".json")
#: largest physical slots per layer, ranks, and layers x slots a plan may ask for
MAX_SLOTS = 16_384
MAX_RANKS = 4_096
MAX_CELLS = 1 << 20
#: largest layers x experts x ranks for ``movement_aware``: its (L, N, G) rank tables take
#: about 10 bytes a cell, so 2^28 cells is a few GB and a few seconds
MAX_MOVEMENT_CELLS = 1 << 28
#: largest log2phy a plan may return: (L, N, P - N + 1) int64 (the policy's output, vLLM's
#: layout), so 2^28 cells is 2 GiB
MAX_LOG2PHY_CELLS = 1 << 28


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
                        help="placement policy: %(choices)s (default: default). The initial placement is "
                        "the old one: movement_aware keeps what it can of it (target 0.99 of the default's "
                        "balancedness), default plans from scratch; the report counts the slots moved")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--out", metavar="FILE", help="save phy2log, log2phy, replica_count (.npz, .pt or .json); "
                        "written whole or not at all (a failed write keeps the previous file)")


def _check_options(args: argparse.Namespace, num_layers: int, num_experts: int) -> None:
    # the slot checks name the option the user gave: --redundant R means N + R slots
    slots_option, slots_text = "--slots", f"{args.slots} slots per layer"
    if args.slots is None:  # --redundant R
        if args.redundant < 0:
            raise _UsageError(f"--redundant: must be >= 0, got {args.redundant}")
        args.slots = num_experts + args.redundant
        slots_option = "--redundant"
        slots_text = f"{args.slots} slots per layer ({num_experts} experts + {args.redundant} redundant)"
    for option in ("ranks", "slots", "nodes", "groups"):
        if getattr(args, option) < 1:
            raise _UsageError(f"--{option}: must be >= 1, got {getattr(args, option)}")
    if args.ranks > MAX_RANKS:
        raise _UsageError(f"--ranks: at most {MAX_RANKS} (a plan for more would run for minutes), got {args.ranks}")
    if args.slots > MAX_SLOTS:
        raise _UsageError(f"{slots_option}: at most {MAX_SLOTS} slots per layer (a plan for more would run for "
                          f"minutes), got {slots_text}")
    if num_layers * args.slots > MAX_CELLS:
        raise _UsageError(f"{slots_option}: {num_layers} layers x {slots_text} is over the limit of {MAX_CELLS} "
                          "layers x slots (a plan that large would run for minutes)")
    if args.slots < num_experts:
        raise _UsageError(
            f"--slots: must be >= the number of experts in the load ({num_experts}), got {args.slots}"
        )
    if args.slots % args.ranks:
        raise _UsageError(f"{slots_option}: {slots_text} is not divisible by --ranks {args.ranks}")
    if args.ranks % args.nodes:
        raise _UsageError(f"--nodes: --ranks {args.ranks} is not divisible by --nodes {args.nodes} "
                          "(every node holds the same number of ranks)")
    if args.groups % args.nodes == 0:  # hierarchical mode
        if num_experts % args.groups:
            raise _UsageError(
                f"--groups: {args.groups} does not divide the number of experts ({num_experts}) "
                "(hierarchical mode: --groups divisible by --nodes)"
            )
    log2phy_cells = num_layers * num_experts * (args.slots - num_experts + 1)
    if log2phy_cells > MAX_LOG2PHY_CELLS:
        raise _UsageError(
            f"{slots_option}: log2phy would be {num_layers} layers x {num_experts} experts x "
            f"{args.slots - num_experts + 1} (slots - experts + 1) = {log2phy_cells} entries, over the limit of "
            f"{MAX_LOG2PHY_CELLS} (2 GiB; use fewer slots)"
        )
    if args.policy == "movement_aware" and num_layers * num_experts * args.ranks > MAX_MOVEMENT_CELLS:
        raise _UsageError(
            f"--policy: movement_aware keeps (layers, experts, ranks) tables: {num_layers} x {num_experts} x "
            f"{args.ranks} is over the limit of {MAX_MOVEMENT_CELLS} (use fewer ranks, or --policy default)"
        )


def _check_float32_range(load, source: str) -> None:
    """Every policy plans on float32 loads (``policy.base.checked_float32``), so each layer must keep its
    ratios there. ``load``: (L, N) float64, already checked finite and >= 0. Two rules, found before
    the policy runs, each a usage error naming ``--load``, the file and the first layer that breaks it:

    - a layer's total, summed from its float32 loads, must stay below ``policy.base.FLOAT32_TOTAL_LIMIT``
      (2**126);
    - every nonzero load must stay a normal float32, >= 2**-126 (``np.finfo(np.float32).tiny``): below it
      a load is rounded to a subnormal or to 0, and the layer is planned on other ratios than the given
      ones (all zero: as if it had no load). The loads are not rescaled here: a placement is the policy's
      on the loads given. Scaling a layer by a power of 2 keeps its float32 ratios exact, and so the
      default policy's placement (``movement_aware`` also has absolute tolerances).
    """
    import numpy as np

    from eplb_fsm.policy.base import FLOAT32_TOTAL_LIMIT

    with np.errstate(over="ignore", under="ignore"):  # an entry past float32's range becomes inf: reported below
        load32 = load.astype(np.float32)
    totals = load32.sum(axis=1, dtype=np.float64)
    over = np.flatnonzero(~(totals < FLOAT32_TOTAL_LIMIT))
    if over.size:
        layer = int(over[0])
        raise _UsageError(f"--load: {source}: layer {layer}'s loads sum to {float(load[layer].sum()):.4g}, past "
                          f"what the policies plan in float32 (each layer's total must be below 2**126, about "
                          f"{FLOAT32_TOTAL_LIMIT:.3g}; scale the loads down: only their ratios matter)")
    tiny = np.finfo(np.float32).tiny
    lost = (load > 0) & (load32 < tiny)
    under = np.flatnonzero(lost.any(axis=1))
    if under.size:
        layer = int(under[0])
        smallest = float(load[layer][lost[layer]].min())
        raise _UsageError(f"--load: {source}: layer {layer}'s nonzero loads underflow float32 (the smallest is "
                          f"{smallest:.4g}; every nonzero load must be at least 2**-126, about {float(tiny):.3g}, "
                          f"the smallest normal float32, which the policies plan in; scale the layer up by a "
                          f"power of 2: that keeps its float32 ratios, and so the default policy's placement)")


def _check_out(out_arg: str | None) -> Path | None:
    """``--out`` must be a .npz/.pt/.json file (not a directory) in an existing directory that takes new files.

    Returns the empty temporary file the maps will be written to (next to the target, so the
    final rename stays on one file system), or None without ``--out``. Creating it here is the
    only sure test that the folder accepts a file (``os.access`` says yes to root on /proc).
    """
    if out_arg is None:
        return None
    out = Path(out_arg)
    if out.is_dir():
        raise _UsageError(f"--out: {out} is a directory; give the file to write (.npz, .pt or .json)")
    if out.suffix.lower() not in OUT_SUFFIXES:
        raise _UsageError(f"--out: unknown file type {out.suffix or '(none)'!r}; use .npz, .pt or .json")
    if not out.parent.is_dir():
        raise _UsageError(f"--out: directory {out.parent} does not exist")
    target = Path(os.path.realpath(out))  # through a symlink: the file it names is replaced, not the link
    try:
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise _UsageError(f"--out: cannot create a file in {target.parent}: {exc.strerror or exc}") from None
    try:
        mask = os.umask(0o022)
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)  # mkstemp's 0600 would make the plan private to its writer
    finally:
        os.close(fd)
    return Path(name)


def _save(temp: Path, out: Path, phy2log, log2phy, replica_count) -> None:
    """Write the maps into ``temp`` and rename it over ``out``; ``temp`` is left for the caller to remove on error."""
    suffix = out.suffix.lower()
    try:
        # every format serialised in memory, then one write: torch's writer would turn a failed file
        # write (a full disk) into a RuntimeError about stream positions, our own write reports the OSError
        if suffix == ".json":
            data = json.dumps({"phy2log": phy2log.tolist(), "log2phy": log2phy.tolist(),
                               "replica_count": replica_count.tolist()}).encode("utf-8")
        else:
            import io

            buffer = io.BytesIO()
            if suffix == ".npz":
                import numpy as np

                np.savez(buffer, phy2log=phy2log.numpy(), log2phy=log2phy.numpy(), replica_count=replica_count.numpy())
            else:
                import torch

                torch.save({"phy2log": phy2log, "log2phy": log2phy, "replica_count": replica_count}, buffer)
            data = buffer.getbuffer()
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, Path(os.path.realpath(out)))
    except (OSError, RuntimeError) as exc:  # torch.save reports a failed write as a RuntimeError
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else (str(exc).splitlines() or [""])[0]
        raise _UsageError(f"--out: cannot write {out}: {why}") from None


def _moved_per_layer(old, new, num_ranks: int):
    """``old``, ``new`` (L, P) int arrays -> (L,) slots of ``new`` whose expert had no slot on that rank in ``old``.

    A sort-based membership test, O(L * P log), so it costs nothing next to the policy at any allowed size.
    """
    import numpy as np

    num_layers, num_slots = new.shape
    num_experts = int(max(old.max(), new.max())) + 1
    slot_rank = np.arange(num_slots) // (num_slots // num_ranks)
    key_base = (np.arange(num_layers)[:, None] * num_ranks + slot_rank) * num_experts  # (layer, rank) bucket
    return (~np.isin(key_base + new, key_base + old)).sum(1)


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
        f"moved         {report['moved_slots']} of {report['layers'] * report['slots']} slots from the initial "
        f"placement (most in one layer: {report['moved_slots_worst_layer']} of {report['slots']})",
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
    from eplb_fsm.cli import print_stdout

    print_stdout(json.dumps(report) if args.json else _report_text(report))  # `| head -1` ends it quietly
    return 0


def _plan(args: argparse.Namespace) -> dict:
    temp = _check_out(args.out)
    try:
        return _plan_into(args, temp)
    finally:
        if temp is not None:  # still there unless the rename happened: any failure, even Ctrl-C
            try:
                temp.unlink()
            except FileNotFoundError:
                pass


def _plan_into(args: argparse.Namespace, temp: Path | None) -> dict:
    import torch

    from eplb_fsm.maps import initial_phy2log
    from eplb_fsm.policy.bounds import balancedness_bound, balancedness_per_layer, placement_balancedness
    from eplb_fsm.policy.registry import get_policy
    from eplb_fsm.sim.loads import load_matrix

    try:
        policy = get_policy(args.policy)
    except ValueError as exc:
        raise _UsageError(f"--policy: {exc}") from None
    try:
        load = load_matrix(args.load)
    except ValueError as exc:
        raise _UsageError(f"--load: {exc}") from None
    _check_float32_range(load, str(args.load))
    num_layers, num_experts = load.shape
    _check_options(args, num_layers, num_experts)

    initial = initial_phy2log(num_layers, num_experts, args.slots)
    weight = torch.from_numpy(load)
    start = time.perf_counter()
    try:
        phy2log, log2phy, replica_count = policy.rebalance_experts(
            weight, args.slots, args.groups, args.nodes, args.ranks, old_phy2log=torch.from_numpy(initial)
        )
    except ValueError as exc:  # a rule the options check above did not know about
        raise _UsageError(f"--load/--slots/--ranks: {exc}") from None
    elapsed = time.perf_counter() - start

    moved = _moved_per_layer(initial, phy2log.numpy(), args.ranks)
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
        "moved_slots": int(moved.sum()),
        "moved_slots_worst_layer": int(moved.max()),
    }
    if temp is not None:
        _save(temp, Path(args.out), phy2log, log2phy, replica_count)
        report["out"] = str(args.out)
    return report
