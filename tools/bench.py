"""What G2RPO costs and what it buys, measured side by side.

  1. Rollout cost: image-forwards (NFE) and transformer calls per prompt per iteration, counted by running the
     rollouts with a counting velocity function: this project's G2RPO rollout, the reference code's structure
     (same math, every forward at batch 1, the SDE-step forward recomputed per member), and each peer's recipe
     (--method) at its own published settings.
  2. Speed on the tiny model, same machine, same run: seconds per iteration split into sampling, decoding,
     reward and update, batched (this project) against a batch-1 loop with the reference's structure.
  3. Learning per unit of compute on the tiny model, with statistics a reviewer accepts: every method trains the
     same rollout NFE on the same training seeds; its held-out success rate at the budget (1,152 images, standard
     error <= 0.015) gets a 95 % interval over seeds, and its gap to G2RPO a paired 95 % interval, "told apart"
     only where that excludes 0. The headline rows are the paper's two claims (singular stochastic sampling
     against full SDE; multi-granularity against one granularity), then, under --peers, the peers' recipes; three
     controls show what the bench can tell: G2RPO on other seeds (must not be told apart), no learning (lr 0,
     which leaves the base model as it is: its evaluation, taken once by the first run) and G2RPO with its step
     credit destroyed (every step the mean advantage of its member). Runs go side by side, one torch thread each;
     a killed bench resumes, keeping its finished runs; Ctrl-C (SIGINT or SIGTERM) starts no more, lets the runs in
     flight save and stop, and exits 130. A table and a PNG plot; tools/plot.py draws its gaps and curves.
     --budget total-forwards gives every method the same total compute instead: rollout NFE + 3 x update forwards.
The GPU figures (FLUX.1-dev-sized transformer, seconds per phase, TFLOP/s) come from tools/gpu_check.py.

Run:  python -m tools.bench --parts 3          (CPU: every core; on a CUDA machine the runs share the GPU)
      python -m tools.bench --parts 3 --peers  (and the peers' recipes: more than twice as long)
      python -m tools.bench --parts 3 --budget total-forwards   (the same rows at equal total compute)
      python -m tools.bench --quick            (every part, shortened, under 2 minutes)
      python -m tools.plot runs/bench          (its forest plot of gaps and its learning curves)
"""
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
import torch
import tyro

from g2rpo import G2RPO
from methods.base import UpdateContext
from lab import flags
from lab.run import RENAMED
from methods import DEFAULT_METHOD, METHODS as METHOD_CLASSES
from sampler import rollout_g2rpo, rollout_g2rpo_paper, sigma_schedule



@dataclass
class Args:
    quick: bool = False
    """A shortened run of every part (what the tests run), in place of the flags it sets (it says which): part 2 at
    G 4; part 3 at 2 seeds a row, one run at a time in this process, a 128-NFE budget (every row at its floor of 2
    iterations: the header says what the runs spend), G 4 and 2 prompts an iteration, into OUTPUT_DIR/quick."""
    parts: tuple[int, ...] = (1, 2, 3)
    """Which parts to run."""
    speed_group_size: int = 12
    """Part 2: the group size G of the timed iteration (12: the reference's)."""
    seeds: int = 5
    """Training seeds per method in part 3 (the same seeds for every method, so gaps pair on them); more narrow
    every interval, at a run each per method (docs/performance.md: 5 and 8 at 80,000 NFE)."""
    budget_nfe: int = 80_000
    """Part 3: image-forwards each method may spend on rollouts (equal for all). 80,000: the smallest budget measured
    at which the tiny world's success rate tells learning from none (docs/performance.md)."""
    budget: str = "rollout-nfe"
    """Part 3: what every method spends equally. rollout-nfe: --budget-nfe rollout image-forwards (the paper's
    axis); total-forwards: --budget-forwards of rollout NFE + 3 x update forwards (a forward with gradients costs
    about three), which charges the methods whose update forwards every image at many sigmas (DiffusionNFT, AWM:
    over 100 times G2RPO's). Its runs, table and plot have names of their own (forwards_*, learning_per_total_forwards),
    beside the rollout-NFE ones in the same --output-dir."""
    budget_forwards: int = 0
    """Part 3, --budget total-forwards: the total forwards each method may spend; 0: what G2RPO {1,2,3} spends at
    --budget-nfe (84,016 at 80,000: 79,744 rollout NFE and 1,424 update forwards)."""
    jobs: int = os.cpu_count() or 1
    """Part 3: training runs side by side, each a subprocess with one torch thread (0: one at a time in this
    process, with its threads)."""
    eval_seeds: int = 8
    """Part 3: noise seeds per held-out prompt at the intermediate evaluations (12 prompts each)."""
    final_eval_seeds: int = 96
    """Part 3: noise seeds per held-out prompt at the budget (96: 1,152 images, a standard error <= 0.015)."""
    prompts_per_iteration: int = 4
    """Part 3: prompts of every run's iteration. At equal rollout NFE, fewer learn less on the tiny world (40,000
    NFE, G2RPO: 1 or 2 prompts an iteration lost reward on some seeds, 4 to 16 gained alike; docs/performance.md)."""
    peers: bool = False
    """Part 3: also every other registered method's tiny recipe (each file of methods/) at the same rollout NFE. Most
    run more iterations on it than G2RPO and spend more forwards in their update: a run takes up to four times a
    G2RPO run's (docs/performance.md)."""
    methods: tuple[str, ...] = ()
    """Part 3: only these rows (names as in the table; G2RPO {1,2,3}, the row every gap is taken to, is always run;
    --peers adds the peers' rows to them); () = the paper's two claims and the controls; all = every row: the paper's
    claims, every registered method, the controls."""
    extra: tuple[str, ...] = ()
    """Part 3: train.py flags added to every run (e.g. --max-batch 64); a repeated --extra adds to the earlier. A flag
    the bench sets on the runs itself (--method, --seed, --num-iterations, --output-dir, a row's own flags, ...) is
    refused, naming the bench's flag for it."""
    output_dir: str = "runs/bench"
    """Where part 3's runs, its table (JSON) and plot go."""
    tiny_cache: str = ".cache"
    """The tiny model's cache (see train.py --tiny-cache)."""


def zero_velocity(x, sigma, idx):
    return torch.zeros_like(x)


