"""What G2RPO costs and what it buys, measured side by side.

  1. Rollout cost: image-forwards (NFE) and transformer calls per prompt per iteration, counted by running the
     rollouts with a counting velocity function: this project's G2RPO rollout, the reference code's structure
     (same math, every forward at batch 1, the SDE-step forward recomputed per member), and full-SDE sampling.
  2. Speed on the tiny model, same machine, same run: seconds per iteration split into sampling, decoding,
     reward and update, batched (this project) against a batch-1 loop with the reference's structure.
  3. Learning per unit of compute on the tiny model: held-out success rate against cumulative NFE and wall time for
     G2RPO (granularities {1, 2, 3}), G2RPO without multi-granularity ({1}), the full-SDE baseline, mixed
     ODE-SDE sampling in a sliding window, and G2RPO and full SDE with a KL term, at equal NFE budgets, over seeds;
     a table (with each method's gap to G2RPO in seed standard deviations) and a PNG plot.
The GPU figures (FLUX.1-dev-sized transformer, seconds per phase, TFLOP/s) come from gpu_check.py.

Run:  python bench.py            (parts 1-3, CPU)
      python bench.py --quick    (every part, shortened, under 2 minutes)
"""
import json
import os
import sys
import time
from dataclasses import dataclass
import torch
import tyro

import flags
from sampler import rollout_full_sde, rollout_g2rpo, rollout_g2rpo_reference, rollout_mixed, sigma_schedule



@dataclass
class Args:
    quick: bool = False
    """A shortened run of every part (what the tests run)."""
    parts: tuple[int, ...] = (1, 2, 3)
    """Which parts to run."""
    seeds: int = 5
    """Training seeds per method in part 3."""
    budget_nfe: int = 40_000
    """Part 3: image-forwards each method may spend on rollouts (equal for all)."""
    output_dir: str = "runs/bench"
    """Where part 3's runs, its table (JSON) and plot go."""
    tiny_cache: str = ".cache"
    """The tiny model's cache (see train.py --tiny-cache)."""


def zero_velocity(x, sigma, idx):
    return torch.zeros_like(x)


def part1():
    print("\n## 1. Rollout cost per prompt per iteration (NFE = one transformer forward on one image)\n")
    print("| method | settings | sampling NFE | transformer calls | training forwards |")
    print("|---|---|---|---|---|")
    rows = []
    for grans in ([1, 2], [1, 2, 3], [1]):
        sigmas, gens = sigma_schedule(16, 3.0), [torch.Generator().manual_seed(0)]
        kw = dict(group_size=12, sde_steps=list(range(8)), granularities=grans, eta=0.7)
        ours = rollout_g2rpo(zero_velocity, torch.zeros(1, 4), sigmas, gens, **kw, max_batch=4096)
        ref = rollout_g2rpo_reference(zero_velocity, torch.zeros(1, 4), sigmas, [torch.Generator().manual_seed(0)],
                                      **kw)
        label = f"G 12, N 16, M 0..7, Lambda {set(grans)}"
        rows.append(("G2RPO reference code", label, ref.nfe, ref.calls, 8))
        rows.append(("G2RPO, this project", label, ours.nfe, ours.calls, 8))
    rows += [recipe_cost(method) for method in flags.METHODS if method != "g2rpo"]
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:,} | {r[3]:,} | {r[4]} |")
    return rows


def recipe_cost(method):
    """One row of part 1: `--model flux --method method` at its own defaults, rolled out by train.py's code (a
    zero velocity), its first iteration's window for the mixed samplers. Training forwards: one per start latent
    and trained step (G2RPO's members share theirs; a trajectory's member has its own)."""
    import train

    a = flags.parse_args(["--model", "flux", "--method", method])
    gens = [torch.Generator().manual_seed(0)]
    noise = torch.zeros(1, 4) if a.same_noise else torch.zeros(1, a.group_size, 4)
    a.max_batch = 4096
    steps = train.trained_steps(a, 0)
    rollout = train.roll_out(a, zero_velocity, noise, sigma_schedule(a.num_steps, a.shift), gens, steps)
    per_member = int(a.timestep_fraction * len(steps))
    forwards = len(steps) if a.sampling == "g2rpo" else a.group_size * per_member
    if a.sampling == "mixed":
        label = f"G {a.group_size}, N {a.num_steps}, window {a.window_size} ({a.window_schedule})"
    else:
        label = f"G {a.group_size}, N {a.num_steps}, {per_member} of steps 0..{max(steps)} trained a member"
    return (f"--method {method}", label, rollout.nfe, rollout.calls, forwards)


