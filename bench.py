"""What G2RPO costs and what it buys, measured side by side.

  1. Rollout cost: image-forwards (NFE) and transformer calls per prompt per iteration, counted by running the
     rollouts with a counting velocity function: this project's G2RPO rollout, the reference code's structure
     (same math, every forward at batch 1, the SDE-step forward recomputed per member), and full-SDE sampling.
  2. Speed on the tiny model, same machine, same run: seconds per iteration split into sampling, decoding,
     reward and update, batched (this project) against a batch-1 loop with the reference's structure.
  3. Learning per unit of compute on the tiny model: held-out eval reward against cumulative NFE and wall time for
     G2RPO (granularities {1, 2, 3}), G2RPO without multi-granularity ({1}) and the full-SDE baseline, at equal
     NFE budgets, over seeds; a table and a PNG plot.
  4. GPU only: a FLUX.1-dev-sized transformer (published config, random weights), bf16, LoRA: seconds per phase,
     peak memory and achieved TFLOP/s of the rollout forwards. `--gpu-config small` runs it on CPU for a check.

Run:  python bench.py            (parts 1-3, CPU, about 10 minutes)
      python bench.py --quick    (every part, shortened, under 2 minutes)
"""
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Literal

import torch
import tyro

from sampler import Counter, granular_schedule, rollout_full_sde, rollout_g2rpo, sde_step, sigma_schedule



@dataclass
class Args:
    quick: bool = False
    """A shortened run of every part (what the tests run)."""
    parts: tuple[int, ...] = (1, 2, 3, 4)
    """Which parts to run."""
    seeds: int = 3
    """Training seeds per method in part 3."""
    budget_nfe: int = 30_000
    """Part 3: image-forwards each method may spend on rollouts (equal for all)."""
    output_dir: str = "runs/bench"
    """Where part 3's runs, its table (JSON) and plot go."""
    tiny_cache: str = ".cache"
    """The tiny model's cache (see train.py --tiny-cache)."""
    gpu_config: Literal["flux", "small"] = "flux"
    """Part 4: the FLUX.1-dev-sized transformer, or a small one (runs on CPU, to check the code)."""


# ---------------------------------------------------------------------------------------------------------------
# the reference code's rollout structure, same math as sampler.rollout_g2rpo
# ---------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def reference_rollout(velocity_fn, noise, sigmas, group_size, sde_steps, granularities, eta, generators):
    """Batch-1 forwards; the SDE-step forward recomputed for every member; each granularity's completion run on its
    own. Returns final latents (B, J, K, G, ...) and the Counter. Draws the same noise as `rollout_g2rpo`."""
    counter = Counter(velocity_fn, max_batch=1)
    B, shape = noise.shape[0], noise.shape[1:]
    finals = torch.zeros(B, len(granularities), len(sde_steps), group_size, *shape)
    for b in range(B):
        idx = torch.tensor([b], device=noise.device)
        anchor = [noise[b : b + 1].float()]
        for i in range(len(sigmas) - 1):
            v = counter(anchor[i], sigmas[i : i + 1].to(noise.device), idx)
            anchor.append(sde_step(anchor[i], v, sigmas, i, 0.0)[0])
        for ki, k in enumerate(sde_steps):
            eps = torch.randn((group_size, *shape), generator=generators[b]).to(noise.device)
            for i in range(group_size):
                v = counter(anchor[k], sigmas[k : k + 1].to(noise.device), idx)  # recomputed per member
                x_next, _ = sde_step(anchor[k], v, sigmas, k, eta, noise=eps[i : i + 1])
                for j, g in enumerate(granularities):
                    sched = granular_schedule(sigmas, k, g)[k + 1 :].to(noise.device)
                    x = x_next
                    for s in range(len(sched) - 1):
                        x = x + (sched[s + 1] - sched[s]) * counter(x, sched[s : s + 1], idx)
                    finals[b, j, ki, i] = x[0]
    return finals, counter


def zero_velocity(x, sigma, idx):
    return torch.zeros_like(x)