def zero_rollout(a, it):
    """The rollout of iteration `it` of the method of the parsed flags `a` with a zero velocity, every call as large
    as it needs: the forwards it costs (`nfe`, `calls`), for `a.prompts_per_iteration` prompts (at least one)."""
    method = dataclasses.replace(flags.method_of(a), max_batch=10**6)
    prompts = a.prompts_per_iteration or 1
    gens = [torch.Generator() for _ in range(prompts)]
    noise = method.initial_noise(lambda g: torch.zeros(len(g), 1), gens)  # (B, 1) or (B, G, 1): the shape
    return method.rollout(zero_velocity, noise, sigma_schedule(a.num_steps, a.shift),
                          gens, method.trained_steps(it))


def part1():
    print("\n## 1. Rollout cost per prompt per iteration (NFE = one transformer forward on one image)\n")
    print("| method | settings | sampling NFE | transformer calls | training forwards |")
    print("|---|---|---|---|---|")
    rows = []
    for grans in ([1, 2], [1, 2, 3], [1]):
        sigmas, gens = sigma_schedule(16, 3.0), [torch.Generator().manual_seed(0)]
        kw = dict(group_size=12, sde_steps=list(range(8)), granularities=grans, eta=0.7)
        ours = rollout_g2rpo(zero_velocity, torch.zeros(1, 4), sigmas, gens, **kw, max_batch=4096)
        ref = rollout_g2rpo_paper(zero_velocity, torch.zeros(1, 4), sigmas, [torch.Generator().manual_seed(0)],
                                      **kw)
        label = f"G 12, N 16, M 0..7, Lambda {set(grans)}"
        rows.append(("G2RPO reference code", label, ref.nfe, ref.calls, 8))
        rows.append(("G2RPO, this project", label, ours.nfe, ours.calls, 8))
    rows += [recipe_cost(method) for method in METHOD_CLASSES if method not in ("g2rpo", "full-sde")]
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:,} | {r[3]:,} | {r[4]} |")
    return rows


def recipe_cost(method):
    """One row of part 1: `--model flux --method method` at its own defaults, rolled out by train.py's code (a
    zero velocity), its first iteration. Sampling NFE: the rollout's and the prompts' choice (a method's
    `anchor_candidates`: an ODE anchor per candidate); training forwards: the method's `update_nfe` (one per start
    latent and trained step: G2RPO's members share theirs, a trajectory's member has its own)."""
    a = flags.parse_args(["--model", "flux", "--method", method, "--prompts-per-iteration", "1"])
    rollout, m = zero_rollout(a, 0), flags.method_of(a)
    nfe = rollout.nfe + m.anchor_candidates * a.num_steps
    label = f"G {a.group_size}, N {a.num_steps}, steps {_spans(rollout.sde_steps)} trained"
    if m.anchor_candidates:
        label += f", a pool of {m.anchor_candidates} anchors"
    return (f"--method {method}", label, nfe, rollout.calls, m.update_nfe(rollout))


def _spans(steps) -> str:
    """Trained steps as ranges: [0, 1, 2, 4] -> '0..2, 4'."""
    spans = []
    for k in steps:
        if spans and k == spans[-1][1] + 1:
            spans[-1][1] = k
        else:
            spans.append([k, k])
    return ", ".join(f"{a}..{b}" if b > a else f"{a}" for a, b in spans) or "none"


# ---------------------------------------------------------------------------------------------------------------
# part 2: speed on the tiny model
# ---------------------------------------------------------------------------------------------------------------
def load_tiny(cache):
    from lab import tiny
    from lab.models import FluxAdapter

    path = tiny.ensure_pretrained(cache, log=lambda *a: None)
    return FluxAdapter.load(path, "cpu", torch.float32, guidance=3.5, max_sequence_length=16)


