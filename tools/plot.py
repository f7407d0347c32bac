"""Plot training curves: the train and eval rewards of one or more runs against iteration and rollout NFE; or a
bench's figures.

Each run folder's metrics.jsonl (as train.py writes it) gives a solid line per train/reward/<name>, a dashed,
dotted one per eval/reward/<name> and a dotted one per held-out reward (eval/heldout/<name>), with a red line at each
evaluation where the reward-hacking watch fired (no curve is drawn in red); the right panel puts the same curves
against cumulative rollout NFE, the cost axis on which methods with other group sizes or step sets compare fairly.

A bench folder (tools/bench.py part 3: learning_per_compute.json, and learning_per_total_forwards.json from
--budget total-forwards) gives two figures, written into it: gaps_to_g2rpo.png, a forest plot of every row's gap to
G2RPO {1,2,3} in held-out success and in reward with its 95 % interval (as the bench's table computes it), one mark a
budget; and learning_curves.png (learning_curves_total_forwards.png), a panel a row against G2RPO {1,2,3} on a shared
axis of total forwards (rollout NFE + 3 x update forwards), the mean over training seeds with its 95 % band.

Run:
    python -m tools.plot runs/tiny                               # one run
    python -m tools.plot runs/tiny runs/tiny_g1 --output-dir runs/eval   # side by side: runs/eval/curves.png
    python -m tools.plot runs/bench                              # a bench's figures, both budgets where it has them
    python -m tools.plot runs/bench runs/bench_b                 # two benches' gaps in one forest plot
"""
import json
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
    """Where curves.png is written (a bench's figures go into its first folder)."""


# the curves' colours: matplotlib's ten without its red, which the reward-hacking watch's lines keep for themselves
CURVE_COLOURS = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
                 "tab:olive", "tab:cyan"]
WATCH_COLOUR = "red"


def read_metrics(run: str) -> list[dict]:
    """A run's metrics.jsonl rows sorted by iteration, the last row of each iteration kept (a resume may repeat
    one), lines cut by a crash skipped."""
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(path):
        fail(f"'{path}' not found; pass run folders written by train.py, or bench folders (tools/bench.py "
             f"--output-dir) holding learning_per_compute.json")
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
    fig = draw_runs(runs)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    _save(fig, path)


def draw_runs(runs: list[str]):
    """The figure of plot_runs: each curve a colour of CURVE_COLOURS, the same in both panels."""
    plt = _pyplot()
    fig, (by_iteration, by_nfe) = plt.subplots(1, 2, figsize=(12, 4.5))
    drawn = 0
    for run in runs:
        for key, (its, nfes, values) in sorted(reward_curves(read_metrics(run)).items()):
            split, kind, name = key.split("/")
            style = dict(linestyle="-") if split == "train" else dict(linestyle="--", marker="o", markersize=3)
            if kind == "heldout":
                split, style = "held-out", dict(linestyle=":", marker="s", markersize=3)
            if len(values) == 1:  # a line of one point draws nothing: mark it
                style = {**style, "marker": "o", "markersize": 4}
            style["color"], drawn = CURVE_COLOURS[drawn % len(CURVE_COLOURS)], drawn + 1
            label = f"{os.path.basename(os.path.normpath(run))}: {split} {name}"
            by_iteration.plot(its, values, label=label, **style)
            by_nfe.plot(nfes, values, label=label, **style)
        for row in read_metrics(run):  # the evaluations at which the reward-hacking watch fired
            if row.get("watch/fired"):
                by_iteration.axvline(row["iteration"], color=WATCH_COLOUR, alpha=0.3, linewidth=1)
    by_iteration.set_xlabel("iteration (red: the reward-hacking watch fired)")
    by_nfe.set_xlabel("cumulative rollout NFE (image-forwards)")
    for axis in (by_iteration, by_nfe):
        axis.set_ylabel("reward")
        axis.grid(alpha=0.3)
    by_nfe.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ---- a bench's figures (tools/bench.py part 3) ----
