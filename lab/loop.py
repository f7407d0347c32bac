"""The harness of train.py's loop: what one iteration needs besides the method (prompts, noise, the policy's
velocity, rewards, the update's context, its metrics), the held-out evaluation, the first update's self-checks,
and the loop around the iterations (evaluations, the reward-hacking watch, checkpoints, stops, closing lines).

`Harness` is what train.iteration and a method's `prompts` hook are given (`data`, methods/base.py): this rank's
share of the data, the policy's forwards, the rewards, and the collectives. It names no method.
"""
import contextlib
import math
import time

import torch
import torch.distributed as dist

from lab import fail, flags, watch
from lab.policy import base_velocity_fn, make_velocity_fn as velocity
from lab.run import GRID_IMAGES, Preempted, Ranks, UpdateCut, all_max, all_mean, any_rank, checked, \
    eval_noise_generator
from methods.base import UpdateContext
from sampler import ode_sample, sigma_schedule


class Harness:
    """One rank's view of the run for an iteration: its data, the policy's forwards, the rewards, the update's
    context and the iteration's metrics. `check_stop` (lab.run.Run.check_stop) runs before every transformer call
    of a rollout and every reward batch: a stop asked then drops the iteration before it changes anything."""

    def __init__(self, args, policy, reward_models, run, prompts, eval_prompts, rank, world, distributed):
        self.args, self.policy, self.reward_models, self.run = args, policy, reward_models, run
        self.prompts, self.eval_prompts = prompts, eval_prompts
        self.rank, self.world, self.distributed = rank, world, distributed
        self.ranks = Ranks(world, distributed) if distributed else None  # (a method's collectives)
        self.sigmas = sigma_schedule(args.num_steps, args.shift, args.sigma_grid)  # (N + 1,)
        self.weights = torch.tensor(list(reward_models.weights.values()))  # (R,) the --rewards weights
        self.check = None  # the first update's self-checks (FirstUpdateChecks), until an update has run them
        self.started, self.times, self.metrics, self.notes = time.time(), {}, {}, set()

    # ---- 1. prompts and noise, keyed by (seed, iteration, global prompt position): the same on any rank count at a
    # fixed --prompts-per-iteration (its default, one a rank, grows with the ranks) ----
    def batch(self, it, per_slot=1):
        """This rank's prompts of iteration `it` and their global positions; with `per_slot` P, P candidates for
        each of its prompts (slot b's: b P .. (b + 1) P - 1)."""
        global_batch = self.args.global_batch(self.world)
        return batch_prompts(self.prompts, self.args.seed, it, global_batch * per_slot, self.rank,
                             global_batch // self.world * per_slot)

    def generators(self, it, positions):
        return generators(self.args.seed, it, positions)

    def note(self, line: str):
        """A method's line for the user, said once (rank 0)."""
        if line not in self.notes:
            self.notes.add(line)
            self.run.log(f"note: {line}")

    def encode(self, prompts):
        return self.policy.adapter.encode(prompts)

    def noise(self, generators):
        """Standard normal latents, one from each generator: (n, ...)."""
        return self.policy.adapter.noise(generators, self.args.size)

    # ---- 2. the policy's forwards ----
    def velocity(self, cond):
        """The rollout's velocity: the current policy, no gradients asked."""
        return checked(self.run.check_stop, velocity(self.args, self.policy, self.policy.transformer, cond))

    def image_only_velocity(self, cond):
        """The velocity of the forwards that only make images to score: with --rollout-precision fp8 the FP8 copy,
        else None (the rollout's)."""
        if self.policy.fp8 is None:
            return None
        return checked(self.run.check_stop, velocity(self.args, self.policy, self.policy.fp8.module, cond))

    def ode_images(self, it, prompts, positions):
        """The final latents of deterministic (ODE) rollouts of the current policy, each from the noise its prompt
        would train with: (n, ...)."""
        noise = self.noise(self.generators(it, positions))  # (n, ...)
        return ode_sample(self.velocity(self.encode(prompts)), noise, self.sigmas, max_batch=self.args.max_batch)

    # ---- 3. rewards ----
    @torch.no_grad()
    def score(self, latents, prompts):
        """Decode latents (M, ...) in micro-batches and score them with every reward model: (M, R)."""
        scores, n = [], self.args.reward_batch_size
        for i in range(0, latents.shape[0], n):
            self.run.check_stop()
            images = self.policy.adapter.decode(latents[i : i + n], self.args.size)
            scores.append(torch.stack([fn(images, prompts[i : i + n]).cpu()
                                       for fn in self.reward_models.fns.values()], -1))
        return torch.cat(scores)  # (M, R)

    def score_rollout(self, rollout, prompts):
        """Every completion's rewards, (B, J, K, G, R) (the rollout's order, the reward models last), and the
        iteration's reward metrics: the mean per reward (and granularity), and the anchor's (logged only)."""
        self.times["rollout"] = time.time()
        B, J, K, G = rollout.final_latents.shape[:4]
        scores = self.score(rollout.final_latents.flatten(0, 3), [p for p in prompts for _ in range(J * K * G)])
        scores = scores.view(B, J, K, G, -1)  # (B, J, K, G, R)
        self.warn_if_constant(scores)
        self.metrics = {}
        for r, name in enumerate(self.reward_models.fns):
            self.metrics[f"train/reward/{name}"] = float(scores[..., r].mean())
            for j, g in enumerate(rollout.granularities):
                self.metrics[f"train/reward/{name}/g{g}"] = float(scores[:, j, ..., r].mean())
        if rollout.anchor_final is not None:
            anchor = self.score(rollout.anchor_final, prompts)  # (B, R)
            self.metrics.update({f"train/anchor_reward/{name}": float(anchor[:, r].mean())
                                 for r, name in enumerate(self.reward_models.fns)})
        return scores

    def warn_if_constant(self, scores):
        """A reward that gives every member of every group of this rank the same score gives every advantage 0, so
        it trains nothing: said once a reward (e.g. prompts the tiny world's reward cannot read score 0 alike)."""
        spread = scores.amax(3) - scores.amin(3)  # (B, J, K, R): each group's range
        for r, name in enumerate(self.reward_models.fns):
            if bool(torch.isfinite(spread[..., r]).all()) and not bool(spread[..., r].any()) and \
                    ("constant", name) not in self.notes:
                self.notes.add(("constant", name))
                value = float(scores[0, ..., r].max())
                self.run.log(f"\nwarning: every group's rewards under {name} are equal ({value:g}) in this iteration, so "
                             f"its advantages are 0 and it trains nothing; check that {name} can score these prompts")

    # ---- 5. the update, and what follows it ----
    def update(self, method, it, cond, rollout, advantages, scores, generators):
        """The method's update, on every rank or (when a rank's rewards are not finite) on none; the first one
        self-checked; then the FP8 copy refreshed (a full fine-tune) and the EMA moved. Returns its statistics."""
        self.times["scores"] = time.time()
        policy, args = self.policy, self.args
        finite = not any_rank(not bool(torch.isfinite(scores).all()), self.distributed)
        if finite:
            ctx = UpdateContext(velocity(args, policy, policy.model, cond), policy.params, policy.optimizer,
                                self.sigmas, generators, base_velocity_fn(args, policy, cond), self.ranks, it)
            if self.check is not None:
                self.check.before(method, ctx.velocity_fn, rollout)
            stats = method.update(rollout, advantages.to(rollout.final_latents.device), ctx)
            if self.check is not None:
                self.check.after(stats)
            if policy.fp8 is not None and args.full and stats["optimizer_steps"]:
                policy.fp8.refresh()  # the full fine-tune's new weights, quantized for the next rollout
                stats["fp8_refresh_s"] = policy.fp8.refreshed_s
        else:
            stats = {"optimizer_steps": 0, "skipped_steps": method.optimizer_steps(len(rollout.sde_steps))}
        if policy.ema is not None and stats["optimizer_steps"]:  # weights that did not move add nothing to average
            policy.ema.update(it + 1)
        self.times["update"], self.finite = time.time(), finite
        return stats

    def iteration_metrics(self, method, batch, rollout, stats):
        """The iteration's metrics: rewards, the update's statistics (losses/*), faults, forwards and times."""
        forwards = self.policy.adapter.forwards_per_velocity * self.world  # image-forwards, on all ranks
        t0, t1, t2, t3 = self.started, self.times["rollout"], self.times["scores"], self.times["update"]
        return {**self.metrics,
                **{f"losses/{k}": v for k, v in stats.items()
                   if k not in ("skipped_steps", "optimizer_steps", "fp8_refresh_s")},
                **({"time/fp8_refresh": stats["fp8_refresh_s"]} if "fp8_refresh_s" in stats else {}),
                "faults/skipped_steps": stats["skipped_steps"], "faults/nonfinite_rewards": float(not self.finite),
                "perf/optimizer_steps": stats["optimizer_steps"],
                "perf/nfe": (rollout.nfe + batch.nfe) * forwards,  # the rollouts', and choosing the prompts'
                "perf/update_nfe": method.update_nfe(rollout) * forwards,  # forwards with gradients
                "perf/image_only_nfe": rollout.image_only_nfe * forwards,
                "perf/calls": rollout.calls, "time/rollout": t1 - t0, "time/decode_and_reward": t2 - t1,
                "time/update": t3 - t2, "time/iteration": t3 - t0, **(batch.metrics or {})}


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
def held_out_eval(h, seeds=None, common=0):
    """Held-out reward of the deterministic (ODE) images on `seeds` fixed seeds a prompt (default --eval-seeds);
    with an EMA, of the EMA weights. Encodes, samples, decodes and scores --max-batch items at a time, so no phase
    of it needs more memory than a rollout call. Returns metrics (`eval_metrics`) and up to GRID_IMAGES of this
    rank's images (on the CPU). `h`: the harness (its check_stop runs before every transformer call)."""
    args, policy, rank, world = h.args, h.policy, h.rank, h.world
    seeds = seeds or args.eval_seeds
    items = eval_items(len(h.eval_prompts), args.eval_prompts, seeds)
    per_rank = -(-len(items) // world)
    mine = items[rank * per_rank : (rank + 1) * per_rank]
    valid = len(mine)
    mine = mine + [items[-1]] * (per_rank - valid)  # equal work on every rank (FSDP forwards are collective)
    fns = eval_scores(h)
    per_seed = torch.zeros(len(fns), seeds, 3, dtype=torch.float64)  # (R, seeds, (sum, count, sum of squares))
    small = torch.zeros(len(mine), 3, 32, 32)  # every image, small, for the diversity over seeds
    grid = []
    with policy.ema.swapped() if policy.ema is not None else contextlib.nullcontext():
        for start in range(0, len(mine), args.max_batch):
            chunk = mine[start : start + args.max_batch]
            for i, images in eval_images(h, chunk):
                batch = chunk[i : i + len(images)]
                small[start + i : start + i + len(batch)] = torch.nn.functional.interpolate(
                    first_frame(images).float().cpu(), size=(32, 32), mode="area")
                for r, fn in enumerate(fns.values()):
                    scores = fn(images, [h.eval_prompts[p] for p, _ in batch]).cpu()  # (b',)
                    for n, ((_, s), v) in enumerate(zip(batch, scores)):
                        if start + i + n < valid:  # not a padding item
                            per_seed[r, s] += torch.tensor([float(v), 1.0, float(v) ** 2], dtype=torch.float64)
                if len(grid) < GRID_IMAGES:  # as bytes: 24 videos of 81 frames would hold gigabytes in fp32
                    grid.extend((images[: GRID_IMAGES - len(grid)] * 255).round().byte().cpu())
    if h.distributed:
        dist.all_reduce(per_seed)
        shares = [torch.zeros_like(small) for _ in range(world)]
        dist.all_gather(shares, small)
        small = torch.cat(shares)
    every = small[: len(items)]  # each rank's share in order, its padding past the end
    metrics = eval_metrics(per_seed, list(fns), every, torch.tensor([p for p, _ in items]), seeds, common)
    return metrics, torch.stack(grid[:valid]) if valid else torch.empty(0)


def eval_scores(h):
    """What scores each held-out image: every reward (reward/*), the held-out rewards (heldout/*, --eval-rewards),
    and the per-image statistics of the reward-hacking watch (stats/*)."""
    period = getattr(h.policy.adapter.pipe, "vae_scale_factor", 8) * 2  # pixels of one latent patch
    return {**{f"reward/{name}": fn for name, fn in h.reward_models.fns.items()},
            **{f"heldout/{name}": fn for name, fn in h.reward_models.held_out.items()},
            "stats/saturation": lambda images, prompts: watch.saturation(first_frame(images)),
            "stats/grid": lambda images, prompts: watch.grid_energy(first_frame(images), period)}


def eval_images(h, chunk):
    """The ODE images of the held-out (prompt, seed) pairs of `chunk`, decoded --reward-batch-size at a time:
    yields (the position of the first in `chunk`, images (b, 3, H, W))."""
    args, policy = h.args, h.policy
    cond = policy.adapter.encode([h.eval_prompts[p] for p, _ in chunk])
    noise = policy.adapter.noise([eval_noise_generator(p, s) for p, s in chunk], args.size)  # (b, ...)
    velocity_fn = checked(h.run.check_stop, velocity(args, policy, policy.transformer, cond))
    x0 = ode_sample(velocity_fn, noise, h.sigmas, max_batch=args.max_batch)
    for i in range(0, len(chunk), args.reward_batch_size):
        yield i, policy.adapter.decode(x0[i : i + args.reward_batch_size], args.size)  # (b', 3, H, W)


def eval_metrics(per_seed, keys, small, prompt_of, seeds, common=0):
    """An evaluation's metrics from its per-seed sums (R, seeds, 3) of the scores `keys` and its small images: each
    mean with its standard error over the images and the std of the per-seed means; with `common` < seeds also each
    mean over the first `common` seeds, as eval/common/* (the seeds the run's first and last evaluations share);
    and the diversity over seeds of each prompt's images."""
    metrics = {}
    spread = watch.diversity(small, prompt_of)  # (prompts with 2 or more seeds,)
    if len(spread):
        metrics["eval/stats/diversity"] = float(spread.mean())
        metrics["eval/stats_se/diversity"] = float(spread.std()) / len(spread) ** 0.5 if len(spread) > 1 else 0.0
    for r, key in enumerate(keys):
        means = per_seed[r, :, 0] / per_seed[r, :, 1].clamp_min(1)  # (seeds,)
        kind, name = key.split("/", 1)
        total, count, squares = per_seed[r].sum(0).tolist()
        metrics[f"eval/{key}"] = total / count
        metrics[f"eval/{kind}_seed_std/{name}"] = float(means.std()) if seeds > 1 else 0.0
        # the standard error of that mean from the images alone: sqrt(var / n) (for a pass rate, sqrt(p (1 - p) / n))
        metrics[f"eval/{kind}_se/{name}"] = max(squares / count - (total / count) ** 2, 0.0) ** 0.5 / count**0.5
        if 0 < common < seeds:
            shared_total, shared_count, _ = per_seed[r, :common].sum(0).tolist()
            metrics[f"eval/common/{key}"] = shared_total / shared_count
    return metrics


class Stopped(Exception):
    """A stop that has written its checkpoint and said its line: the loop ends there."""


def train_loop(h, method, iteration_fn, config, start):
    """Iterations `start` .. --num-iterations of `iteration_fn(it)` (train.iteration), with everything around
    them: the held-out evaluations (the first before training, every --eval-every, the last) and the
    reward-hacking watch on them, metrics, checkpoints, the stops a signal asks for (during a rollout or its
    scoring: the iteration is dropped; during the update: cut at an optimizer step) and the closing lines."""
    from tqdm import tqdm

    args, run = h.args, h.run
    evaluations, saves = Evaluations(h), Saves(h, method, config, start)
    try:
        before = evaluations.before_training(start)
        if start == args.num_iterations:  # every iteration ran, but a stop came before the final evaluation
            return closing_lines(h, before, evaluations.final(start))
        h.check = FirstUpdateChecks(args, h.policy, h.sigmas, run.log, h.distributed) if args.gradient_check else None
        bar = tqdm(range(start, args.num_iterations), initial=start, total=args.num_iterations,
                   disable=not run.master, dynamic_ncols=True)
        metrics = {}
        for it in bar:
            with dropped_on_stop(h, method, saves, it, bar.close):
                h.started, run.steps_taken = time.time(), 0  # (the update's optimizer steps, for a stop that cuts it)
                metrics = iteration_fn(it)
            metrics = all_mean(metrics, h.distributed)
            if not metrics["faults/nonfinite_rewards"]:
                h.check = None  # it ran with this iteration's update
            faulty, done = run.count_faults(metrics), it + 1
            hacked = evaluations.after(done, metrics, bar)  # (its metrics join the iteration's)
            run.write_metrics(done, metrics)
            run.stop_after_too_many_faults()
            bar.set_postfix(reward=f"{metrics[evaluations.first_reward]:.4f}",
                            loss=f"{metrics.get('losses/loss', 0):.2e}", s_it=f"{metrics['time/iteration']:.1f}")
            saves.after(done, faulty, hacked, bar.close)
        bar.close()
    except Stopped:
        return
    if run.optimizer_steps == 0 and run.skipped_steps:  # (an update that trains nothing is no fault)
        raise SystemExit(f"error: no optimizer step succeeded in iterations {start}..{args.num_iterations}; "
                         f"nothing was learned (see faults/* in metrics.jsonl)")
    if h.distributed:
        run.check_ranks_agree(h.policy.params)
    closing_lines(h, before, metrics)


@contextlib.contextmanager
def dropped_on_stop(h, method, saves, it, close_bar):
    """Iteration it + 1, dropped when a stop comes in it: the method's state as iteration `it` left it is put back
    (the rerun of the iteration moves it again), the checkpoint of iteration `it` written unless it is on disk, the
    stop's line said, and `Stopped` raised. A stop during the rollout or its scoring finds the weights still those of
    iteration `it`; one during the update (under torchrun: at an optimizer step, UpdateCut) finds them partly moved."""
    held, run = method.state_dict(), h.run
    try:
        yield
    except UpdateCut as cut:
        close_bar()
        method.load_state_dict(held)
        if it > saves.saved:  # the state of iteration `it` is gone from memory: these weights, cut short, stand for it
            saves(it)
            line = (f"the checkpoint of iteration {it} is written with the first {cut.steps} optimizer steps of "
                    f"iteration {it + 1} in it (which reruns in full on --resume)")
        elif it:  # the state of iteration `it` is on disk already: nothing to write
            line = (f"the checkpoint of iteration {it} on disk is kept and these steps dropped (iteration "
                    f"{it + 1} reruns on --resume)")
        else:
            line = "no iteration was complete: nothing is saved"
        run.stopped(it, f"stopped during iteration {it + 1}'s update, after {cut.steps} optimizer steps; {line}; "
                        f"continue with the same command plus --resume")
        raise Stopped from None
    except Preempted:
        close_bar()
        method.load_state_dict(held)
        if it > saves.saved:
            saves(it)
        written = "written" if it else "none: no iteration was complete"
        run.stopped(it, f"stopped during iteration {it + 1}, before its update (it reruns on --resume); the "
                        f"checkpoint of iteration {it} is {written}; continue with the same command plus --resume")
        raise Stopped from None


class Saves:
    """The run's checkpoints: `saved`, the iteration of the newest (0: none yet); a call saves one."""

    def __init__(self, h, method, config, start):
        self.h, self.method, self.config, self.saved = h, method, config, start

    def __call__(self, done):
        policy, args = self.h.policy, self.h.args
        self.h.run.save(done, policy.model, policy.transformer, policy.optimizer, self.config,
                        policy.adapter.pipeline_class, policy.params, policy.ema, final=done == args.num_iterations,
                        states=self.method.state_dict() or None)
        self.saved = done

    def after(self, done, faulty, hacked, close_bar):
        """After iteration `done`: its checkpoint when one is due (every --checkpoint-every, the last, a stop), but
        none from a faulty iteration, so that the last good one survives the rotation; at the last iteration, a
        faulty one is saved if its weights are finite (`last_faulty`). A stop (a signal, or the watch under
        --stop-on-hacking) then says its line and raises `Stopped`."""
        h, args, run = self.h, self.h.args, self.h.run
        signalled = run.should_stop()
        # (after a resume rank 0 alone reads the first evaluation's metrics back, so it alone may see the watch fire)
        hacking = not signalled and any_rank(bool(hacked) and args.stop_on_hacking, h.distributed)
        stop = signalled or hacking
        if (done % args.checkpoint_every == 0 or done == args.num_iterations) and not faulty or stop:
            self(done)
        elif done == args.num_iterations:
            self.last_faulty(done)
        if stop:
            close_bar()
            run.hacking_stop = hacking
            run.stopped(done, f"stopped after iteration {done}" + (
                ": the reward-hacking watch fired (--stop-on-hacking); look at samples/, then continue with --resume "
                "and --no-stop-on-hacking or wider --watch-* limits" if hacking else
                "; continue with the same command plus --resume"))
            raise Stopped

    def last_faulty(self, done):
        """The last iteration was faulty (its rewards, loss or gradients not finite: its update skipped). Its
        weights and the method's state are saved if they are finite on every rank, as a skipped update leaves them;
        else nothing is, and the run stops with one line naming the newest good checkpoint."""
        from lab.checkpoint import latest_checkpoint

        h = self.h
        tensors = [*h.policy.params, *(t for part in self.method.state_dict().values() for t in part.values())]
        local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
        finite = not any_rank(not all(bool(torch.isfinite(t).all()) for t in local if t.is_floating_point()),
                              h.distributed)
        if finite:
            self(done)
            h.run.log(f"note: iteration {done}, the last, was faulty and its update skipped (faults/* in "
                      f"metrics.jsonl); its checkpoint holds the weights the last step taken left")
            return
        newest = latest_checkpoint(h.run.out, log=lambda *a: None, set_aside=False) if h.run.master else None
        raise SystemExit(f"error: after iteration {done}, the last, the weights or the method's state are not "
                         f"finite, so nothing of it is saved; the newest good checkpoint is "
                         f"{newest or 'none (lower --checkpoint-every to keep one)'}")


class Evaluations:
    """A run's held-out evaluations: the first before training (of the base model), one every --eval-every and the
    last, each with its images saved, its metrics written and the reward-hacking watch on it. The first and last,
    which a run's result is read from, may take more seeds than the rest (the first its own number: a bench of many
    runs from one base evaluates that base once)."""

    def __init__(self, h):
        args, prompts = h.args, h.eval_prompts
        self.h = h
        self.first = args.first_eval_seeds or args.final_eval_seeds or args.eval_seeds
        self.last = args.final_eval_seeds or args.eval_seeds
        self.shown = min(args.eval_prompts or len(prompts), len(prompts))  # prompts per seed in the grids
        self.captions = [f"{prompts[p]} (seed {s})" for p, s in eval_items(len(prompts), args.eval_prompts,
                                                                           args.eval_seeds)]
        self.limits = watch.Limits(saturation=args.watch_saturation, grid=args.watch_grid,
                                   diversity=args.watch_diversity, z=args.watch_z)
        self.first_reward = f"train/reward/{next(iter(h.reward_models.fns))}"
        self.baseline = {}  # what the watch compares each evaluation with: the first's metrics

    def take(self, seeds=None):
        """One evaluation: its metrics, with its seconds (time/evaluation), and its images."""
        started = time.time()
        common = min(self.first, self.last) if seeds in (self.first, self.last) else 0
        metrics, images = held_out_eval(self.h, seeds, common=common)
        return {**metrics, "time/evaluation": time.time() - started}, images

    def before_training(self, start):
        """The first evaluation's metrics: taken now (start 0), or read back from the run's metrics."""
        run = self.h.run
        if start == 0:
            try:
                before, images = self.take(self.first)
            except Preempted:
                run.log("stopped before the first iteration; nothing to save: rerun the same command plus --resume")
                raise Stopped from None
            run.save_grid(images, 0, self.shown, self.captions)
            run.write_metrics(0, before)
        else:
            before = run.resume_metrics(start)
            added = [name for name in self.h.reward_models.held_out if f"eval/heldout/{name}" not in before]
            if added and before:
                run.log(f"note: the first evaluation has no held-out {', '.join(added)} (added since): the "
                        f"reward-hacking watch takes its baseline from the next evaluation")
        self.baseline = dict(before)
        return before

    def final(self, done):
        """The last evaluation, of a run whose iterations all ran before a stop: its metrics."""
        try:
            metrics, images = self.take(self.last)
        except Preempted:
            self.h.run.stopped(done, "stopped during the final evaluation; continue with the same command plus "
                                     "--resume")
            raise Stopped from None
        self.h.run.save_grid(images, done, self.shown, self.captions)
        self.h.run.write_metrics(done, metrics)
        return metrics

    def after(self, done, metrics, bar):
        """After iteration `done`: its evaluation when one is due (every --eval-every and the last, unless a stop is
        asked) and the reward-hacking watch on it, their metrics added to `metrics`. Returns what the watch found
        (a stop during the evaluation leaves the iteration whole, saved without it)."""
        args, run = self.h.args, self.h.run
        if not (done % args.eval_every == 0 or done == args.num_iterations) or run.should_stop():
            return []
        try:
            eval_metrics, images = self.take(self.last if done == args.num_iterations else None)
        except Preempted:
            return []
        metrics.update(eval_metrics)
        run.save_grid(images, done, self.shown, self.captions)
        # the reward-hacking watch: the trained rewards' change since the first evaluation against the held-out
        # ones' and the image statistics'
        for key in [k for k in eval_metrics if k.startswith("eval/heldout") and k not in self.baseline]:
            self.baseline[key] = eval_metrics[key]  # a held-out reward added on resume: its first value
        hacked, watched = watch.check(self.baseline, eval_metrics, self.limits)
        metrics.update(watched)
        if hacked:
            bar.clear()
            run.log(f"warning: reward hacking? from iteration 0 to {done}, {hacked[0]}; look at samples/ "
                    f"(--stop-on-hacking stops here)")
        return hacked


def closing_lines(h, before, metrics):
    """The run's result (rank 0): the first evaluation against the last, and on the tiny model where it stands."""
    if h.run.master and before and metrics:
        h.run.summary(before, metrics, h.reward_models.fns, h.reward_models.held_out)
        if h.args.model == "tiny" and "eval/heldout/shapes-strict" in metrics:  # where the quick start stands
            from lab import tiny

            h.run.log(tiny.quick_start_standing(metrics["eval/heldout/shapes-strict"],
                                                flags.changed_from_preset(h.args)))


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

    def before(self, method, update_velocity, rollout):
        # the method's loss on its first sample (for an SDE step: the log-likelihood of the first prompt's members
        # at its first trained step), through the update's path
        loss_fn = method.check_loss(update_velocity, rollout, self.sigmas)
        if isinstance(loss_fn, str):
            self.log(f"gradient self-check skipped: {loss_fn}")
            return
        result = self.policy.adapter.kernels.check_gradient(loss_fn, self.policy.params)
        if not result.ok:
            raise SystemExit(f"error: gradient self-check failed: {result.message}")
        self.log(f"gradient self-check passed: {result.message}")

    def after(self, stats):
        if "first_ratio_error" not in stats:  # a method whose update takes no ratio
            return
        error, clip = stats["first_ratio_error"], self.args.clip_range
        # -1: no member of this rank scored the first step (its share of randomly drawn steps can be empty)
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


def restore(run, method, policy, resume_from, config):
    """Load a checkpoint into the policy (weights and AdamW state), its EMA and the method's state, and apply,
    refuse or report the flags changed since (lab.run.Run.resumed_flags)."""
    from lab import checkpoint

    # (a sharded load reads each named state into tensors of the shapes given)
    extra = {**({"ema": policy.ema.tensors()} if policy.ema is not None else {}), **method.state_dict()}
    state = checkpoint.load(resume_from, policy.model, policy.transformer, policy.optimizer, not run.args.full,
                            extra=extra or None)
    method.load_state_dict({name: s for name, s in state["extra"].items() if name != "ema"})
    if policy.ema is not None:
        if "ema" not in state["extra"]:
            fail(f"{resume_from} holds no EMA weights; resume without --ema-decay or start a new run")
        policy.ema.load_state_dict(state["extra"]["ema"])
    run.resumed_flags(state["config"], config, policy.optimizer)


def fp8_copy(policy, dtype, log):
    """With --rollout-precision fp8: the FP8 copy of the transformer that the image-only forwards run on, from the
    weights the run starts with (after a resume, the loaded ones)."""
    from lab.kernels import Float8Copy

    policy.fp8 = Float8Copy(policy.transformer)
    log(f"FP8 rollout copy: {len(policy.fp8.names)} linear layers of the blocks quantized in "
        f"{policy.fp8.refreshed_s:.1f} s; the trained steps and the update stay in "
        f"{str(dtype).removeprefix('torch.')}")
