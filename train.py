"""Train a text-to-image flow model with G2RPO: the program users run, and where the iteration reads top to bottom.

One iteration (`iteration` below), on each rank, for its own prompts (a group never spans ranks, so advantages need
no communication, except Flow-GRPO's global std, which gathers every rank's rewards):
  1. encode the prompts; draw one initial noise per prompt (or per member, for the methods that want it) and
     per-prompt SDE noise, seeded by (seed, iteration, global prompt position), so the run is the same on 1 rank or
     many and after a resume;
  2. roll out (sampler.py): G2RPO's anchor + singular SDE branches + multi-granularity completions;
  3. decode every final latent and score it with every reward model (rewards.py);
  4. advantages per (reward, granularity, step), normalised in the group and summed (advantage.py);
  5. the clipped policy update (g2rpo.py): the members of a prompt share their start latent, so one forward per
     prompt and trained step scores all G.
The method (--method) answers steps 2, 4 and 5: `g2rpo.G2RPO`, or a peer of methods/ with the same interface.
Around it (lab/run.py): the output folder and its lock, checkpoints and resume, signals, faults, metrics, grids.
The flags and their checks are lab/flags.py; the models and how they are called, lab/models.py and lab/kernels.py.

Run it:
    python train.py --model tiny                                      # CPU, minutes: the built-in tiny model
    python train.py --model flux --lora-rank 64 --lr 1e-4             # one GPU, LoRA
    torchrun --nproc_per_node 8 train.py --model flux                 # one node, full fine-tune, FSDP2
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 train.py --model flux
    python train.py --model flux --help                               # every flag, with the preset's values

Deviations from the reference code (numbers of the README's list): 6 (granularities {1, 2, 3}), 7 (per-prompt
noise and data order), 8 (faults), 9 (held-out evaluation), 11 (attention kernels and the gradient self-check).
"""
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lab import checkpoint, watch
import rewards
from g2rpo import update_loss
from lab.flags import changed_from_preset, fail, method_of, parse_args, validate, warn_long_prompts
from lab.models import ADAPTERS, ModelLoadError, add_lora
from lab.run import (EMA, GRID_IMAGES, Preempted, Ranks, Run, UpdateCut, all_max, all_mean, any_rank, backend,
                     checked, eval_noise_generator)
from methods import step_credit
from methods.adagrpo import Curriculum, with_global_advantage
from sampler import ode_sample, sigma_schedule