def part1():
    print("\n## 1. Rollout cost per prompt per iteration (NFE = one transformer forward on one image)\n")
    print("| method | settings | sampling NFE | transformer calls | training forwards |")
    print("|---|---|---|---|---|")
    rows = []
    for grans in ([1, 2], [1, 2, 3], [1]):
        sigmas, gens = sigma_schedule(16, 3.0), [torch.Generator().manual_seed(0)]
        ours = rollout_g2rpo(zero_velocity, torch.zeros(1, 4), sigmas, 12, list(range(8)), grans, 0.7, gens, 4096)
        _, ref = reference_rollout(zero_velocity, torch.zeros(1, 4), sigmas, 12, list(range(8)), grans, 0.7,
                                   [torch.Generator().manual_seed(0)])
        label = f"G 12, N 16, M 0..7, Lambda {set(grans)}"
        rows.append(("G2RPO reference code", label, ref.nfe, ref.calls, 8))
        rows.append(("G2RPO, this project", label, ours.nfe, ours.calls, 8))
    for name, G, N, K in [("DanceGRPO-style full SDE", 12, 16, 9), ("Flow-GRPO-style full SDE", 24, 6, 5)]:
        full = rollout_full_sde(zero_velocity, torch.zeros(1, 4), sigma_schedule(N, 3.0), G, list(range(K)), 0.7,
                                [torch.Generator().manual_seed(0)], 4096)
        rows.append((name, f"G {G}, N {N}, {K} steps trained", full.nfe, full.calls, G * K))
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:,} | {r[3]:,} | {r[4]} |")
    return rows


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
    results = {}
    for mode in ("batched", "reference"):
        adapter.transformer.load_state_dict(state)
        optimizer = torch.optim.AdamW(params, lr=0.0)
        new_gens = lambda: [torch.Generator().manual_seed(7 + b) for b in range(B)]
        gens = new_gens()
        noise = adapter.noise(gens, res)
        if mode == "reference":  # our rollout on the same noise, untimed: the update's input and a math check
            check_gens = new_gens()
            adapter.noise(check_gens, res)
            rollout = rollout_g2rpo(velocity, noise, sigmas, G, steps, grans, 0.7, check_gens, 512)
        t0 = time.time()
        if mode == "batched":
            rollout = rollout_g2rpo(velocity, noise, sigmas, G, steps, grans, 0.7, gens, max_batch=512)
            finals, nfe = rollout.final_latents, rollout.nfe
        else:
            finals, counter = reference_rollout(velocity, noise, sigmas, G, steps, grans, 0.7, gens)
            nfe = counter.nfe
        t1 = time.time()
        flat = finals.flatten(0, 3)
        chunk = 64 if mode == "batched" else 1
        images = torch.cat([adapter.decode(flat[i : i + chunk], res) for i in range(0, len(flat), chunk)])
        t2 = time.time()
        labels = [p for p in prompts for _ in range(flat.shape[0] // B)]
        scores = torch.cat([tiny.shape_reward(images[i : i + chunk], labels[i : i + chunk])
                            for i in range(0, len(flat), chunk)])
        t3 = time.time()
        rewards = scores.view(B, len(grans), len(steps), G).transpose(0, 1)[None]  # (1, J, B, K, G)
        advantages = granular_advantages(rewards, 5.0)
        if mode == "batched":
            g2rpo_update(velocity, params, optimizer, rollout, advantages, sigmas, 0.7, 1e-4, 5.0, 1.0)
        else:  # the reference trains member by member: one batch-1 forward per member and step
            g2rpo_update(velocity, params, optimizer, _per_member(rollout), advantages, sigmas, 0.7, 1e-4,
                         5.0, 1.0, max_batch=1)
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
METHODS = {
    "G2RPO {1,2,3}": ["--sampling", "g2rpo", "--granularities", "1", "2", "3"],
    "G2RPO {1}": ["--sampling", "g2rpo", "--granularities", "1"],
    "full SDE": ["--sampling", "full", "--sde-steps", "0", "1", "2", "3", "4", "5", "6", "7"],
}


def part3(args):
    print(f"\n## 3. Held-out reward at equal rollout compute (tiny model, {args.seeds} seeds each)\n")
    base = ["--model", "tiny", "--tiny-cache", args.tiny_cache, "--prompts-per-iteration", "4", "--overwrite",
            "--checkpoint-every", "100000"]
    curves = {}
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
                if "eval/reward/shapes" in r:
                    points.append((nfe, wall, r["eval/reward/shapes"]))
            curves.setdefault(name, []).append(points)
    fractions = (0.25, 0.5, 1.0)
    print("| method | " + " | ".join(f"{int(f * 100)} % of {args.budget_nfe:,} NFE" for f in fractions)
          + " | wall s (full budget) |")
    print("|---|" + "---|" * (len(fractions) + 1))
    table = {}
    for name, runs in curves.items():
        cells = []
        for f in fractions:
            values = torch.tensor([_interp(run, f * args.budget_nfe) for run in runs])
            spread = float(values.std()) if len(values) > 1 else 0.0
            cells.append((float(values.mean()), spread))
        wall = sum(run[-1][1] for run in runs) / len(runs)
        table[name] = {"cells": cells, "wall": wall}
        print(f"| {name} | " + " | ".join(f"{m:.4f} ± {s:.4f}" for m, s in cells) + f" | {wall:.0f} |")
    start = curves[next(iter(curves))][0][0][2]
    best = max(table, key=lambda n: table[n]["cells"][-1][0])
    print(f"\nat the full budget the highest held-out reward is {best} "
          f"({table[best]['cells'][-1][0]:.4f}; all start at {start:.4f})")
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
    import train

    a = train.parse_args(["--model", "tiny", "--prompts-per-iteration", "4", *flags])
    sigmas, gens = sigma_schedule(a.num_steps, a.shift), [torch.Generator() for _ in range(4)]
    if a.sampling == "g2rpo":
        out = rollout_g2rpo(zero_velocity, torch.zeros(4, 1), sigmas, a.group_size, a.sde_steps, a.granularities,
                            a.eta, gens, 10**6)
    else:
        out = rollout_full_sde(zero_velocity, torch.zeros(4, 1), sigmas, a.group_size, a.sde_steps, a.eta, gens, 10**6)
    return out.nfe


def _interp(points, nfe):
    """Eval reward at `nfe` by linear interpolation between evaluations (the last value past the end)."""
    for (n0, _, r0), (n1, _, r1) in zip(points, points[1:]):
        if n0 <= nfe <= n1:
            return r0 + (r1 - r0) * (nfe - n0) / max(1, n1 - n0)
    return points[-1][2]


def _plot(curves, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for (name, runs), colour in zip(curves.items(), ["C0", "C1", "C2"]):
        for n, run in enumerate(runs):
            nfe, wall, reward = zip(*run)
            axes[0].plot(nfe, reward, color=colour, alpha=0.8, label=name if n == 0 else None)
            axes[1].plot(wall, reward, color=colour, alpha=0.8, label=name if n == 0 else None)
    axes[0].set_xlabel("cumulative rollout NFE")
    axes[1].set_xlabel("cumulative wall time (s)")
    for ax in axes:
        ax.set_ylabel("held-out reward (shapes)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


# ---------------------------------------------------------------------------------------------------------------
# part 4: FLUX scale on a GPU
# ---------------------------------------------------------------------------------------------------------------
FLUX_DEV_CONFIG = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                       num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                       guidance_embeds=True, axes_dims_rope=[16, 56, 56])  # black-forest-labs/FLUX.1-dev
SMALL_CONFIG = dict(FLUX_DEV_CONFIG, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                    joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=[4, 6, 6])
BF16_PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}  # dense bf16 FLOP/s


def part4(args):
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from peft import LoraConfig
    from torch.utils.flop_counter import FlopCounterMode

    from g2rpo import g2rpo_update
    from advantage import granular_advantages

    cuda = torch.cuda.is_available()
    if not cuda and args.gpu_config == "flux":
        print("\n## 4. FLUX scale: skipped (no CUDA device; `--gpu-config small` checks the code on CPU)")
        return None
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    config = FLUX_DEV_CONFIG if args.gpu_config == "flux" else SMALL_CONFIG
    transformer = FluxTransformer2DModel(**config).to(device, dtype)
    transformer.requires_grad_(False)
    transformer.add_adapter(LoraConfig(r=64, lora_alpha=64, init_lora_weights="gaussian",
                                       target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    transformer.enable_gradient_checkpointing()
    for p in transformer.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    text_len, G = 512 if cuda else 8, 12
    resolutions = (512, 720) if args.gpu_config == "flux" else (64,)
    print(f"\n## 4. FLUX-sized transformer ({args.gpu_config} config), {device}, LoRA 64, G {G}\n")
    print("| resolution | sampling s | update s | peak GiB | rollout TFLOP/s | of bf16 peak |")
    print("|---|---|---|---|---|---|")
    results = {}
    for res in resolutions:
        h = res // 16  # packed tokens per side (VAE factor 8, 2x2 patches)
        L = h * h
        prompt_embeds = torch.randn(1, text_len, config["joint_attention_dim"], device=device, dtype=dtype)
        pooled = torch.randn(1, config["pooled_projection_dim"], device=device, dtype=dtype)
        text_ids = torch.zeros(text_len, 3, device=device)
        image_ids = FluxPipeline._prepare_latent_image_ids(1, h, h, device, dtype)

        def velocity(x, sigma, idx):
            with torch.autocast(device if cuda else "cpu", dtype=dtype, enabled=cuda):
                return transformer(hidden_states=x.to(dtype), timestep=sigma.to(dtype),
                                   guidance=torch.full_like(sigma, 3.5, dtype=dtype),
                                   pooled_projections=pooled[idx], encoder_hidden_states=prompt_embeds[idx],
                                   txt_ids=text_ids, img_ids=image_ids, return_dict=False)[0].float()

        x = torch.randn(1, L, 64, device=device)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            velocity(x, torch.ones(1, device=device), torch.zeros(1, dtype=torch.long, device=device))
        flops_per_image = counter.get_total_flops()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        sigmas, gens = sigma_schedule(16 if cuda else 4, 3.0), [torch.Generator().manual_seed(0)]
        steps = list(range(8)) if cuda else [0, 1]
        t0 = time.time()
        rollout = rollout_g2rpo(velocity, x, sigmas, G, steps, [1, 2], 0.7, gens, max_batch=24)
        if cuda:
            torch.cuda.synchronize()
        t1 = time.time()
        rewards = torch.randn(1, 2, 1, len(steps), G)
        g2rpo_update(velocity, params, optimizer, rollout, granular_advantages(rewards, 5.0).to(device), sigmas, 0.7,
                     1e-4, 5.0, 1.0)
        if cuda:
            torch.cuda.synchronize()
        t2 = time.time()
        achieved = flops_per_image * rollout.nfe / (t1 - t0)
        peak_mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        name = torch.cuda.get_device_name() if cuda else "cpu"
        peak = next((v for k, v in BF16_PEAK.items() if k in name), None)
        share = f"{100 * achieved / peak:.0f} %" if peak else "n/a"
        print(f"| {res} | {t1 - t0:.1f} | {t2 - t1:.1f} | {peak_mem:.1f} | {achieved / 1e12:.1f} | {share} |")
        results[res] = dict(sampling=t1 - t0, update=t2 - t1, peak_gib=peak_mem, tflops=achieved / 1e12)
    return results


def main(args: Args):
    if args.quick:
        args.seeds, args.budget_nfe, args.gpu_config = 1, 2_500, "small"
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
    if 4 in args.parts:
        out["gpu"] = part4(args)
    return out


if __name__ == "__main__":
    main(tyro.cli(Args))
