"""Plot training curves: the train and eval rewards of one or more runs against iteration and rollout NFE.

Each run folder's metrics.jsonl (as train.py writes it) gives a solid line per train/reward/<name>, a dashed,
dotted one per eval/reward/<name> and a dotted one per held-out reward (eval/heldout/<name>), with a red line at each
evaluation where the reward-hacking watch fired; the right panel puts the same curves against cumulative rollout NFE, the cost
axis on which methods with other group sizes or step sets compare fairly.

Run:
    python -m tools.plot runs/tiny                               # one run
    python -m tools.plot runs/tiny runs/tiny_g1 --output-dir runs/eval   # side by side: runs/eval/curves.png
"""
import math
import os
from dataclasses import dataclass, field

import tyro

from lab import checkpoint
from lab import fail


@dataclass
class Args:
    runs: tyro.conf.Positional[list[str]] = field(default_factory=list)
    """Run folders written by train.py (each holds metrics.jsonl)."""
    output_dir: str = os.path.join("runs", "eval")
    """Where curves.png is written."""


def read_metrics(run: str) -> list[dict]:
    """A run's metrics.jsonl rows sorted by iteration, the last row of each iteration kept (a resume may repeat
    one), lines cut by a crash skipped."""
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(path):
        fail(f"'{path}' not found; pass run folders written by train.py")
    read = checkpoint.read_metrics(path)
    rows = {row["iteration"]: row for row in read if isinstance(row.get("iteration"), int)}
    with open(path, errors="replace") as f:
        lines = sum(1 for line in f if line.strip())
    unread = lines - sum(1 for row in read if isinstance(row.get("iteration"), int))
    if unread:
        print(f"warning: {unread} of the {lines} rows of {path} could not be read (cut short, not JSON, or no "
              f"iteration) and are left out")
    if not rows:
        fail(f"'{path}' holds no readable rows; pass run folders written by train.py")
    return [rows[i] for i in sorted(rows)]


def reward_curves(rows: list[dict]) -> dict:
    """{key: (iterations, cumulative NFE, values)} for every train/reward/<name>, eval/reward/<name> and
    eval/heldout/<name> (the held-out rewards of --eval-rewards, which the reward-hacking watch reads); the NFE
    of a row is the rollout's forwards up to and including that iteration (perf/nfe summed)."""
    curves, nfe = {}, 0
    for row in rows:
        nfe += row.get("perf/nfe") if isinstance(row.get("perf/nfe"), (int, float)) else 0
        for key, value in row.items():
            parts = key.split("/")
            if len(parts) == 3 and parts[:2] in (["train", "reward"], ["eval", "reward"], ["eval", "heldout"]) \
                    and isinstance(value, (int, float)) and math.isfinite(value):  # a non-number is skipped
                its, nfes, values = curves.setdefault(key, ([], [], []))
                its.append(row["iteration"]), nfes.append(nfe), values.append(value)
    return curves


def plot_runs(runs: list[str], path: str):
    """Train (solid) and eval (dashed, dots) rewards of every run against iteration and cumulative NFE."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_iteration, by_nfe) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        for key, (its, nfes, values) in sorted(reward_curves(read_metrics(run)).items()):
            split, kind, name = key.split("/")
            style = dict(linestyle="-") if split == "train" else dict(linestyle="--", marker="o", markersize=3)
            if kind == "heldout":
                split, style = "held-out", dict(linestyle=":", marker="s", markersize=3)
            if len(values) == 1:  # a line of one point draws nothing: mark it
                style = {**style, "marker": "o", "markersize": 4}
            label = f"{os.path.basename(os.path.normpath(run))}: {split} {name}"
            by_iteration.plot(its, values, label=label, **style)
            by_nfe.plot(nfes, values, label=label, **style)
        for row in read_metrics(run):  # the evaluations at which the reward-hacking watch fired
            if row.get("watch/fired"):
                by_iteration.axvline(row["iteration"], color="red", alpha=0.3, linewidth=1)
    by_iteration.set_xlabel("iteration (red: the reward-hacking watch fired)")
    by_nfe.set_xlabel("cumulative rollout NFE (image-forwards)")
    for axis in (by_iteration, by_nfe):
        axis.set_ylabel("reward")
        axis.grid(alpha=0.3)
    by_nfe.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None):
    args = tyro.cli(Args, args=argv, description=__doc__.split("\n\n")[0])
    if not args.runs:
        fail("no run folders given; pass the folders train.py wrote, e.g. python -m tools.plot runs/tiny")
    plot_runs(args.runs, os.path.join(args.output_dir, "curves.png"))


if __name__ == "__main__":
    main()