# ---------------------------------------------------------------------------------------------------------------
# part 2: speed on the tiny model
# ---------------------------------------------------------------------------------------------------------------
def load_tiny(cache):
    import tiny
    from models import FluxAdapter

    path = tiny.ensure_pretrained(cache, log=lambda *a: None)
    return FluxAdapter.load(path, "cpu", torch.float32, guidance=3.5, max_sequence_length=16)


def part2(args):
    import tiny
    from advantage import granular_advantages
    from g2rpo import g2rpo_update

    adapter = load_tiny(args.tiny_cache)
    B, G, res = 1, 12, tiny.RESOLUTION
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
            plain = rollout_g2rpo_reference(velocity, noise, sigmas, gens, **kw)
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
        update = dict(eta=0.7, clip_range=1e-4, max_grad_norm=1.0)
        if mode == "batched":
            g2rpo_update(velocity, params, optimizer, rollout, advantages, sigmas, **update)
        else:  # the reference trains member by member: one batch-1 forward per member and step
            g2rpo_update(velocity, params, optimizer, _per_member(rollout), advantages, sigmas, **update, max_batch=1)
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
    import dataclasses

    G = rollout.next_latents.shape[2]
    return dataclasses.replace(rollout, latents=rollout.latents.expand(-1, -1, G, *rollout.latents.shape[3:]))


# ---------------------------------------------------------------------------------------------------------------
# part 3: learning per unit of compute
# ---------------------------------------------------------------------------------------------------------------
FULL = ["--sampling", "full", "--sde-steps", "0", "1", "2", "3", "4", "5", "6", "7"]
KL = ["--kl-beta", "0.01"]
METHODS = {
    "G2RPO {1,2,3}": ["--sampling", "g2rpo", "--granularities", "1", "2", "3"],
    "G2RPO {1}": ["--sampling", "g2rpo", "--granularities", "1"],
    "full SDE": FULL,
    "mixed window": ["--sampling", "mixed", "--window-size", "2", "--window-stride", "1", "--window-every", "4"],
    "G2RPO {1,2,3} + KL": ["--sampling", "g2rpo", "--granularities", "1", "2", "3", *KL],
    "full SDE + KL": [*FULL, *KL],
}