# ---------------------------------------------------------------------------------------------------------------
# One iteration: prompts -> rollout -> rewards -> advantages -> update
# ---------------------------------------------------------------------------------------------------------------
def iteration(args, it, method, policy, reward_models, prompts, sigmas, rank, world, distributed,
              first_update_check=None, check_stop=lambda: None, curriculum=None):
    """One iteration of `method` (g2rpo.G2RPO, or one of methods/) on this rank's prompts; returns its metrics
    (floats). `check_stop` runs before every transformer call of the rollout and every reward batch of its scoring
    (lab.run.Run.check_stop: a stop asked then drops the iteration before it changes anything). `curriculum`:
    AdaGRPO's moving state (methods/adagrpo.py) under --curriculum-pool, which this iteration moves."""
    t0 = time.time()
    ranks = Ranks(world, distributed) if distributed else None
    # 1. prompts and noise: one initial noise per prompt, and a generator per prompt for its members' SDE noise
    global_batch = args.global_batch(world)
    pool_metrics = {}
    if curriculum is not None:  # each prompt chosen from its pool by its anchor's score (AdaGRPO's curriculum)
        batch, positions, pool_metrics = curriculum_prompts(args, it, policy, reward_models, prompts, sigmas, rank,
                                                            world, ranks, curriculum, check_stop)
    else:
        batch, positions = batch_prompts(prompts, args.seed, it, global_batch, rank, global_batch // world)
    cond = policy.adapter.encode(batch)
    gens = generators(args.seed, it, positions)
    B, G = len(batch), args.group_size
    if method.same_noise:
        noise = policy.adapter.noise(gens, args.size)  # (B, ...)
    else:  # each member its own initial noise, drawn in turn from its prompt's generator
        noise = policy.adapter.noise([gen for gen in gens for _ in range(G)], args.size).unflatten(0, (B, G))

    # 2. rollout with the current policy, no gradients; with --rollout-precision fp8 the forwards that only make
    # images (completions, the anchor's untrained steps) run on the FP8 copy, the trained steps on the policy
    steps = method.trained_steps(it)
    image_only_fn = (checked(check_stop, make_velocity_fn(args, policy, policy.fp8.module, cond))
                     if policy.fp8 is not None else None)
    velocity_fn = checked(check_stop, make_velocity_fn(args, policy, policy.transformer, cond))
    rollout = method.rollout(velocity_fn, noise, sigmas, gens, steps, image_only_fn)
    t1 = time.time()

    # 3. rewards of every completion: (B, J, K, G, R), the rollout's order with the reward models last
    J, K = rollout.final_latents.shape[1:3]
    scores = score(args, policy.adapter, reward_models, rollout.final_latents.flatten(0, 3),
                   [p for p in batch for _ in range(J * K * G)], check_stop)
    scores = scores.view(B, J, K, G, -1)  # (B, J, K, G, R)
    metrics = reward_metrics(args, policy.adapter, reward_models, rollout, scores, batch)
    t2 = time.time()

    # 4. advantages: per trained step (or one per trajectory, broadcast to its steps), --step-credit's control
    weights = torch.tensor(list(reward_models.weights.values()))  # (R,)
    advantages = method.advantages(scores, weights, ranks)  # (B, K or 1, G)
    if args.global_advantage:  # AdaGRPO's cross-level term, on the curriculum's moving scale
        advantages = with_global_advantage(advantages, scores, weights, curriculum, args.adv_clip_max)
    advantages = step_credit(advantages.expand(B, len(steps), G), args.step_credit).to(noise.device)  # (B, K, G)

    # 5. the clipped policy update, taken on every rank or on none
    finite_rewards = not any_rank(not bool(torch.isfinite(scores).all()), distributed)
    if finite_rewards and steps:  # (MixGRPO's empty window trains nothing)
        update_velocity = make_velocity_fn(args, policy, policy.model, cond)  # through DDP / FSDP2, with gradients
        if first_update_check is not None:
            first_update_check.before(update_velocity, rollout, method.step)
        stats = method.update(update_velocity, policy.params, policy.optimizer, rollout, advantages, sigmas, gens,
                              base_velocity_fn(args, policy, cond), ranks)
        if first_update_check is not None:
            first_update_check.after(stats)
        if policy.fp8 is not None and args.full and stats["optimizer_steps"]:
            policy.fp8.refresh()  # the full fine-tune's new weights, quantized for the next rollout
            stats["fp8_refresh_s"] = policy.fp8.refreshed_s
    else:
        stats = {"optimizer_steps": 0, "skipped_steps": 0 if finite_rewards else method.optimizer_steps(len(steps))}
    if policy.ema is not None and stats["optimizer_steps"]:  # weights that did not move add nothing to average
        policy.ema.update(it + 1)
    t3 = time.time()
    metrics.update({f"losses/{k}": v for k, v in stats.items()
                    if k not in ("skipped_steps", "optimizer_steps", "fp8_refresh_s")})
    if "fp8_refresh_s" in stats:
        metrics["time/fp8_refresh"] = stats["fp8_refresh_s"]
    metrics.update({"faults/skipped_steps": stats["skipped_steps"],
                    "faults/nonfinite_rewards": float(not finite_rewards),
                    "perf/optimizer_steps": stats["optimizer_steps"],
                    # image-forwards of this iteration's rollouts on all ranks (each rank has as many prompts)
                    "perf/nfe": (rollout.nfe + pool_metrics.pop("nfe", 0)) * policy.adapter.forwards_per_velocity
                    * world,
                    # forwards with gradients (Pave-GRPO's sub-steps add theirs): start latents x trained steps x ...
                    "perf/update_nfe": rollout.start_latents.shape[0] * rollout.start_latents.shape[2] * len(steps)
                    * method.inner_epochs * update_forwards(method)
                    * policy.adapter.forwards_per_velocity * world,
                    "perf/image_only_nfe": rollout.image_only_nfe * policy.adapter.forwards_per_velocity * world,
                    "perf/calls": rollout.calls, "time/rollout": t1 - t0, "time/decode_and_reward": t2 - t1,
                    "time/update": t3 - t2, "time/iteration": t3 - t0, **pool_metrics})
    return metrics


def curriculum_prompts(args, it, policy, reward_models, prompts, sigmas, rank, world, ranks, curriculum, check_stop):
    """AdaGRPO's curriculum (methods/adagrpo.py): this rank's prompts of iteration `it`, each the one of its
    --curriculum-pool candidates whose anchor (an ODE rollout from the noise the prompt would train with) scores
    closest to the moving mean, which the pools of all ranks move first. Returns (prompts, their global positions,
    metrics with the pool's "nfe")."""
    pool, per_rank = args.curriculum_pool, args.global_batch(world) // world
    candidates, positions = batch_prompts(prompts, args.seed, it, args.global_batch(world) * pool, rank,
                                          per_rank * pool)  # slot b's candidates: b * pool .. (b + 1) * pool - 1
    cond = policy.adapter.encode(candidates)
    noise = policy.adapter.noise(generators(args.seed, it, positions), args.size)  # (B * P, ...)
    velocity = checked(check_stop, make_velocity_fn(args, policy, policy.transformer, cond))
    anchors = ode_sample(velocity, noise, sigmas, max_batch=args.max_batch)
    scores = score(args, policy.adapter, reward_models, anchors, candidates, check_stop)  # (B * P, R)
    anchor_scores = scores.float().cpu() @ torch.tensor(list(reward_models.weights.values()))  # (B * P,)
    curriculum.observe(ranks.gather(anchor_scores) if ranks is not None else anchor_scores)
    chosen = [b * pool + int(c) for b, c in enumerate(curriculum.choose(anchor_scores.view(per_rank, pool)))]
    return ([candidates[i] for i in chosen], [positions[i] for i in chosen],
            {"nfe": len(candidates) * (len(sigmas) - 1), "curriculum/moving_mean": curriculum.mean,
             "curriculum/moving_std": curriculum.std, "curriculum/pool_score": float(anchor_scores.mean()),
             "curriculum/chosen_score": float(anchor_scores[chosen].mean())})


def generators(seed: int, iteration: int, positions):
    """One CPU generator per prompt, keyed by (seed, iteration, global position in the batch)."""
    return [torch.Generator().manual_seed((seed * 1_000_003 + iteration) * 10_007 + p) for p in positions]


def batch_prompts(prompts, seed, iteration, global_batch, rank, per_rank):
    """This rank's prompts of iteration `iteration` and their global positions; a new shuffle every epoch."""
    per_epoch = max(1, len(prompts) // global_batch)
    epoch, step = divmod(iteration, per_epoch)
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    positions = list(range(rank * per_rank, (rank + 1) * per_rank))
    return [prompts[order[(step * global_batch + p) % len(order)]] for p in positions], positions


@torch.no_grad()
def score(args, adapter, reward_models, latents, prompts, check_stop=lambda: None):
    """Decode latents (M, ...) in micro-batches and score them with every reward model: (M, R). `check_stop` runs
    before each micro-batch."""
    scores = []
    for i in range(0, latents.shape[0], args.reward_batch_size):
        check_stop()
        images = adapter.decode(latents[i : i + args.reward_batch_size], args.size)
        batch = prompts[i : i + args.reward_batch_size]
        scores.append(torch.stack([fn(images, batch).cpu() for fn in reward_models.fns.values()], -1))
    return torch.cat(scores)  # (M, R)


def reward_metrics(args, adapter, reward_models, rollout, scores, batch):
    """Mean raw reward per model (and per granularity), and the anchor's reward (logged, not trained on)."""
    metrics = {}
    for r, name in enumerate(reward_models.fns):
        metrics[f"train/reward/{name}"] = float(scores[..., r].mean())
        for j, g in enumerate(rollout.granularities):
            metrics[f"train/reward/{name}/g{g}"] = float(scores[:, j, ..., r].mean())
    if rollout.anchor_final is not None:
        anchor = score(args, adapter, reward_models, rollout.anchor_final, batch)  # (B, R)
        metrics.update({f"train/anchor_reward/{name}": float(anchor[:, r].mean())
                        for r, name in enumerate(reward_models.fns)})
    return metrics


def eval_items(num_prompts: int, eval_prompts: int, eval_seeds: int):
    """The (prompt index, seed) pairs of the held-out evaluation: `eval_prompts` prompts spread evenly over the file
    (all of them when 0), seed-major; prompt indices are positions in the file, so the noise of a pair does not
    depend on the subset (evaluate.py draws the same)."""
    n = min(eval_prompts or num_prompts, num_prompts)
    chosen = sorted({i * num_prompts // n for i in range(n)})
    return [(p, s) for s in range(eval_seeds) for p in chosen]


def first_frame(images):
    """Images (N, 3, H, W) as they are; videos (N, 3, F, H, W) by their first frame (the watch's statistics)."""
    return images if images.dim() == 4 else images[:, :, 0]


@torch.no_grad()
def held_out_eval(args, policy, reward_models, eval_prompts, sigmas, rank, world, distributed, seeds=None,
                  check_stop=lambda: None):
    """Held-out reward of the deterministic (ODE) images on `seeds` fixed seeds a prompt (default --eval-seeds);
    with an EMA, of the EMA weights. Encodes, samples, decodes and scores --max-batch items at a time, so no phase
    of it needs more memory than a rollout call. Returns metrics (each mean with its standard error over the images,
    and the std of the per-seed means) and up to GRID_IMAGES of this rank's images (on the CPU)."""
    seeds = seeds or args.eval_seeds
    items = eval_items(len(eval_prompts), args.eval_prompts, seeds)
    per_rank = -(-len(items) // world)
    mine = items[rank * per_rank : (rank + 1) * per_rank]
    valid = len(mine)
    mine = mine + [items[-1]] * (per_rank - valid)  # equal work on every rank (FSDP forwards are collective)
    # every reward's score, the held-out rewards' (--eval-rewards), and the per-image statistics of the
    # reward-hacking watch
    period = getattr(policy.adapter.pipe, "vae_scale_factor", 8) * 2  # pixels of one latent patch
    fns = {**{f"reward/{name}": fn for name, fn in reward_models.fns.items()},
           **{f"heldout/{name}": fn for name, fn in reward_models.held_out.items()},
           "stats/saturation": lambda images, prompts: watch.saturation(first_frame(images)),
           "stats/grid": lambda images, prompts: watch.grid_energy(first_frame(images), period)}
    per_seed = torch.zeros(len(fns), seeds, 3, dtype=torch.float64)  # (R, seeds, (sum, count, sum of squares))
    small = torch.zeros(len(mine), 3, 32, 32)  # every image, small, for the diversity over seeds
    grid = []
    if policy.ema is not None:
        policy.ema.swap()
    try:
        for start in range(0, len(mine), args.max_batch):
            chunk = mine[start : start + args.max_batch]
            prompts = [eval_prompts[p] for p, _ in chunk]
            cond = policy.adapter.encode(prompts)
            noise = policy.adapter.noise([eval_noise_generator(p, s) for p, s in chunk], args.size)  # (b, ...)
            velocity_fn = checked(check_stop, make_velocity_fn(args, policy, policy.transformer, cond))
            x0 = ode_sample(velocity_fn, noise, sigmas, max_batch=args.max_batch)
            for i in range(0, len(chunk), args.reward_batch_size):
                images = policy.adapter.decode(x0[i : i + args.reward_batch_size], args.size)  # (b', 3, H, W)
                batch = chunk[i : i + args.reward_batch_size]
                small[start + i : start + i + len(batch)] = torch.nn.functional.interpolate(
                    first_frame(images).float().cpu(), size=(32, 32), mode="area")
                for r, fn in enumerate(fns.values()):
                    scores = fn(images, prompts[i : i + args.reward_batch_size]).cpu()  # (b',)
                    for n, ((_, s), v) in enumerate(zip(batch, scores)):
                        if start + i + n < valid:  # not a padding item
                            per_seed[r, s] += torch.tensor([float(v), 1.0, float(v) ** 2], dtype=torch.float64)
                if len(grid) < GRID_IMAGES:  # as bytes: 24 videos of 81 frames would hold gigabytes in fp32
                    grid.extend((images[: GRID_IMAGES - len(grid)] * 255).round().byte().cpu())
    finally:
        if policy.ema is not None:
            policy.ema.swap()
    if distributed:
        dist.all_reduce(per_seed)
        shares = [torch.zeros_like(small) for _ in range(world)]
        dist.all_gather(shares, small)
        small = torch.cat(shares)
    every = small[: len(items)]  # each rank's share in order, its padding past the end
    prompt_of = torch.tensor([p for p, _ in items])
    metrics = {}
    spread = watch.diversity(every, prompt_of)  # (prompts with 2 or more seeds,)
    if len(spread):
        metrics["eval/stats/diversity"] = float(spread.mean())
        metrics["eval/stats_se/diversity"] = float(spread.std()) / len(spread) ** 0.5 if len(spread) > 1 else 0.0
    for r, key in enumerate(fns):
        means = per_seed[r, :, 0] / per_seed[r, :, 1].clamp_min(1)  # (seeds,)
        kind, name = key.split("/", 1)
        total, count, squares = per_seed[r].sum(0).tolist()
        metrics[f"eval/{key}"] = total / count
        metrics[f"eval/{kind}_seed_std/{name}"] = float(means.std()) if seeds > 1 else 0.0
        # the standard error of that mean from the images alone: sqrt(var / n) (for a pass rate, sqrt(p (1 - p) / n))
        metrics[f"eval/{kind}_se/{name}"] = max(squares / count - (total / count) ** 2, 0.0) ** 0.5 / count**0.5
    return metrics, torch.stack(grid[:valid]) if valid else torch.empty(0)


# ---------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------
def train(args, config, policy, reward_models, run, prompts, eval_prompts, start, rank, world, distributed,
          curriculum=None):
    from tqdm import tqdm

    sigmas = sigma_schedule(args.num_steps, args.shift)
    method = method_of(args)
    # the first and last evaluations, which a run's result is read from, may take more seeds than the rest (the
    # first its own number: a bench of many runs from one base evaluates that base once)
    held_out = lambda seeds=None: held_out_eval(args, policy, reward_models, eval_prompts, sigmas, rank, world,
                                                distributed, seeds, run.check_stop)
    # AdaGRPO's curriculum state, once its first pool has moved it (None: nothing to save or restore)
    curriculum_state = lambda: curriculum.state_dict() if curriculum is not None and curriculum.mean is not None \
        else None
    save = lambda done: run.save(done, policy.model, policy.transformer, policy.optimizer, config,
                                 policy.adapter.pipeline_class, policy.params, policy.ema,
                                 final=done == args.num_iterations,
                                 states={"curriculum": curriculum_state()} if curriculum_state() else None)
    saved = start  # the iteration of the newest checkpoint (0: none yet)
    shown = min(args.eval_prompts or len(eval_prompts), len(eval_prompts))  # prompts per seed in the grids
    captions = [f"{eval_prompts[p]} (seed {s})" for p, s in eval_items(len(eval_prompts), args.eval_prompts,
                                                                         args.eval_seeds)]
    if start == 0:
        try:
            before, images = held_out(args.first_eval_seeds or args.final_eval_seeds)
        except Preempted:
            run.log("stopped before the first iteration; nothing to save: rerun the same command plus --resume")
            return
        run.save_grid(images, 0, shown, captions)
        run.write_metrics(0, before)
    else:
        before = run.resume_metrics(start)
    check = FirstUpdateChecks(args, policy, sigmas, run.log, distributed) if args.gradient_check else None
    bar = tqdm(range(start, args.num_iterations), initial=start, total=args.num_iterations, disable=not run.master,
               dynamic_ncols=True)
    metrics, first_reward = {}, f"train/reward/{next(iter(reward_models.fns))}"
    limits = watch.Limits(saturation=args.watch_saturation, grid=args.watch_grid, diversity=args.watch_diversity,
                          z=args.watch_z)
    for it in bar:
        run.steps_taken = 0  # (the optimizer steps of this iteration's update, for a stop that cuts it)
        # the curriculum's state as iteration `it` left it: a stop inside the next iteration saves this one, which
        # the rerun of that iteration moves again
        held = curriculum_state()
        try:
            metrics = iteration(args, it, method, policy, reward_models, prompts, sigmas, rank, world, distributed,
                                check, run.check_stop, curriculum)
        except UpdateCut as cut:  # during the update, at an optimizer step: the weights are partly iteration it + 1's
            bar.close()
            if held is not None:
                curriculum.load_state_dict(held)
            if it > saved:  # the state of iteration `it` is gone from memory: these weights, cut short, stand for it
                save(it)
                line = (f"the checkpoint of iteration {it} is written with the first {cut.steps} optimizer steps of "
                        f"iteration {it + 1} in it (which reruns in full on --resume)")
            elif it:  # the state of iteration `it` is on disk already: nothing to write
                line = (f"the checkpoint of iteration {it} on disk is kept and these steps dropped (iteration "
                        f"{it + 1} reruns on --resume)")
            else:
                line = "no iteration was complete: nothing is saved"
            run.stopped(it, f"stopped during iteration {it + 1}'s update, after {cut.steps} optimizer steps; {line}; "
                            f"continue with the same command plus --resume")
            return
        except Preempted:  # during the rollout or its scoring: the weights are still those of iteration `it`
            bar.close()
            if held is not None:
                curriculum.load_state_dict(held)
            if it > saved:
                save(it)
            written = "written" if it else "none: no iteration was complete"
            run.stopped(it, f"stopped during iteration {it + 1}, before its update (it reruns on --resume); the "
                            f"checkpoint of iteration {it} is {written}; continue with the same command plus --resume")
            return
        metrics = all_mean(metrics, distributed)
        if not metrics["faults/nonfinite_rewards"]:
            check = None  # it ran with this iteration's update
        faulty = run.count_faults(metrics)
        done = it + 1
        hacked = []
        if (done % args.eval_every == 0 or done == args.num_iterations) and not run.should_stop():
            try:
                eval_metrics, images = held_out(args.final_eval_seeds if done == args.num_iterations else None)
                metrics.update(eval_metrics)
                run.save_grid(images, done, shown, captions)
                # the reward-hacking watch: the trained rewards' change since the first evaluation against the
                # held-out ones' and the image statistics'
                hacked, watched = watch.check(before, eval_metrics, limits)
                metrics.update(watched)
                if hacked:
                    bar.clear()
                    run.log(f"warning: reward hacking? from iteration 0 to {done}, {hacked[0]}; look at "
                            f"samples/ (--stop-on-hacking stops here)")
            except Preempted:  # the iteration is whole: it is saved below, without its evaluation
                pass
        run.write_metrics(done, metrics)
        run.stop_after_too_many_faults()
        bar.set_postfix(reward=f"{metrics[first_reward]:.4f}", loss=f"{metrics.get('losses/loss', 0):.2e}",
                        s_it=f"{metrics['time/iteration']:.1f}")
        signalled = run.should_stop()
        # (after a resume rank 0 alone reads the first evaluation's metrics back, so it alone may see the watch fire)
        hacking = not signalled and any_rank(bool(hacked) and args.stop_on_hacking, distributed)
        stop = signalled or hacking
        # no periodic checkpoint from a faulty iteration: the last good one must survive the rotation
        if (done % args.checkpoint_every == 0 or done == args.num_iterations) and not faulty or stop:
            save(done)
            saved = done
        if stop:
            bar.close()
            run.stopped(done, f"stopped after iteration {done}" + (
                ": the reward-hacking watch fired (--stop-on-hacking); look at samples/, then continue with --resume "
                "and --no-stop-on-hacking or wider --watch-* limits" if hacking else
                "; continue with the same command plus --resume"))
            return
    bar.close()
    if run.optimizer_steps == 0 and run.skipped_steps:  # (MixGRPO's empty window trains nothing, and is no fault)
        raise SystemExit(f"error: no optimizer step succeeded in iterations {start}..{args.num_iterations}; "
                         f"nothing was learned (see faults/* in metrics.jsonl)")
    if distributed:
        run.check_ranks_agree(policy.params)
    if run.master and before and metrics:
        run.summary(before, metrics, reward_models.fns, reward_models.held_out)
        if args.model == "tiny" and "eval/heldout/shapes-strict" in metrics:  # where the quick start stands
            from lab import tiny

            run.log(tiny.quick_start_standing(metrics["eval/heldout/shapes-strict"], changed_from_preset(args)))


RATIO_ROUNDING = 1e-6  # a first-step ratio within this of 1 is the same forward up to rounding


class FirstUpdateChecks:
    """The self-checks of this process's first update (--gradient-check), which matter on accelerators, where the
    fast kernels live (on the CPU both pass trivially):
      before it, the gradient against the math attention kernel's (and fp32's where the run is bf16 on fp32
      weights): two or three forward-backward passes of one sample, once;
      after it, the first trained step's ratios against 1: before its first optimizer step the policy is the
      rollout's, so they are 1 up to rounding (exactly 1 on the CPU, and on an H200 in bf16). A ratio off 1 means
      the rollout's forwards at the trained steps are not the update's: another attention kernel, or another model
      (an FP8 copy where the policy belongs). Past the clip range the update would clip steps it should take, and
      the run stops; below it, a line says so. Every rank decides alike.
    Either stops the run with one line when it fails."""

    def __init__(self, args, policy, sigmas, log, distributed=False):
        self.args, self.policy, self.sigmas, self.log, self.distributed = args, policy, sigmas, log, distributed

    def before(self, update_velocity, rollout, step_fn):
        # the log-likelihood of the first prompt's members at its first trained step, through the update's path
        loss_fn = update_loss(update_velocity, rollout, self.sigmas, step_fn)
        result = self.policy.adapter.kernels.check_gradient(loss_fn, self.policy.params)
        if not result.ok:
            raise SystemExit(f"error: gradient self-check failed: {result.message}")
        self.log(f"gradient self-check passed: {result.message}")

    def after(self, stats):
        error, clip = stats["first_ratio_error"], self.args.clip_range
        # -1: no member of this rank scored the first step (a rank's share of DanceGRPO's random steps can be empty)
        worst = all_max(-1.0 if math.isnan(error) else error, self.distributed)
        cause = ("the rollout's forwards at the trained steps differ from the update's (another attention kernel, or "
                 "an FP8 forward where the policy's belongs)")
        if worst < 0:
            self.log("first-step ratio check: not checked (no member scored the first trained step)")
        elif worst > clip:
            raise SystemExit(f"error: first-step ratio check failed: before any optimizer step the update's ratios at "
                             f"the first trained step are up to {worst:.3g} from 1, beyond --clip-range {clip:g}: "
                             f"{cause}; use the same --rollout-attention-backend as --attention-backend (both auto "
                             f"by default), and if that does not fix it, run without --rollout-precision fp8")
        elif worst > RATIO_ROUNDING:
            self.log(f"note: first-step ratio check: up to {worst:.3g} from 1, within --clip-range {clip:g} but not "
                     f"exact: {cause}")
        else:
            within = "exactly 1" if worst == 0 else f"within {worst:.2g} of 1"
            self.log(f"first-step ratio check passed: the first trained step's ratios are {within}")


# ---------------------------------------------------------------------------------------------------------------
# Models: the policy (the trained transformer, LoRA or full, DDP or FSDP2, and its optimizer), the reward models
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Policy:
    """What training changes and what it changes it with: the transformer behind its adapter, its optimizer, the
    EMA, and the KL term's frozen base model."""

    adapter: object  # models.Adapter: encode, noise, velocity, decode
    transformer: torch.nn.Module  # the diffusers module (sharded in place under FSDP2)
    model: torch.nn.Module  # what the update calls: DDP-wrapped for LoRA, else the transformer
    params: list
    optimizer: torch.optim.Optimizer
    kl_base: torch.nn.Module | None = None  # the KL term's frozen base model, in a full fine-tune
    ema: EMA | None = None
    fp8: object | None = None  # kernels.Float8Copy of the transformer, with --rollout-precision fp8


@dataclass
class RewardModels:
    """What scores the policy's images: each reward by name, fn(images, prompts) -> (N,), and its --rewards weight."""

    fns: dict
    weights: dict
    held_out: dict = dataclasses.field(default_factory=dict)  # --eval-rewards: evaluations only, never trained on


def build_policy(args, device, dtype, distributed, log) -> Policy:
    """Load the pipeline and make the trained policy of it (`make_policy`)."""
    torch.manual_seed(args.seed)  # LoRA's initialisation; everything else draws from per-prompt generators
    model_path = args.model_path
    if args.model == "tiny":
        from lab import tiny

        model_path = tiny.ensure_pretrained_on_ranks(args.tiny_cache, log=log)
    try:
        adapter = ADAPTERS[args.model].load(
            model_path, device, dtype, guidance=args.guidance, max_sequence_length=args.max_sequence_length,
            offload_text_encoders=args.offload_text_encoders, attention_backend=args.attention_backend,
            rollout_attention_backend=args.rollout_attention_backend, compile=args.compile,
            # full fine-tune: fp32 master weights; LoRA: the frozen base in the compute dtype (bf16 on GPU)
            transformer_dtype=torch.float32 if args.full else dtype, place_transformer=not (distributed and args.full),
            num_frames=args.num_frames)
    except ModelLoadError as err:
        fail(str(err))
    return make_policy(args, adapter, device, dtype, distributed)


def load_reward_models(args, device, dtype, weights) -> RewardModels:
    """Every reward model of --rewards (rewards.py), by name, with its weight."""
    load = lambda name: rewards.load_reward(name, device, dtype, args.reward_batch_size, vars(args),
                                            frames_every=args.reward_frames)
    try:
        fns = {name: load(name) for name in weights}
    except rewards.RewardError as err:
        fail(str(err))
    try:
        names = rewards.parse_rewards(args.eval_rewards) if args.eval_rewards else {}  # ("clip=1.0" is "clip")
        return RewardModels(fns, weights, {name: load(name) for name in names})
    except rewards.RewardError as err:
        fail(f"--eval-rewards: {err}; or leave it out of --eval-rewards")


def make_policy(args, adapter, device, dtype, distributed, foreach=None, mesh=None) -> Policy:
    """The trained part around a loaded adapter: full weights or LoRA, the KL's base model, gradient checkpointing,
    DDP (LoRA) or FSDP2 (full) across ranks, AdamW and the EMA. `foreach` and `mesh` are tools/plan.py's, and
    train.py passes neither: the planner builds a CUDA run on the CPU, so it asks for the multi-tensor AdamW that
    torch picks on CUDA (foreach=True), and it makes its fake ranks' device mesh before entering fake-tensor mode,
    where FSDP2 could not make the default one."""
    transformer = adapter.transformer
    if args.full:
        transformer.requires_grad_(True)
    else:
        add_lora(transformer, args.lora_rank, args.lora_alpha_applied, args.lora_feed_forward,
                 adapter.lora_targets)
    kl_base = None
    if args.full and args.kl_beta > 0:  # the base model of the KL term: a frozen copy of the starting weights
        import copy

        kl_base = copy.deepcopy(transformer).requires_grad_(False).eval()
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    model = transformer
    if distributed and not args.full:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(transformer, device_ids=[device.index] if device.type == "cuda" else None)
    elif distributed:
        for module in [transformer] + ([kl_base] if kl_base is not None else []):
            _shard(module, dtype, device, mesh)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay,
                                  foreach=foreach)
    ema = None
    if args.ema_decay > 0:
        trained = [(name, p) for name, p in transformer.named_parameters() if p.requires_grad]
        ema = EMA(trained, args.ema_decay, args.ema_every)
    return Policy(adapter, transformer, model, params, optimizer, kl_base, ema)


def _shard(module, dtype, device, mesh=None):
    """FSDP2: shard every transformer block (the classes diffusers lists as `_no_split_modules`), then the rest; the
    shards alone move to the device. `mesh`: the ranks' device mesh (default: all ranks of the process group)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    block_classes = set(getattr(module, "_no_split_modules", None) or [])
    for block in [m for m in module.modules() if type(m).__name__ in block_classes]:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    module.to(device)


def update_forwards(method) -> int:
    """Forwards with gradients per start latent and trained step: 1, or more where a method's update adds its own
    (Pave-GRPO's sub-steps)."""
    return method.update_forwards() if hasattr(method, "update_forwards") else 1


def make_velocity_fn(args, policy, module, cond):
    """v(x, sigma | prompt) of `module` (the transformer, or its DDP wrapper in the update)."""
    return lambda x, sigma, idx: policy.adapter.velocity(module, cond, x, sigma, idx, args.size)


def base_velocity_fn(args, policy, cond):
    """The base model's velocity for the KL term: LoRA with its adapter off, or the frozen copy; None without KL."""
    if args.kl_beta == 0:
        return None
    if policy.kl_base is not None:
        return make_velocity_fn(args, policy, policy.kl_base, cond)

    def base_velocity(x, sigma, idx):
        policy.transformer.disable_adapters()
        try:
            return policy.adapter.velocity(policy.transformer, cond, x, sigma, idx, args.size)
        finally:
            policy.transformer.enable_adapters()

    return base_velocity


def main(args) -> bool:
    """Train; returns whether a signal stopped the run (its checkpoint written)."""
    # ---- distributed: one short block keyed on RANK, so the same script runs on a laptop and on many GPUs ----
    distributed = int(os.environ.get("RANK", -1)) != -1
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if distributed else (0, 1)
    master = rank == 0
    log = print if master else (lambda *a, **k: None)
    prompts, eval_prompts, reward_weights = validate(args, world, log)
    run = Run(args, rank, world, distributed, log)
    config = dataclasses.asdict(args)
    if os.path.isdir(args.model_path):  # recorded as a path that reads the same from any folder (evaluate.py, resume)
        config["model_path"] = os.path.abspath(args.model_path)
    try:
        resume_from = run.open(config) if master else None
        if distributed:
            dist.init_process_group(backend(), timeout=timedelta(minutes=args.dist_timeout_minutes))
            device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")
            if device.type == "cuda":
                torch.cuda.set_device(device)
            shared = [resume_from]
            dist.broadcast_object_list(shared, src=0)
            resume_from = shared[0]
        else:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if device.type == "cuda" and args.mixed_precision == "bf16" else torch.float32
        start = 0
        if resume_from:
            start = checkpoint.read_trainer_state(resume_from)["iteration"]
            if start >= args.num_iterations:
                log(f"{resume_from} is already at iteration {start} of --num-iterations {args.num_iterations}: "
                    f"the run is complete; pass a larger --num-iterations to extend it")
                return False
        policy = build_policy(args, device, dtype, distributed, log)
        reward_models = load_reward_models(args, device, dtype, reward_weights)
        warn_long_prompts(args, policy.adapter.pipe, prompts + eval_prompts, log)
        curriculum = Curriculum(args.curriculum_ema) if args.curriculum_pool else None
        if resume_from:
            state = checkpoint.load(resume_from, policy.model, policy.transformer, policy.optimizer, not args.full,
                                    extra={**({"ema": policy.ema.tensors()} if policy.ema is not None else {}),
                                           **({"curriculum": {"mean_var": torch.zeros(2, dtype=torch.float64)}}
                                              if curriculum is not None else {})} or None)  # (the sharded load's shapes)
            if curriculum is not None and "curriculum" in state["extra"]:
                curriculum.load_state_dict(state["extra"]["curriculum"])
            if policy.ema is not None:
                if "ema" not in state["extra"]:
                    fail(f"{resume_from} holds no EMA weights; resume without --ema-decay or start a new run")
                policy.ema.load_state_dict(state["extra"]["ema"])
            run.resumed_flags(state["config"], config, policy.optimizer)
            log(f"resumed from {resume_from} at iteration {start}")
        if args.rollout_precision == "fp8":  # from the weights the run starts with (after a resume, the loaded ones)
            from lab.kernels import Float8Copy

            policy.fp8 = Float8Copy(policy.transformer)
            log(f"FP8 rollout copy: {len(policy.fp8.names)} linear layers of the blocks quantized in "
                f"{policy.fp8.refreshed_s:.1f} s; the trained steps and the update stay in "
                f"{str(dtype).removeprefix('torch.')}")
        if master:
            run.begin(config, fresh=not resume_from)
        run.open_tracker(config, start)
        run.catch_signals()
        if distributed:  # under torchrun a stop cuts a long update short (its grace); one process finishes it, so
            run.stop_between_steps(policy.optimizer)  # that its resume equals the uninterrupted run
        run.steps_taken = 0
        train(args, config, policy, reward_models, run, prompts, eval_prompts, start, rank, world, distributed,
              curriculum)
        if distributed:
            dist.barrier()  # leave together: a rank tearing down its process group early can abort another
    finally:
        run.close()
        if distributed and dist.is_initialized():
            dist.destroy_process_group()
    return run.stopped_at is not None


if __name__ == "__main__":
    if main(parse_args()):  # stopped by a signal: leave at once, before Python's shutdown restores its handlers
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