def part2(args):
    from lab import tiny
    from advantage import granular_advantages

    adapter = load_tiny(args.tiny_cache)
    B, G, res = 1, args.speed_group_size, tiny.RESOLUTION
    steps, grans = [0, 1, 2, 3], [1, 2, 3]
    sigmas = sigma_schedule(8, 3.0)
    prompts = tiny.prompt_split()[0][:B]
    cond = adapter.encode(prompts)
    velocity = lambda x, s, i: adapter.velocity(adapter.transformer, cond, x, s, i, res)
    params = list(adapter.transformer.parameters())
    state = {k: v.clone() for k, v in adapter.transformer.state_dict().items()}
    results, kw = {}, dict(group_size=G, sde_steps=steps, granularities=grans, eta=0.7)
    for mode in ("batched", "reference"):
        adapter.transformer.load_state_dict(state)
        optimizer = torch.optim.AdamW(params, lr=0.0)
        new_gens = lambda: [torch.Generator().manual_seed(7 + b) for b in range(B)]
        gens = new_gens()
        noise = adapter.noise(gens, res)
        if mode == "reference":  # our rollout on the same noise, untimed: the update's input and a math check
            check_gens = new_gens()
            adapter.noise(check_gens, res)
            rollout = rollout_g2rpo(velocity, noise, sigmas, check_gens, **kw, max_batch=512)
        t0 = time.time()
        if mode == "batched":
            rollout = rollout_g2rpo(velocity, noise, sigmas, gens, **kw, max_batch=512)
            finals, nfe = rollout.final_latents, rollout.nfe
        else:
            plain = rollout_g2rpo_paper(velocity, noise, sigmas, gens, **kw)
            finals, nfe = plain.final_latents, plain.nfe
        t1 = time.time()
        flat = finals.flatten(0, 3)
        chunk = 64 if mode == "batched" else 1
        images = torch.cat([adapter.decode(flat[i : i + chunk], res) for i in range(0, len(flat), chunk)])
        t2 = time.time()
        labels = [p for p in prompts for _ in range(flat.shape[0] // B)]
        scores = torch.cat([tiny.shape_reward(images[i : i + chunk], labels[i : i + chunk])
                            for i in range(0, len(flat), chunk)])
        t3 = time.time()
        rewards = scores.view(B, len(grans), len(steps), G, 1)  # (B, J, K, G, R)
        advantages = granular_advantages(rewards, adv_clip_max=5.0)
        method = G2RPO(sde_steps=steps, group_size=G, eta=0.7, clip_range=1e-4, adv_clip_max=5.0, max_grad_norm=1.0,
                       max_batch=64, inner_epochs=1, kl_beta=0.0, granularities=grans)
        if mode == "batched":
            method.update(rollout, advantages, UpdateContext(velocity, params, optimizer, sigmas))
        else:  # the reference trains member by member: one batch-1 forward per member and step
            dataclasses.replace(method, max_batch=1).update(_per_member(rollout), advantages,
                                                            UpdateContext(velocity, params, optimizer, sigmas))
            torch.testing.assert_close(finals, rollout.final_latents, atol=1e-4, rtol=1e-4)  # same math
        t4 = time.time()
        results[mode] = dict(sampling=t1 - t0, decode=t2 - t1, reward=t3 - t2, update=t4 - t3, total=t4 - t0, nfe=nfe)
    print(f"\n## 2. Seconds per iteration on the tiny model (CPU, {torch.get_num_threads()} threads; "
          f"B {B}, G {G}, N 8, M 0..3, Lambda {{1, 2, 3}})\n")
    print("| rollout | NFE | sampling | decoding | reward | update | total |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        print(f"| {mode} | {r['nfe']} | {r['sampling']:.2f} | {r['decode']:.2f} | {r['reward']:.2f} | "
              f"{r['update']:.2f} | {r['total']:.2f} |")
    ratio = results["reference"]["total"] / results["batched"]["total"]
    print(f"\nbatched rollout: {ratio:.1f}x faster per iteration than the reference structure "
          f"(sampling alone {results['reference']['sampling'] / results['batched']['sampling']:.1f}x)")
    return results


def _per_member(rollout):
    """The same rollout with the shared start latent repeated per member, so the update forwards every member."""
    G = rollout.next_latents.shape[2]
    return dataclasses.replace(rollout, start_latents=rollout.start_latents.expand(
        -1, -1, G, *rollout.start_latents.shape[3:]))


# ---------------------------------------------------------------------------------------------------------------
# part 3: learning per unit of compute, with intervals and controls
# ---------------------------------------------------------------------------------------------------------------
# Every method trains the tiny preset (G 8, N 8, M 0..3, lr 1e-4; --prompts-per-iteration, 4) for the same rollout NFE.
# The headline rows are the paper's two claims, then (--peers) the peers' recipes; the controls show what the bench
# can tell.
HEADLINE = {
    "G2RPO {1,2,3}": [],
    "full SDE, same M": ["--method", "full-sde"],  # singular stochastic sampling against whole SDE trajectories
    "G2RPO {1}": ["--granularities", "1"],  # multi-granularity against one granularity
}
# under --peers: every other registered method at its tiny recipe, by its label (a peer's run forwards every member
# in its update, two to three times a G2RPO run's time; a new method's file and registry line add its row)
PEERS = {cls.label: ["--method", name] for name, cls in METHOD_CLASSES.items()
         if name != DEFAULT_METHOD and ["--method", name] not in HEADLINE.values()}
G2RPO_ROW = "G2RPO {1,2,3}"
OTHER_SEEDS = 1000  # the negative control's training seeds start here
FIRST_EVAL = ["--first-eval-seeds", "1"]  # every run but the first: the base model is evaluated once
NO_LEARNING = "control: no learning (lr 0)"
CONTROLS = {
    "control: G2RPO on other seeds": [],  # must not be told apart (compared unpaired)
    # must be told apart. lr 0 leaves every weight where it was (AdamW's step and its weight decay both scale with the
    # lr; tests/test_bench.py checks it), so this row is the base model's evaluation, taken once: the run it stands
    # for is never started
    NO_LEARNING: ["--lr", "0"],
    "control: step credit destroyed": ["--step-credit", "mean"],  # the paper's central claim, on this world
}
METHODS = {**HEADLINE, **PEERS, **CONTROLS}
UPDATE_WEIGHT = 3  # a forward with gradients in total forwards: the forward and its backward (about twice its cost)
# each budget's results and plot (.json, .png) in --output-dir, by --budget
RESULTS = {"rollout-nfe": "learning_per_compute", "total-forwards": "learning_per_total_forwards"}
# the train.py flags the bench sets on every run (refused in --extra), and where to set each instead
SET_BY_BENCH = {
    "--model": "it trains the tiny model (of the bench's --tiny-cache)",
    "--model-path": "it trains the tiny model (of the bench's --tiny-cache)",
    "--tiny-cache": "use the bench's --tiny-cache",
    "--method": "choose the rows with the bench's --methods (or --peers)",
    "--seed": "use the bench's --seeds (every row trains the same seeds, 0 to --seeds - 1)",
    "--num-iterations": "each row's iterations follow the budget: use the bench's --budget-nfe (or --budget "
                        "total-forwards --budget-forwards N)",
    "--eval-every": "it evaluates each run at every quarter of its iterations",
    "--output-dir": "use the bench's --output-dir",
    "--prompts-per-iteration": "use the bench's --prompts-per-iteration",
    "--eval-seeds": "use the bench's --eval-seeds",
    "--final-eval-seeds": "use the bench's --final-eval-seeds",
    "--first-eval-seeds": "it evaluates the base model once, in its first run",
    "--checkpoint-every": "it keeps each run's last checkpoint only",
    "--overwrite": "a rerun of the bench keeps its finished runs and starts the others afresh",
    "--resume": "a rerun of the bench keeps its finished runs and starts the others afresh",
}
# two-sided 95 % quantiles of Student's t by degrees of freedom (the normal's 1.96 past 30)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086,
        22: 2.074, 24: 2.064, 26: 2.056, 28: 2.048, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t975(df: float) -> float:
    """The 97.5 % quantile of Student's t with `df` degrees of freedom (rounded down to the table's)."""
    return 1.96 if df > 120 else T975[max(d for d in T975 if d <= max(1, int(df)))]


def interval(values):
    """Mean and the half-width of its 95 % confidence interval over `values` (Student's t)."""
    x = torch.tensor(values, dtype=torch.float64)
    if len(x) < 2:
        return float(x.mean()), float("nan")
    return float(x.mean()), t975(len(x) - 1) * float(x.std()) / len(x) ** 0.5


def gap_interval(values, baseline, paired):
    """The difference of means (values - baseline) and its 95 % half-width: paired on seeds (the same training
    seed gives both runs the same prompts and noise), or Welch's for independent samples."""
    if paired:
        return interval([v - r for v, r in zip(values, baseline)])
    x, y = torch.tensor(values, dtype=torch.float64), torch.tensor(baseline, dtype=torch.float64)
    if min(len(x), len(y)) < 2:
        return float(x.mean() - y.mean()), float("nan")
    vx, vy = float(x.var()) / len(x), float(y.var()) / len(y)
    df = (vx + vy) ** 2 / (vx**2 / (len(x) - 1) + vy**2 / (len(y) - 1)) if vx + vy > 0 else len(x) + len(y) - 2
    return float(x.mean() - y.mean()), t975(df) * (vx + vy) ** 0.5


def part3(args, plan=None):
    """Train every chosen row's runs (those an earlier bench finished are kept), then the table, the plot and the
    results (JSON) of the budget; `plan`: `row_plan(args)`, counted once by main."""
    plan = plan or row_plan(args)
    print(part3_header(args, plan))
    runs, started = bench_runs(args, plan), time.time()
    todo = [run for run in runs if not _finished(*run[2:])]
    print(f"{len(runs)} runs, {len(runs) - len(todo)} already finished in {args.output_dir}; running {len(todo)} "
          f"({args.jobs or 1} at a time, one torch thread each)" if args.jobs else
          f"{len(runs)} runs, {len(runs) - len(todo)} already finished; running {len(todo)} in this process")
    _run_all(todo, args.jobs, kept=len(runs) - len(todo), where=args.output_dir)
    base = _read_curve(runs[0][3])[0]  # (0 NFE, 0 s, success, reward, its standard error, 0 update forwards)
    curves = {name: [] for name in chosen_rows(args)}
    seconds = {name: [] for name in curves}  # each run's, start to end (imports and evaluations too)
    for name, seed, argv, out in runs:
        curves[name].append([base, *_read_curve(out)[1:]])
        seconds[name].append(_run_seconds(out))
    if NO_LEARNING in curves:
        curves[NO_LEARNING] = [[base]] * args.seeds
    table = report(curves, args, seconds)
    print(f"\npart 3 took {(time.time() - started) / 60:.0f} minutes")
    write_results(curves, table, args, plan[1])
    return table


def write_results(curves, table, args, budget):
    """The budget's plot and its results, `RESULTS[args.budget]` .png and .json in the output folder: every run's
    curve ((NFE, wall s, success, reward, s.e., update forwards) at each evaluation) and the table, which
    tools/plot.py draws as a forest plot and learning curves."""
    name = os.path.join(args.output_dir, RESULTS[args.budget])
    _plot(curves, name + ".png", total=args.budget == "total-forwards")
    with open(name + ".json", "w") as f:
        json.dump({"curves": curves, "table": table, "budget": args.budget, "budget_nfe": args.budget_nfe,
                   **({"budget_forwards": budget} if args.budget == "total-forwards" else {}),
                   "seeds": args.seeds}, f)


def part3_header(args, plan):
    """Part 3's title: the budget, and what the runs spend of it (whole iterations, 2 at least a run)."""
    rows, budget = plan
    if args.budget == "total-forwards":
        spent = sorted(iters * total_forwards(nfe, update) for iters, nfe, update in rows.values())
        what = (f"equal total compute (tiny model, {args.seeds} training seeds a method, {budget:,} forwards each: "
                f"rollout NFE + {UPDATE_WEIGHT} x update forwards")
    else:
        spent = sorted(iters * nfe for iters, nfe, update in rows.values())
        what = (f"equal rollout compute (tiny model, {args.seeds} training seeds a method, {budget:,} rollout NFE "
                f"each")
    spend = f"{spent[0]:,.0f}" if round(spent[0]) == round(spent[-1]) else f"{spent[0]:,.0f} to {spent[-1]:,.0f}"
    return f"\n## 3. Held-out success rate at {what}; the runs spend {spend}: whole iterations, 2 at least)\n"


def chosen_rows(args):
    """The table's rows in their order: G2RPO's (every gap's baseline) and those of --methods (all: every row), or by
    default the paper's two claims and the controls; the peers' recipes too under --peers."""
    chosen = list(METHODS) if "all" in args.methods else args.methods or [*HEADLINE, *CONTROLS]
    return [name for name in METHODS if name in (G2RPO_ROW, *chosen) or (args.peers and name in PEERS)]


def base_flags(args):
    """The train.py flags every run of part 3 shares, --extra last."""
    return ["--model", "tiny", "--tiny-cache", args.tiny_cache, "--prompts-per-iteration",
            str(args.prompts_per_iteration), "--checkpoint-every", "100000", "--eval-seeds", str(args.eval_seeds),
            "--final-eval-seeds", str(args.final_eval_seeds), *args.extra]


def total_forwards(nfe, update_nfe):
    """The compute of `nfe` rollout forwards and `update_nfe` update forwards, in forwards: a forward with gradients
    costs about UPDATE_WEIGHT (its forward and a backward of about twice its cost)."""
    return nfe + UPDATE_WEIGHT * update_nfe


def row_plan(args):
    """({row: (iterations, rollout NFE an iteration, update forwards an iteration)} for each row that runs, the
    budget). Each row's costs are counted under its run's flags (`_cost_per_iteration`); its iterations are the most
    that fit the budget, 2 at least: --budget-nfe of rollout NFE, or under --budget total-forwards, --budget-forwards
    of total forwards (by default those G2RPO {1,2,3} spends at --budget-nfe)."""
    costs = {name: _cost_per_iteration([*base_flags(args), *METHODS[name]])
             for name in chosen_rows(args) if name != NO_LEARNING}
    if args.budget != "total-forwards":
        return {name: (max(2, args.budget_nfe // nfe), nfe, update) for name, (nfe, update) in costs.items()}, \
            args.budget_nfe
    nfe, update = costs[G2RPO_ROW]
    budget = args.budget_forwards or round(max(2, args.budget_nfe // nfe) * total_forwards(nfe, update))
    return {name: (max(2, int(budget // total_forwards(nfe, update))), nfe, update)
            for name, (nfe, update) in costs.items()}, budget


def bench_runs(args, plan=None):
    """Part 3's training runs: (row name, seed, train.py flags, output folder) for each chosen row and seed; the
    first is G2RPO's first seed, whose first evaluation is the base model's (no-learning's row needs no run). The
    runs at --budget total-forwards have folders of their own (forwards_...), so the two budgets never mix."""
    rows, _ = plan or row_plan(args)
    prefix = "forwards_" if args.budget == "total-forwards" else ""
    runs = []
    for name, (iters, _, _) in rows.items():
        offset = OTHER_SEEDS if name == "control: G2RPO on other seeds" else 0
        for seed in range(offset, offset + args.seeds):
            slug = "".join(c if c.isalnum() else "_" for c in name).strip("_")
            out = os.path.join(args.output_dir, f"{prefix}{slug}_s{seed}")
            # the base model, where every run starts, is evaluated once, by the first run (the same images for every
            # run); the others evaluate one noise seed a held-out prompt there, where the bench reads nothing
            first = [] if not runs else FIRST_EVAL
            argv = [*base_flags(args), *METHODS[name], "--seed", str(seed), "--num-iterations", str(iters),
                    "--eval-every", str(max(1, iters // 4)), *first, "--output-dir", out]
            runs.append((name, seed, argv, out))
    return runs


def report(curves, args, seconds=None):
    """The table: each method's success rate and reward at the full budget, with 95 % intervals over training
    seeds, and its gaps to G2RPO {1,2,3} with their intervals; a gap is told apart only where its interval excludes
    0. The interval's half-width is the smallest gap this run could tell apart. Beside them each row's compute: the
    rollout NFE it spent, its update's forwards, their total (rollout + 3 x update), its iterations' seconds (wall
    s) and, from `seconds` ({row: each run's seconds, start to end}), a whole run's. The controls' verdicts follow,
    for the success rate and for the reward (the score training maximises), then where each row's values come from."""
    # each run's last point: (nfe, wall, success, reward, se, update forwards)
    final = {name: [run[-1] for run in runs] for name, runs in curves.items()}
    seconds = seconds or {}
    g2rpo = final[G2RPO_ROW]
    print("| method | success (95 % CI) | gap to G2RPO {1,2,3} | told apart | reward (95 % CI) | reward gap | "
          "told apart | eval s.e. | NFE spent | update forwards | total forwards | wall s | s a run |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    table = {}
    ci = lambda m, h, f: f"{m:{f}} ± {h:{f.lstrip('+')}}" if h == h else f"{m:{f}} ± n/a"
    verdict = lambda gap, apart: "n/a" if math.isnan(gap[1]) else "yes" if apart else "no"  # n/a: one seed
    for name, points in final.items():
        paired = name != "control: G2RPO on other seeds"
        row = {"success": interval([p[2] for p in points]), "reward": interval([p[3] for p in points]),
               "eval_se": sum(p[4] for p in points) / len(points), "wall": sum(p[1] for p in points) / len(points),
               "nfe": sum(p[0] for p in points) / len(points),
               "update_nfe": sum(p[5] for p in points) / len(points),
               "total_forwards": sum(total_forwards(p[0], p[5]) for p in points) / len(points),
               "run_s": _mean([s for s in seconds.get(name, []) if s is not None]), "values_from": values_from(name)}
        if name != G2RPO_ROW:
            row["gap"] = gap_interval([p[2] for p in points], [p[2] for p in g2rpo], paired)
            row["reward_gap"] = gap_interval([p[3] for p in points], [p[3] for p in g2rpo], paired)
            row["told_apart"] = abs(row["gap"][0]) > row["gap"][1]  # False when the interval is nan
            row["reward_told_apart"] = abs(row["reward_gap"][0]) > row["reward_gap"][1]
        table[name] = row
        cells = ["-"] * 4 if name == G2RPO_ROW else [
            ci(*row["gap"], "+.3f"), verdict(row["gap"], row["told_apart"]), ci(*row["reward_gap"], "+.4f"),
            verdict(row["reward_gap"], row["reward_told_apart"])]
        run_s = "n/a" if math.isnan(row["run_s"]) else f"{row['run_s']:.0f}"  # n/a: no marker kept its seconds
        print(f"| {name} | {ci(*row['success'], '.3f')} | {cells[0]} | {cells[1]} | {ci(*row['reward'], '.4f')} | "
              f"{cells[2]} | {cells[3]} | {row['eval_se']:.3f} | {row['nfe']:,.0f} | {row['update_nfe']:,.0f} | "
              f"{row['total_forwards']:,.0f} | {row['wall']:.0f} | {run_s} |")
    start = curves[G2RPO_ROW][0][0]
    print(f"\nEvery method starts at a held-out success rate of {start[2]:.3f} and a reward of {start[3]:.4f}. A "
          f"gap's ± is the half-width of its 95 % interval (paired on training seeds; Welch's for the other-seeds "
          f"control): the smallest gap this run could tell apart. Total forwards: rollout NFE + {UPDATE_WEIGHT} x "
          f"update forwards (a forward with gradients costs about {UPDATE_WEIGHT}). The verdicts (success rate; "
          f"reward):")
    verdicts(table, args)
    needed = {n: seeds_for(table[n]["gap"][1], args.seeds) for n in table if "gap" in table[n]}
    if any(needed.values()):
        print("- training seeds a gap would need for a success half-width of 0.05, from this spread: "
              + ", ".join(f"{n} {k}" for n, k in needed.items() if k))
    measured = [s for runs in seconds.values() for s in runs if s is not None]
    if measured:
        print(f"- this table's {len(measured)} runs took {sum(measured) / 3600:.1f} hours of one core each: "
              f"{sum(measured) / 3600 / max(args.jobs, 1):.1f} hours at --jobs {max(args.jobs, 1)}, "
              f"about {sum(measured) / 3600 / 16:.1f} at --jobs 16 on 16 cores (a run's time as here)")
    print("\n| method | values from |\n|---|---|")
    for name, row in table.items():
        print(f"| {name} | {row['values_from']} |")
    return table


def verdicts(table, args):
    """The controls' verdicts, then the headline rows' half-widths. A gap without an interval (one training seed)
    judges nothing: its control is said to be unjudged, never failed."""
    said = lambda row, key: "told apart" if row[key] else "not told apart"
    unjudged = lambda row: math.isnan(row["gap"][1]) or math.isnan(row["reward_gap"][1])
    cannot = (f"cannot be judged at {args.seeds} training seed{'s' if args.seeds != 1 else ''}: a gap needs 2 or "
              f"more for its interval (--seeds)")
    for name, verdict in [("control: G2RPO on other seeds", False), (NO_LEARNING, True)]:
        if name in table:
            row = table[name]
            if unjudged(row):
                print(f"- {name}: {cannot}")
                continue
            fails = [metric for metric, key in (("success", "told_apart"), ("reward", "reward_told_apart"))
                     if row[key] != verdict]
            print(f"- {name}: {said(row, 'told_apart')}; {said(row, 'reward_told_apart')}"
                  + (f" (THE BENCH FAILS THIS CONTROL ON {' AND '.join(fails).upper()})" if fails else ""))
    credit = table.get("control: step credit destroyed")
    if credit and unjudged(credit):
        print(f"- control: step credit destroyed: {cannot}")
    elif credit:
        shown = [metric for metric, key, gap in (("success", "told_apart", "gap"), ("reward", "reward_told_apart",
                                                                                  "reward_gap"))
                 if credit[key] and credit[gap][0] < 0]
        print(f"- control: step credit destroyed: {said(credit, 'told_apart')}; {said(credit, 'reward_told_apart')}: "
              + (f"on its {' and '.join(shown)} this world rewards G2RPO's per-step credit" if shown else
                 "at this budget this world cannot test the per-step credit assignment"))
    widths = {n: table[n]["gap"][1] for n in ("full SDE, same M", "G2RPO {1}") if n in table}
    if widths and any(math.isnan(w) for w in widths.values()):
        print(f"- headline half-widths in success: none ({cannot})")
    elif widths:  # (a run of chosen --methods may have none)
        print("- headline half-widths in success: " + ", ".join(f"{n} {w:.3f}" for n, w in widths.items())
              + (" (all <= 0.05)" if all(w <= 0.05 for w in widths.values()) else " (above the 0.05 target)"))


def _mean(values):
    return sum(values) / len(values) if values else float("nan")


def seeds_for(half_width, seeds, target=0.05):
    """Training seeds a gap's interval would need for a half-width of `target`, from its half-width at `seeds`
    (the spread of the paired differences kept; Student's t at the new count), or None where it is met or unknown."""
    if not half_width == half_width or half_width <= target or seeds < 2:
        return None
    sd = half_width * seeds**0.5 / t975(seeds - 1)  # the paired differences' standard deviation
    n = seeds
    while t975(n - 1) * sd / n**0.5 > target:
        n += 1
    return n


def values_from(name):
    """Where a row's tiny values come from: its method's authors, or whom its `values_from` names (its recipe; every
    flag of its own at their default), those this project sets for the tiny world's 8 steps (its tiny preset), and
    every other value the tiny preset's, G2RPO's (G 8, N 8, lr 1e-4, clip 1e-3); the row's own flags last."""
    argv = METHODS[name]
    method = flags.parse_args(["--model", "tiny", *argv]).method
    rest = [a for a in argv if a not in ("--method", method)]
    cls = METHOD_CLASSES[method]
    said = lambda values: ", ".join(f"{k} {v}" for k, v in values.items())
    if method == DEFAULT_METHOD:
        parts = ["G2RPO's tiny preset"]
    else:
        parts = [f"{cls.values_from} ({said(cls.recipe) + ', ' if cls.recipe else ''}its own flags' defaults)"]
        if cls.presets.get("tiny"):
            parts.append(f"set here for 8 steps ({said(cls.presets['tiny'])})")
        parts.append("the rest G2RPO's tiny preset")
    return "; ".join(parts) + (f"; {' '.join(rest)}" if rest else "")


def _finished(argv, out):
    """Whether `out` holds this run, complete: its marker names the same command (a killed bench resumes there), up
    to the size of the first evaluation, which does not change the training (runs of an older bench count)."""
    try:
        with open(os.path.join(out, "bench_run.json")) as f:
            return _training_flags(json.load(f)["argv"]) == _training_flags(argv) and _complete(argv, out)
    except (OSError, ValueError, KeyError, TypeError):  # no marker, a damaged one: run it again
        return False


def _metrics_rows(out):
    """The rows of the run's metrics.jsonl, or None where it is missing or a line is not a JSON object (cut short by
    a kill, or damaged anywhere in the file): the run is then unfinished and runs again."""
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return None
    return rows if all(isinstance(row, dict) for row in rows) else None


def _complete(argv, out):
    """Whether the run in `out` reached its last iteration, every line of its metrics readable: train.py exits 0 from
    a graceful stop too, short of it."""
    rows = _metrics_rows(out)
    return bool(rows) and rows[-1].get("iteration") == flags.parse_args(argv).num_iterations


def _training_flags(argv):
    """A run's flags without FIRST_EVAL."""
    for i in range(len(argv) - 1):
        if argv[i : i + 2] == FIRST_EVAL:
            return argv[:i] + argv[i + 2 :]
    return argv


class _Stop:
    """The bench's stop on SIGINT or SIGTERM. After the first, no run starts; each signal is passed on to the runs in
    flight, which run in sessions of their own so that a terminal's Ctrl-C reaches them once, through here: the first
    makes them save and stop, a second abort. In this process (jobs 0) it interrupts the run as a KeyboardInterrupt
    wherever the run does not catch the signal itself."""

    def __init__(self, in_process):
        self.signum, self.in_process, self.procs, self.lock = None, in_process, set(), threading.RLock()

    def on_signal(self, signum, frame):
        with self.lock:  # (a worker holds it only while it starts a run)
            self.signum = self.signum or signum
            for proc in self.procs:
                proc.send_signal(signum)
        if self.in_process:
            raise KeyboardInterrupt

    def start(self, command, env):
        """The run's process, or None once a stop was asked."""
        with self.lock:
            if self.signum is not None:
                return None
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                    start_new_session=True)
            self.procs.add(proc)
            return proc

    def forget(self, proc):
        with self.lock:
            self.procs.discard(proc)


def _run_all(todo, jobs, kept=0, where="."):
    """Each run to its end, then its marker (its command and seconds): `jobs` subprocesses side by side, one torch
    thread each, so a result does not depend on how many runs share the machine; jobs 0: one after another in this
    process. On SIGINT or SIGTERM (`_Stop`) the runs in flight save and stop, no other starts, and one line says what
    is kept (`kept`: finished by an earlier bench, in `where`) and how to go on; the bench exits 130."""
    stop = _Stop(in_process=not jobs)
    previous = {s: signal.signal(s, stop.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        outcomes = _run_side_by_side(todo, jobs, stop) if jobs else _run_in_process(todo)
    finally:  # (a run in this process that stopped on a signal leaves its own handlers)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stop.signum is not None or "stopped" in outcomes:
        by = signal.Signals(stop.signum).name if stop.signum else "a signal"
        done, stopped = kept + outcomes.count("done"), outcomes.count("stopped")
        print(f"stopped by {by}: {done} of {kept + len(todo)} runs are finished and kept in {where} ({stopped} "
              f"stopped in flight, {kept + len(todo) - done - stopped} not started); rerun the same command to run "
              f"the rest", file=sys.stderr, flush=True)
        raise SystemExit(130)


def _run_side_by_side(todo, jobs, stop):
    """The runs as `jobs` subprocesses side by side; returns each started run's outcome ('done', 'stopped') or
    raises the first failure (a failure while stopping is the stop's)."""
    from concurrent.futures import ThreadPoolExecutor, wait

    with ThreadPoolExecutor(jobs) as pool:
        futures = [pool.submit(_run_subprocess, run, stop) for run in todo]
        wait(futures)  # (a signal's handler runs while it waits)
    failures = [f.exception() for f in futures if f.exception() is not None]
    if failures and stop.signum is None:
        raise failures[0]
    return [f.result() for f in futures if f.exception() is None and f.result() is not None]


def _run_subprocess(run, stop):
    """One run in a train.py subprocess (None: never started, a stop came first); a run cut short starts again."""
    name, seed, argv, out = run
    started = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = stop.start(_train_command([*argv, "--overwrite"]), env)
    if proc is None:
        return None
    stdout, stderr = proc.communicate()
    stop.forget(proc)
    if not (proc.returncode == 0 and _complete(argv, out)) and stop.signum is not None:
        return "stopped"
    if proc.returncode < 0:  # its output ends in progress bars: its signal says more
        raise SystemExit(f"error: {name} seed {seed} was {_killed_by(-proc.returncode)}; rerun the same command to "
                         f"run it again (finished runs are kept)")
    if proc.returncode:
        raise SystemExit(f"error: {name} seed {seed} failed:\n{stdout[-2000:]}{stderr[-3000:]}")
    if not _complete(argv, out):  # stopped by a signal: its folder is kept for nothing, and never reported
        raise SystemExit(f"error: {name} seed {seed} stopped before its last iteration; rerun the same command to "
                         f"continue (finished runs are kept)")
    _mark_finished(run, started)
    return "done"


def _run_in_process(todo):
    """The runs one after another in this process; returns their outcomes, the last 'stopped' where a signal came."""
    outcomes = []
    for run in todo:
        name, seed, argv, out = run
        started = time.time()
        try:
            status = _train([*argv, "--overwrite"])
        except KeyboardInterrupt:  # a signal before the run caught it itself (imports, loading)
            return [*outcomes, "stopped"]
        if not _complete(argv, out):
            if status == 0:  # its own graceful stop on a signal, its checkpoint saved
                return [*outcomes, "stopped"]
            raise SystemExit(f"error: {name} seed {seed} stopped before its last iteration; rerun the same command "
                             f"to continue (finished runs are kept)")
        _mark_finished(run, started)
        outcomes.append("done")
    return outcomes


def _train_command(argv):
    """The command line of one train.py run."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
    return [sys.executable, os.path.join(root, "train.py"), *argv]


def _killed_by(signum):
    """'killed by signal 9 (SIGKILL: out of memory?)': how a process ended by a signal is reported."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        return f"killed by signal {signum}"
    return f"killed by signal {signum} ({name}{': out of memory?' if signum == signal.SIGKILL else ''})"


def _mark_finished(run, started):
    """A finished run's marker: its command and its seconds from `started` to now."""
    name, seed, argv, out = run
    with open(os.path.join(out, "bench_run.json"), "w") as f:
        json.dump({"argv": argv, "seconds": time.time() - started}, f)
    print(f"  done: {name}, seed {seed}", flush=True)


def _run_seconds(out):
    """A finished run's seconds from its start to its end, from its marker (None for a marker without them)."""
    with open(os.path.join(out, "bench_run.json")) as f:
        return json.load(f).get("seconds")


def _read_curve(out):
    """(cumulative rollout NFE, cumulative wall s, success, reward, success s.e., cumulative update forwards) at each
    evaluation of a finished run."""
    nfe, wall, update, points = 0, 0.0, 0, []
    for row in _metrics_rows(out) or []:
        r = {RENAMED.get(k, k): v for k, v in row.items()}  # (a run of an earlier version)
        nfe += r.get("perf/nfe", 0)
        wall += r.get("time/iteration", 0.0)
        update += r.get("perf/update_nfe", 0)
        if "eval/heldout/shapes-strict" in r:
            points.append((nfe, wall, r["eval/heldout/shapes-strict"], r["eval/reward/shapes"],
                           r.get("eval/heldout_se/shapes-strict", float("nan")), update))
    return points


def _train(argv):
    """One train.py run in this process, its output kept quiet unless it fails; returns train.main's status (None:
    finished, 0: stopped by a signal, its checkpoint saved)."""
    import contextlib
    import io

    import train

    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            return train.main(train.parse_args(argv))
    except SystemExit:
        print(log.getvalue()[-3000:], file=sys.stderr)
        raise


def _cost_per_iteration(argv):
    """(rollout NFE, update forwards) of one iteration of train.py with these flags (a run's, --extra included),
    counted without training: the rollout of a zero velocity with the prompt pool's anchors, and the method's
    `update_nfe` on it; each the mean over the method's `cost_iterations` (one cycle of a sliding window, or 64
    random draws of one), the NFE rounded down."""
    a = flags.parse_args(argv)
    method = flags.method_of(a)
    pool = method.anchor_candidates * a.num_steps * (a.prompts_per_iteration or 1)  # the prompt pool's anchors
    rollouts = [zero_rollout(a, it) for it in method.cost_iterations()]
    update = sum(method.update_nfe(rollout) for rollout in rollouts) / len(rollouts)
    return sum(rollout.nfe + pool for rollout in rollouts) // len(rollouts), update


def _nfe_per_iteration(argv):
    """Rollout NFE of one iteration of train.py with these flags (`_cost_per_iteration`'s first)."""
    return _cost_per_iteration(argv)[0]


def _plot(curves, path, total=False):
    """Each row's held-out success rate against its cumulative rollout NFE (`total`: its total forwards, rollout +
    3 x update) and against its wall seconds, every seed faint and their mean bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    compute = (lambda point: total_forwards(point[0], point[5])) if total else (lambda point: point[0])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for (name, runs), colour in zip(curves.items(), [plt.cm.tab20(i % 20) for i in range(len(curves))]):
        style = "--" if name.startswith("control") else "-"
        if name == NO_LEARNING:  # the base model, whatever the compute
            for ax in axes:
                ax.axhline(runs[0][0][2], linestyle=style, color=colour, linewidth=2, label=name)
            continue
        for run in runs:  # every seed, faint
            axes[0].plot([compute(p) for p in run], [p[2] for p in run], color=colour, alpha=0.15)
            axes[1].plot([p[1] for p in run], [p[2] for p in run], color=colour, alpha=0.15)
        # the mean over seeds at each evaluation (the seeds of a method evaluate at the same compute)
        mean = torch.tensor([[(compute(p), p[1], p[2]) for p in run] for run in runs], dtype=torch.float64).mean(0)
        axes[0].plot(mean[:, 0], mean[:, 2], style, color=colour, linewidth=2, marker="o", markersize=3, label=name)
        axes[1].plot(mean[:, 1], mean[:, 2], style, color=colour, linewidth=2, marker="o", markersize=3, label=name)
    axes[0].xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x / 1000:.0f}k"))
    axes[0].set_xlabel(f"cumulative total forwards (rollout + {UPDATE_WEIGHT} x update)" if total else
                       "cumulative rollout NFE")
    axes[1].set_xlabel("cumulative wall time (s)")
    for ax in axes:
        ax.set_ylabel("held-out success rate")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


def check(args: Args):
    """The bench's own flags, --methods and --extra, each a one-line error (exit 2) before anything runs."""
    problem = next((message for bad, message in [
        (not args.parts or not set(args.parts) <= {1, 2, 3}, f"--parts {args.parts}: choose among 1 2 3"),
        (args.seeds < 1, f"--seeds {args.seeds}: use 1 or more"),
        (args.jobs < 0, f"--jobs {args.jobs}: use 0 (one at a time in this process) or more"),
        (args.budget_nfe < 2 * 8 * 8 * 8, f"--budget-nfe {args.budget_nfe}: too small for two iterations of any "
                                          f"row; use at least 1024 (the default 80,000)"),
        (args.budget not in RESULTS, f"--budget {args.budget}: choose rollout-nfe (equal rollout NFE, the default) "
                                     f"or total-forwards (equal rollout NFE + {UPDATE_WEIGHT} x update forwards)"),
        (args.budget_forwards < 0, f"--budget-forwards {args.budget_forwards}: use 0 (what G2RPO {{1,2,3}} spends "
                                   f"at --budget-nfe) or more"),
        (args.budget_forwards > 0 and args.budget != "total-forwards",
         f"--budget-forwards {args.budget_forwards} is the budget of --budget total-forwards; add --budget "
         f"total-forwards, or drop --budget-forwards"),
        (min(args.eval_seeds, args.final_eval_seeds, args.prompts_per_iteration, args.speed_group_size - 1) < 1,
         "--eval-seeds, --final-eval-seeds and --prompts-per-iteration must be >= 1, --speed-group-size >= 2"),
        (os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir),
         f"--output-dir '{args.output_dir}' is a file; pass a folder"),
    ] if bad), None) or methods_problem(args) or extra_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)


def methods_problem(args):
    """--methods naming a row the table has not, as a message (None where every name is a row, or all)."""
    unknown = [name for name in args.methods if name not in METHODS and name != "all"]
    if unknown:
        return (f"--methods {', '.join(map(repr, unknown))}: no such row; choose from {', '.join(map(repr, METHODS))}, "
                f"or all")
    return None


def extra_problem(args):
    """The first --extra flag that the bench sets on the runs itself, as a message naming the bench's flag for it, or
    the row whose own flag it is (a flag given there would be overridden, or refused as given twice); None where
    every one is free to add."""
    own = {}  # each flag that a row which runs sets itself: the row
    for name in chosen_rows(args):
        for word in METHODS[name] if name != NO_LEARNING else []:  # (no-learning's row never runs)
            if word.startswith("--"):
                own.setdefault(word, name)
    for word in args.extra:
        name = _flag_name(word)
        if name in SET_BY_BENCH:
            return f"--extra {word.split('=', 1)[0]}: the bench sets it on every run; {SET_BY_BENCH[name]}"
        if name in own:
            return (f"--extra {word.split('=', 1)[0]}: the row '{own[name]}' sets it itself "
                    f"({' '.join(METHODS[own[name]])}); leave it out of --extra, or that row out of --methods")
    return None


def _flag_name(word):
    """A command-line word's flag as train.py spells it in its help ('--num_iterations=9' -> '--num-iterations',
    tyro's '--no-overwrite' -> '--overwrite'), or None for a value."""
    if not word.startswith("--"):
        return None
    name = word.split("=", 1)[0][2:].replace("_", "-")
    return "--" + (name[3:] if name.startswith("no-") else name)


def apply_quick(args):
    """--quick's settings, put in place of the flags they replace; returns the line that says so."""
    args.seeds, args.budget_nfe, args.jobs, args.eval_seeds, args.final_eval_seeds = 2, 128, 0, 1, 1
    args.speed_group_size = 4
    args.prompts_per_iteration, args.extra = 2, ("--eval-prompts", "4", "--group-size", "4", *args.extra)
    args.output_dir = os.path.join(args.output_dir, "quick")
    return ("--quick sets, in place of any given: --seeds 2, --jobs 0 (one run at a time in this process), "
            "--budget-nfe 128 (every row at its floor of 2 iterations), --eval-seeds 1, --final-eval-seeds 1, "
            "--prompts-per-iteration 2, --speed-group-size 4, and in every run --eval-prompts 4 --group-size 4; its "
            f"runs go to {args.output_dir}")


def main(args: Args):
    check(args)
    said = apply_quick(args) if args.quick else None
    plan = row_plan(args) if 3 in args.parts else None  # every run's flags parsed: a bad --extra stops here
    os.makedirs(args.output_dir, exist_ok=True)
    print(f"# bench.py on {os.uname().machine}, {os.cpu_count()} CPU cores, torch {torch.__version__}"
          + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
    if said:
        print(said)
    out = {}
    if 1 in args.parts:
        out["rollout_cost"] = part1()
    if 2 in args.parts:
        out["speed"] = part2(args)
    if 3 in args.parts:
        out["learning"] = part3(args, plan)
    return out


def parse(argv) -> Args:
    """The command line. `--extra --max-batch 64`, as its help shows it: tyro would take a value starting with -- for a
    flag, so --extra's values (up to the next flag of the bench's own) are gathered here and handed over as one. A
    repeated --extra adds its values to the earlier ones (`--extra --lr 0 --extra --max-batch 64` passes both)."""
    extra, rest, i = [], [], 0
    while i < len(argv):
        name, _, value = argv[i].partition("=")
        if name != "--extra":
            rest.append(argv[i])
            i += 1
            continue
        end = next((j for j in range(i + 1, len(argv)) if argv[j].startswith("--") and
                    argv[j].partition("=")[0][2:].replace("-", "_") in Args.__dataclass_fields__), len(argv))
        extra += ([value] if "=" in argv[i] else []) + argv[i + 1 : end]
        i = end
    return tyro.cli(Args, args=rest, default=Args(extra=tuple(extra)))


if __name__ == "__main__":
    try:
        main(parse(sys.argv[1:]))
    except KeyboardInterrupt:  # a Ctrl-C outside part 3's runs (imports, parts 1 and 2): one line, no traceback
        print("\ninterrupted; part 3's finished runs are kept: rerun the same command to go on", file=sys.stderr)
        raise SystemExit(130)