def part3(args):
    print(f"\n## 3. Held-out success rate at equal rollout compute (tiny model, {args.seeds} seeds each)\n")
    # 12 held-out prompts x 8 noise seeds: 96 images an evaluation, so a success rate moves in steps of 0.01
    base = ["--model", "tiny", "--tiny-cache", args.tiny_cache, "--prompts-per-iteration", "4", "--overwrite",
            "--checkpoint-every", "100000", "--eval-seeds", "8"]
    curves, started = {}, time.time()
    for name, flags in METHODS.items():
        # rollout NFE per iteration of this method, counted, sets its iteration count for the shared budget
        per_iter = _nfe_per_iteration(flags)
        iters = max(2, args.budget_nfe // per_iter)
        for seed in range(args.seeds):
            out = os.path.join(args.output_dir, f"{name.replace(' ', '_').replace('{', '').replace('}', '')}_s{seed}")
            _train([*base, *flags, "--seed", str(seed), "--num-iterations", str(iters),
                    "--eval-every", str(max(1, iters // 4)), "--output-dir", out])
            rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
            nfe, wall, points = 0, 0.0, []
            for r in rows:
                nfe += r.get("perf/nfe", 0)
                wall += r.get("time/iteration", 0.0)
                if "eval/success/shapes" in r:
                    points.append((nfe, wall, r["eval/success/shapes"], r["eval/reward/shapes"]))
            curves.setdefault(name, []).append(points)
    fractions = (0.25, 0.5, 1.0)
    print("| method | " + " | ".join(f"success at {int(f * 100)} % of {args.budget_nfe:,} NFE" for f in fractions)
          + " | reward at 100 % | gap to G2RPO {1,2,3}: success, reward (seed stds) | wall s |")
    print("|---|" + "---|" * (len(fractions) + 3))
    table, reference = {}, next(iter(curves))
    mean_std = lambda values: (float(values.mean()), float(values.std()) if len(values) > 1 else 0.0)
    for name, runs in curves.items():
        cells = [mean_std(torch.tensor([_interp(run, f * args.budget_nfe) for run in runs])) for f in fractions]
        table[name] = {"cells": cells, "reward": mean_std(torch.tensor([run[-1][3] for run in runs])),
                       "wall": sum(run[-1][1] for run in runs) / len(runs)}
    for name, row in table.items():
        # the gap at the full budget over the pooled seed standard deviation of the two methods (a z-like score)
        gaps = []
        for (mean, std), (ref_mean, ref_std) in [(row["cells"][-1], table[reference]["cells"][-1]),
                                                 (row["reward"], table[reference]["reward"])]:
            pooled = ((std**2 + ref_std**2) / 2) ** 0.5
            gaps.append((mean - ref_mean) / pooled if pooled > 0 else float("nan"))  # nan: one seed, no spread
        row["gap_in_stds"] = {k: g if g == g else None for k, g in zip(("success", "reward"), gaps)}
        gap = "-" if name == reference else ", ".join("n/a" if g != g else f"{g:+.1f}" for g in gaps)
        print(f"| {name} | " + " | ".join(f"{m:.3f} ± {s:.3f}" for m, s in row["cells"])
              + f" | {row['reward'][0]:.4f} ± {row['reward'][1]:.4f} | {gap} | {row['wall']:.0f} |")
    start = curves[reference][0][0][2]
    best = max(table, key=lambda n: table[n]["cells"][-1][0])
    print(f"\nat the full budget the highest held-out success rate is {best} ({table[best]['cells'][-1][0]:.3f}; "
          f"all start at {start:.3f}); part 3 took {(time.time() - started) / 60:.0f} minutes")
    _plot(curves, os.path.join(args.output_dir, "learning_per_compute.png"))
    with open(os.path.join(args.output_dir, "learning_per_compute.json"), "w") as f:
        json.dump({"curves": curves, "table": table}, f)
    return table


def _train(argv):
    """One train.py run in this process, its output kept quiet unless it fails."""
    import contextlib
    import io

    import train

    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            train.main(train.parse_args(argv))
    except SystemExit:
        print(log.getvalue()[-3000:], file=sys.stderr)
        raise


def _nfe_per_iteration(flags):
    """Rollout NFE of one iteration of train.py with these flags, counted (the mixed sampler: its mean over a
    sweep of its window's positions)."""
    import train

    a = train.parse_args(["--model", "tiny", "--prompts-per-iteration", "4", *flags])
    sigmas, gens = sigma_schedule(a.num_steps, a.shift), [torch.Generator() for _ in range(4)]
    kw = dict(group_size=a.group_size, eta=a.eta, max_batch=10**6)
    if a.sampling == "g2rpo":
        return rollout_g2rpo(zero_velocity, torch.zeros(4, 1), sigmas, gens, sde_steps=a.sde_steps,
                             granularities=a.granularities, **kw).nfe
    if a.sampling == "full":
        return rollout_full_sde(zero_velocity, torch.zeros(4, 1), sigmas, gens, sde_steps=a.sde_steps, **kw).nfe
    sweep = range(0, a.window_every * (a.num_steps - a.window_size + 1), a.window_every)
    counts = [rollout_mixed(zero_velocity, torch.zeros(4, 1), sigmas, gens, sde_steps=train.trained_steps(a, it),
                            **kw).nfe for it in sweep]
    return sum(counts) // len(counts)


def _interp(points, nfe):
    """Eval success at `nfe` by linear interpolation between evaluations (the last value past the end)."""
    for (n0, _, r0, _), (n1, _, r1, _) in zip(points, points[1:]):
        if n0 <= nfe <= n1:
            return r0 + (r1 - r0) * (nfe - n0) / max(1, n1 - n0)
    return points[-1][2]


def _plot(curves, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for (name, runs), colour in zip(curves.items(), [f"C{i}" for i in range(len(curves))]):
        for run in runs:  # every seed, faint
            nfe, wall, success, _ = zip(*run)
            axes[0].plot(nfe, success, color=colour, alpha=0.15)
            axes[1].plot(wall, success, color=colour, alpha=0.15)
        # the mean over seeds at each evaluation (the seeds of a method evaluate at the same NFE)
        mean = torch.tensor([[point[:3] for point in run] for run in runs], dtype=torch.float64).mean(0)
        axes[0].plot(mean[:, 0], mean[:, 2], color=colour, linewidth=2, marker="o", markersize=3, label=name)
        axes[1].plot(mean[:, 1], mean[:, 2], color=colour, linewidth=2, marker="o", markersize=3, label=name)
    axes[0].xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x / 1000:.0f}k"))
    axes[0].set_xlabel("cumulative rollout NFE")
    axes[1].set_xlabel("cumulative wall time (s)")
    for ax in axes:
        ax.set_ylabel("held-out success rate")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(args: Args):
    if args.quick:
        args.seeds, args.budget_nfe = 1, 1_000
        args.output_dir = os.path.join(args.output_dir, "quick")
    os.makedirs(args.output_dir, exist_ok=True)
    print(f"# bench.py on {os.uname().machine}, {os.cpu_count()} CPU cores, torch {torch.__version__}"
          + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
    out = {}
    if 1 in args.parts:
        out["rollout_cost"] = part1()
    if 2 in args.parts:
        out["speed"] = part2(args)
    if 3 in args.parts:
        out["learning"] = part3(args)
    return out


if __name__ == "__main__":
    main(tyro.cli(Args))