def read_bench(folder: str) -> list:
    """[(label, results)] for each budget whose results (tools/bench.py's RESULTS, .json) the folder holds."""
    from tools import bench

    found = []
    for budget, name in bench.RESULTS.items():
        path = os.path.join(folder, name + ".json")
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    results = json.load(f)
                table, curves = results["table"], results["curves"]
            except (OSError, ValueError, KeyError, TypeError):
                fail(f"'{path}' cannot be read as a bench's results; rerun the bench (python -m tools.bench --parts 3 "
                     f"--output-dir {folder}), which keeps its finished runs and writes it again")
            if bench.G2RPO_ROW not in table or bench.G2RPO_ROW not in curves:
                fail(f"'{path}' has no row {bench.G2RPO_ROW}; rerun the bench to write it again")
            found.append((budget_label(folder, results), results))
    return found


def budget_label(folder: str, results: dict) -> str:
    """A bench's budget in words, with its folder: 'runs/bench: equal rollout NFE (80,000)'."""
    if results.get("budget") == "total-forwards":
        what = f"equal total forwards ({results['budget_forwards']:,})"
    else:
        what = f"equal rollout NFE ({results['budget_nfe']:,})"
    return f"{os.path.normpath(folder)}: {what}"


def plot_bench(folders: list[str]):
    """The forest plot of every budget the folders hold, in the first folder, and each budget's learning curves in
    its own folder; prints their paths."""
    from tools import bench

    series = [(folder, label, results) for folder in folders for label, results in read_bench(folder)]
    _save(draw_forest([(label, results["table"]) for _, label, results in series]),
          os.path.join(folders[0], "gaps_to_g2rpo.png"))
    for folder, label, results in series:
        name = "learning_curves" + ("_total_forwards" if results.get("budget") == "total-forwards" else "")
        _save(draw_learning_curves(results["curves"], label, bench), os.path.join(folder, name + ".png"))


def draw_forest(tables: list):
    """Each row's gap to G2RPO {1,2,3} with its 95 % interval, success (left) and reward (right), one mark a table
    [(label, table)], filled where the interval excludes 0 (told apart); the rows sorted by the first table's gap in
    success, the largest at the top."""
    plt = _pyplot()
    first = tables[0][1]
    names = sorted({n for _, table in tables for n, row in table.items() if "gap" in row},
                   key=lambda n: -first[n]["gap"][0] if n in first and "gap" in first[n] else math.inf)
    fig, axes = plt.subplots(1, 2, figsize=(12, 1.2 + 0.38 * len(names) * max(1, len(tables) / 2)), sharey=True)
    step = 0.7 / len(tables)
    for k, (label, table) in enumerate(tables):
        colour = CURVE_COLOURS[k % len(CURVE_COLOURS)]
        for axis, gap, apart in ((axes[0], "gap", "told_apart"), (axes[1], "reward_gap", "reward_told_apart")):
            for i, name in enumerate(names):
                if name not in table:
                    continue
                mean, half = table[name][gap]
                y = i + (k - (len(tables) - 1) / 2) * step
                axis.errorbar(mean, y, xerr=0 if math.isnan(half) else half, fmt="o", color=colour, capsize=3,
                              markerfacecolor=colour if table[name][apart] else "white", label=label)
    for axis, what in ((axes[0], "held-out success rate"), (axes[1], "reward")):
        axis.axvline(0, color="black", linewidth=1)
        axis.set_xlabel(f"gap in {what} to G2RPO {{1,2,3}}")
        axis.grid(alpha=0.3, axis="x")
    axes[0].set_yticks(range(len(names)), names, fontsize=8)
    axes[0].invert_yaxis()
    handles, labels = axes[0].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    fig.legend(unique.values(), unique.keys(), loc="upper center", ncol=len(unique), fontsize=8, frameon=False)
    fig.suptitle("95 % intervals, paired on training seeds (Welch's for the other-seeds control); filled: told apart "
                 "(the interval excludes 0)", fontsize=9, y=0.02, va="bottom")
    fig.tight_layout(rect=(0, 0.05, 1, 0.93))
    return fig


def draw_learning_curves(curves: dict, label: str, bench):
    """A panel a row: its held-out success rate and G2RPO {1,2,3}'s against total forwards (rollout NFE + 3 x update
    forwards), each the mean over training seeds with its 95 % band (none at one seed), on shared axes; the
    no-learning row is the base model, a level line."""
    plt = _pyplot()
    names = [name for name in curves if name != bench.G2RPO_ROW]
    cols = min(4, len(names)) or 1
    rows = math.ceil(len(names) / cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.7 * rows + 0.6), sharex=True, sharey=True,
                             squeeze=False)
    for axis, name in zip(axes.flat, names):
        _mean_curve(axis, curves[bench.G2RPO_ROW], bench, "black", bench.G2RPO_ROW)
        if name == bench.NO_LEARNING:  # the base model, whatever the compute
            axis.axhline(curves[name][0][0][2], color=CURVE_COLOURS[0], linestyle="--", label="base model")
        else:
            _mean_curve(axis, curves[name], bench, CURVE_COLOURS[0], name)
        axis.set_title(name, fontsize=9)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=6, loc="lower right")
    for axis in axes.flat[len(names):]:
        axis.set_visible(False)
    for axis in axes[-1]:
        axis.set_xlabel(f"total forwards (rollout + {bench.UPDATE_WEIGHT} x update)", fontsize=8)
        axis.xaxis.set_major_formatter(lambda x, _: f"{x / 1000:.0f}k" if abs(x) >= 10_000 else f"{x:,.0f}")
    for axis in axes[:, 0]:
        axis.set_ylabel("held-out success rate", fontsize=8)
    fig.suptitle(f"{label}: mean over training seeds, band 95 % interval", fontsize=10)
    fig.tight_layout()
    return fig


def _mean_curve(axis, runs: list, bench, colour: str, label: str):
    """The mean over seeds of the runs' success at each evaluation, against their mean total forwards, with the
    band of its 95 % interval (`bench.interval`), cut to the rates' range 0 to 1."""
    points = min(len(run) for run in runs)  # (the seeds of a row evaluate at the same iterations)
    x = [sum(bench.total_forwards(run[i][0], run[i][5]) for run in runs) / len(runs) for i in range(points)]
    means, halves = zip(*(bench.interval([run[i][2] for run in runs]) for i in range(points)))
    axis.plot(x, means, color=colour, marker="o", markersize=2, linewidth=1.5, label=label)
    if not any(math.isnan(h) for h in halves):
        axis.fill_between(x, [max(0.0, m - h) for m, h in zip(means, halves)],
                          [min(1.0, m + h) for m, h in zip(means, halves)], color=colour, alpha=0.15, linewidth=0)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str):
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None):
    args = tyro.cli(Args, args=argv, description=__doc__.split("\n\n")[0])
    if not args.runs:
        fail("no run folders given; pass the folders train.py wrote, e.g. python -m tools.plot runs/tiny")
    if all(os.path.isfile(os.path.join(run, "metrics.jsonl")) for run in args.runs):
        plot_runs(args.runs, os.path.join(args.output_dir, "curves.png"))
        return
    benches = [folder for folder in args.runs if os.path.isdir(folder) and read_bench(folder)]
    if not benches:
        plot_runs(args.runs, os.path.join(args.output_dir, "curves.png"))  # (it says which has no metrics.jsonl)
    elif len(benches) < len(args.runs):
        fail(f"{', '.join(f for f in args.runs if f not in benches)}: not a bench folder (no learning_per_compute.json "
             f"or learning_per_total_forwards.json) among bench folders; draw run folders and benches apart")
    else:
        plot_bench(benches)


if __name__ == "__main__":
    main()
