"""The method interface: everything train.py asks of a method, with the defaults a method may leave alone, and the
small parts of an update that every method shares.

A method is a dataclass derived from `Method`. Its fields are the values it reads: the run's flags every method
reads (declared once, here), the run's flags it reads besides (--sde-steps, --num-steps, --seed: declared in its
class, documented in lab/flags.py), then its own flags, each with a docstring, which train.py puts on its command
line under that --method (`python train.py --method NAME --help` lists them). Its values on each model open its
file. One iteration asks it, in order (the four without a default are the method):

    prompts(it, data) -> Batch        which prompts it trains on (default: the shuffled data order)
    initial_noise(draw, generators)   x_T: one per prompt (B, ...), default, or one per member (B, G, ...)
    trained_steps(it)                 the steps of the schedule it trains in iteration `it`: SDE steps, or a method
                                      that samples none (DiffusionNFT) its training timesteps; [] trains nothing
    rollout(velocity_fn, noise, sigmas, generators, steps, image_only_fn) -> sampler.Rollout
    advantages(scores (B, J, K, G, R), weights (R,), ranks, rollout) -> (B, K or 1, G)
    update(rollout, advantages (B, K, G), ctx: UpdateContext) -> statistics (`update_stats`)

its state, and its checks:

    state_dict(), load_state_dict()   its state across iterations, saved in every checkpoint ({name: {key: tensor}},
                                      each a file of the checkpoint) and restored on --resume; state it moves before
                                      its update is restored by the loop when a stop drops the iteration
    start(trained)                    once, before training or a resume: the trained parameters, by name, for a
                                      method that keeps a copy of them (an old or EMA policy)
    problem(num_steps)                why its values cannot run, in one line, or None (checked before anything loads)
    notes(sigmas)                     lines worth saying before the run starts
    check_loss(velocity_fn, rollout, sigmas)
                                      the loss the first update's gradient self-check compares kernels on, or a
                                      one-line reason why there is none

and, apart (`Costs`), what the tools and the metrics count, whose defaults fit a method that forwards each start
latent once per trained step and inner epoch: optimizer_steps(K), update_nfe(rollout), cost_iterations(),
anchor_candidates and for_planning().

Class attributes: `label` (its name in tables: the bench's rows); `values_from` (whose values its flags' defaults
are, for the bench's table); `per_step_advantages` (each trained step has its own advantage, so --step-credit can
move them); `recipe` (the run's flags it sets on every --model) and `presets` ({model: values} on top of it, e.g.
its published FLUX sizes), both at the top of its file; `per_steps` (values that follow the run's N, as functions of
N); `legacy` (the axes a configuration written before methods had files of their own held for it, checked on
resume); `retired_flags` (its own flags that every run had before it owned them, with the value that left them
off: a checkpoint of another method with another value is refused on resume); `unread` (the run's flags of
`Method`'s fields it never reads, with why: given, they are refused; --sde-steps is refused under a method without
that field); `non_finite` (its own float flags that may be nan or inf, with why: every other float flag of its own
must be finite, one rule for every method that lab/flags.py checks before `problem`, whose comparisons nan passes).

A method whose KL term takes the base model at another guidance than the run's names it in
`base_guidance(guidance)` (Flow-DPPO's --kl-guidance); the loop runs `UpdateContext.base_velocity_fn` at it.

An update that scores SDE steps runs its loss through `step_backward`, the one loop that forwards a step's start
latents in micro-batches, scores their members with the method's `step` and back-propagates; a method brings its
loss as a short function. A method built around another (AdaGRPO) forwards what it does not change with
`delegate`.

A method that scores no SDE step rolls out with `ode_rollout` (final latents only, no log-probability) and keeps
its old or EMA policy as a `FrozenCopy` of the trained weights, its state (methods/diffusionnft.py).

A new method is a file in methods/ and a line in methods/__init__.py's registry; docs/methods.md walks one through.

Shapes: B prompts, G group size, K trained steps, S start latents per prompt and step (1: G2RPO's anchor; G: one
per member), (...) a latent.
"""
import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Literal

import torch

from advantage import integrate
from sampler import SDE_TYPES, cps_kl, gaussian_step, sde_kl, sde_std_dev, step_mean_std


@dataclass
class Batch:
    """This rank's prompts of an iteration: the prompts, their global positions (which key their noise), the
    forwards spent choosing them, and what the choice logs."""

    prompts: list
    positions: list
    nfe: int = 0
    metrics: dict = None


@dataclass
class UpdateContext:
    """What an update works with besides the rollout and its advantages.

    velocity_fn(x, sigma, prompt_index): the policy's velocity, with gradients (through DDP / FSDP2)
    params, optimizer: the trained parameters and their AdamW
    sigmas: the schedule (N + 1,); generators: one CPU generator per prompt, for an update's own draws
    base_velocity_fn: the base model's velocity, for the KL term (None without one)
    ranks: None in one process, or the run's ranks: .world, .sum(n), .max(n), .gather(tensor)
    iteration: the iteration (0-based), for a method's schedules
    base_guidance: the guidance base_velocity_fn runs at, the method's `base_guidance` (None: the run's --guidance)
    """

    velocity_fn: Callable
    params: list
    optimizer: torch.optim.Optimizer
    sigmas: torch.Tensor
    generators: list = None
    base_velocity_fn: Callable = None
    ranks: object = None
    iteration: int = 0
    base_guidance: float = None


class Costs:
    """What the tools and the metrics count of a method (tools/bench.py's budget and table, tools/plan.py's upper
    bound, perf/update_nfe), with defaults that fit a method whose update forwards each start latent once per
    trained step and inner epoch, one optimizer step each: a new method writes none of these unless it differs."""

    anchor_candidates = 0  # candidates per trained prompt whose ODE image `prompts` scores (their cost)

    def optimizer_steps(self, num_trained_steps):
        """The optimizer steps of one update over K trained steps."""
        return self.inner_epochs * num_trained_steps

    def update_nfe(self, rollout):
        """The forwards of one update: one with gradients per start latent, trained step and inner epoch."""
        B, K, S = rollout.start_latents.shape[:3]
        return B * S * K * self.inner_epochs

    def cost_iterations(self):
        """The iterations whose rollouts' mean cost is a run's: the first, or one per position of a moving window."""
        return [0]

    def for_planning(self):
        """A copy whose update does the most work it can (tools/plan.py's upper bound)."""
        return self


@dataclass
class Method(Costs):
    """The interface, with its defaults. The fields are the run's flags every method reads."""

    group_size: int
    """G, samples per prompt."""
    eta: float
    """eta, the SDE noise level."""
    clip_range: float
    """epsilon of the clipped ratio."""
    adv_clip_max: float
    """Advantages are clamped to +- this."""
    max_grad_norm: float
    """Gradient-norm clip."""
    max_batch: int
    """Largest batch of one transformer call."""
    inner_epochs: int
    """Passes of the update over each rollout."""
    kl_beta: float
    """beta, the weight of the KL to the base model."""

    label = "a method"
    values_from = "its authors'"
    per_step_advantages = True
    recipe, presets, per_steps, legacy, retired_flags = {}, {}, {}, {}, {}
    unread = {}  # {flag: why}: the fields above it never reads (a run that gives one is refused)
    non_finite = {}  # {flag: why}: its own float flags that may be nan or inf (every other one must be finite)

    def problem(self, num_steps):
        return None

    def notes(self, sigmas):
        return []

    def start(self, trained):
        """trained: [(name, parameter)] of the policy. Default: nothing to keep."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict):
        pass

    # ---- what every method defines ----
    def trained_steps(self, iteration):
        """The SDE steps trained in iteration `iteration` ([] for a method that trains none)."""
        raise NotImplementedError

    def rollout(self, velocity_fn, noise, sigmas, generators, steps, image_only_fn=None):
        """The rollout from `noise` (`initial_noise`'s), no gradients: a `sampler.Rollout`."""
        raise NotImplementedError

    def advantages(self, scores, weights, ranks=None, rollout=None):
        """scores (B, J, K, G, R) and the reward weights (R,) -> advantages (B, K or 1, G); the rollout they score
        is there for a method whose advantage reads it (BranchGRPO's probability-weighted node rewards)."""
        raise NotImplementedError

    def update(self, rollout, advantages, ctx):
        """The policy update on one rollout: advantages (B, K, G), ctx an `UpdateContext`. Returns `update_stats`'
        statistics (at least optimizer_steps and skipped_steps)."""
        raise NotImplementedError

    # ---- the hooks with a default ----
    def prompts(self, it, data) -> Batch:
        """This rank's prompts of iteration `it`: the data order (`data.batch`, lab/loop.py)."""
        return Batch(*data.batch(it))

    def initial_noise(self, draw, generators):
        """x_T, one per prompt, shared by its G members: (B, ...). draw(generators) -> (n, ...), one each."""
        return draw(generators)

    def base_guidance(self, guidance):
        """The guidance the base model's velocity runs at in the KL term, given the run's --guidance: the run's."""
        return guidance

    def check_loss(self, velocity_fn, rollout, sigmas):
        """The log-likelihood of the first prompt's members at its first trained step (`sde_check_loss`)."""
        if not rollout.sde_steps:
            return "this iteration trains no SDE step"
        return sde_check_loss(velocity_fn, rollout, sigmas, self.step)


@dataclass(kw_only=True)
class SDEStep:
    """What every method that samples SDE steps shares: its --sde-type, and the step, mean and KL of that type. A
    method derives from it and from `Method`; its flow step is sampler.sde_step's at its eta, unless it redefines
    `std_dev` (DanceGRPO's constant noise scale). `per_sde_type`: {sde_type: {model: values}}, the values another
    --sde-type sets under --model unless given (the clip range its log-prob's scale needs; a comment names its
    source)."""

    sde_type: Literal[SDE_TYPES] = "flow"
    """The SDE step: flow (the method's Gaussian step) or cps (coefficients-preserving: the noise after a step
    stays the schedule's sigma', std sigma' sin(eta pi / 2), eta in (0, 1]; its log-prob -|x' - mean|^2 drops the
    Gaussian's 1 / (2 std^2), and so does its KL to the base (sampler.cps_kl), so ratios change on another scale:
    --model flux sets the method's CPS clip range)."""

    # no FLUX.1 run of G2RPO, DanceGRPO or MixGRPO with CPS is published: theirs is Flow-GRPO's CPS configs' clip
    # range and eta (`*_fast_nocfg`: 1e-5, 0.8; Flow-Factory's CPS recipes take 1e-4 at the same eta)
    per_sde_type = {"cps": {"flux": dict(clip_range=1e-5, eta=0.8)}}

    def sde_type_problem(self, trained_steps, num_steps, keep_out=None):
        """Why the step type cannot run these values, in one line, or None. trained_steps: every step the method may
        train on a schedule of num_steps (the step into sigma 0 cannot be trained on the CPS step); keep_out: the
        flags that keep that step out of them, for the message (None: --sde-steps without it)."""
        if self.sde_type == "cps" and not 0 < self.eta <= 1:
            return (f"--eta {self.eta} with --sde-type cps: its noise std is sigma' sin(eta pi / 2), so eta lies in "
                    f"(0, 1] (Flow-GRPO-Fast 0.8)")
        if self.sde_type == "cps" and num_steps - 1 in trained_steps:
            if num_steps < 2:
                keep_out = "--num-steps 2 or more"
            elif keep_out is None:
                rest = [k for k in trained_steps if k != num_steps - 1] or [num_steps - 2]
                keep_out = "--sde-steps " + " ".join(map(str, rest))
            return (f"--sde-type cps samples no noise on the last step (into sigma 0), so step {num_steps - 1} "
                    f"cannot be trained; keep it out of the trained steps: {keep_out}")
        return None

    def std_dev(self, sigmas, i):
        """The flow step's noise scale at step i: eta sqrt(sigma / (1 - sigma)) (sampler.sde_std_dev)."""
        return sde_std_dev(sigmas, i, self.eta)

    def mean_std(self, latents, velocity, sigmas, i):
        """(mean, std) of the step from sigmas[i] given x and v, fp32 (sampler.step_mean_std)."""
        std_dev = self.std_dev(sigmas, i) if self.sde_type == "flow" else None
        return step_mean_std(latents.float(), velocity.float(), sigmas, i, std_dev, self.sde_type, self.eta)

    def step(self, latents, velocity, sigmas, i, noise=None, next_latents=None):
        """Sample the step from sigmas[i], or score `next_latents`: (next_latents, log_prob (batch,))."""
        mean, std = self.mean_std(latents, velocity, sigmas, i)
        return gaussian_step(mean, std, noise, next_latents, self.sde_type)

    def kl(self, velocity, base_velocity, sigmas, i):
        """The step's KL to the base model's, per sample (n,): the flow step's Gaussian KL (sampler.sde_kl), or the
        CPS step's mean |mu - mu_ref|^2, without the Gaussian's 1 / (2 std^2), as its log-prob (sampler.cps_kl)."""
        if self.sde_type == "cps":
            return cps_kl(velocity, base_velocity, sigmas, i, self.eta)
        return sde_kl(velocity, base_velocity, sigmas, i, self.std_dev(sigmas, i))


def delegate(to, hooks, properties=()):
    """A class decorator for a method built around another: each of `hooks` (method names) and `properties` that
    the class does not define itself answers as its attribute `to` (the other method) does."""
    def forwarded(name):
        def hook(self, *args, **kwargs):
            return getattr(getattr(self, to), name)(*args, **kwargs)
        hook.__name__ = hook.__qualname__ = name
        return hook

    def wrap(cls):
        for name in hooks:
            if name not in vars(cls):
                setattr(cls, name, forwarded(name))
        for name in properties:
            if name not in vars(cls):
                setattr(cls, name, property(lambda self, name=name: getattr(getattr(self, to), name)))
        return cls
    return wrap


# ---------------------------------------------------------------------------------------------------------------
# What the SDE-step updates share: the members' log-probabilities, the optimizer step, the statistics
# ---------------------------------------------------------------------------------------------------------------
def iteration_generator(seed, iteration):
    """The generator of an iteration's choice of steps (a random window, random SDE steps), the same on every rank."""
    return torch.Generator().manual_seed(seed * 7919 + iteration)  # 7919, a prime: distinct seeds, distinct draws


def per_member_noise(draw, generators, group_size):
    """x_T, one per member, drawn in turn from its prompt's generator: (B, G, ...)."""
    return draw([gen for gen in generators for _ in range(group_size)]).unflatten(0, (len(generators), group_size))


def global_std_advantages(scores, weights, adv_clip_max, ranks=None):
    """Flow-GRPO's advantage, which DiffusionNFT's and AWM's scripts take too: scores (B, 1, 1, G, R), weights (R,)
    -> (B, 1, G). The weighted sum of the raw scores is the one reward (multi_score); each group's mean is
    subtracted, and the std is that of every reward on every rank (population std), + 1e-4."""
    reward = (scores * weights).sum(-1, keepdim=True)  # (B, 1, 1, G, 1)
    every_rank = ranks.gather(reward) if ranks is not None else reward  # (world*B, 1, 1, G, 1)
    std = every_rank.float().std(dim=(0, 3), keepdim=True, correction=0)  # (1, 1, 1, 1, 1), the population std
    r = reward.float()
    # A_i = (R_i - mean_group R) / (std_all R + 1e-4)
    return integrate((r - r.mean(3, keepdim=True)) / (std.to(r.device) + 1e-4), adv_clip_max)  # (B, 1, G)


def member_log_probs(step_fn, start_latents, velocity, targets, sigmas, k):
    """The log-probability of each stored sample under the step from its start latent: start_latents (n, ...) and
    their velocity (n, ...), targets (n, M, ...), the M members that left each start latent. Returns (n, M)."""
    n, members = targets.shape[:2]
    _, log_probs = step_fn(start_latents.repeat_interleave(members, 0), velocity.repeat_interleave(members, 0),
                           sigmas, k, next_latents=targets.flatten(0, 1))  # (n * M,)
    return log_probs.view(n, members)  # (n, M)


def step_backward(method, ctx, rollout, ki, loss_fn, rows=None):
    """The loop every update that scores SDE steps shares: trained step `ki` (an index into rollout.sde_steps), its
    start latents forwarded in micro-batches of at most `method.max_batch` (all B*S of them, or those of `rows`),
    each member's log-probability of its stored sample under `method.step` (the rollout's step), and the
    micro-batch's loss back-propagated at once, so no more activations are held than one micro-batch's.

    loss_fn(rows, x, velocity, log_probs, base) is the method's loss of one micro-batch: rows (n,) index the (B*S,)
    start latents, x (n, ...) are they, velocity (n, ...) the policy's there, log_probs (n, G/S) its members', and
    base() the base model's velocity there (no gradients; for a KL term). It returns (the loss to back-propagate,
    the loss to report, the KL to report, the log-ratios to report). A loss that is not finite is back-propagated
    all the same: its gradient is then not finite either, so the (all-reduced) gradient norm skips the optimizer step
    on every rank alike and the DDP / FSDP2 collectives stay matched. Returns the reported loss and KL, summed, and
    the log-ratios, concatenated (empty when no row is forwarded)."""
    k = rollout.sde_steps[ki]
    B, S = rollout.start_latents.shape[0], rollout.start_latents.shape[2]
    members = rollout.next_latents.shape[2] // S  # members scored by one forward: G from a shared anchor (S = 1)
    start_latents = rollout.start_latents[:, ki].flatten(0, 1)  # (B*S, ...)
    targets = rollout.next_latents[:, ki].unflatten(1, (S, members)).flatten(0, 1)  # (B*S, G/S, ...)
    prompt_index = torch.arange(B, device=start_latents.device).repeat_interleave(S)  # (B*S,)
    if rows is None:
        rows = torch.arange(B * S, device=start_latents.device)  # (B*S,)
    loss, kl, log_ratios = 0.0, 0.0, []
    for micro_batch in rows.split(method.max_batch) if len(rows) else []:
        x, index = start_latents[micro_batch], prompt_index[micro_batch]  # (n, ...), (n,)
        sigma = ctx.sigmas[k].expand(len(micro_batch)).to(x.device)  # (n,)
        velocity = ctx.velocity_fn(x, sigma, index)  # (n, ...)
        # every member of a start latent is scored under the same velocity
        log_probs = member_log_probs(method.step, x, velocity, targets[micro_batch], ctx.sigmas, k)  # (n, G/S)
        base = torch.no_grad()(lambda: ctx.base_velocity_fn(x, sigma, index))  # noqa: B023 (called at once)
        backward_loss, batch_loss, batch_kl, log_ratio = loss_fn(micro_batch, x, velocity, log_probs, base)
        backward_loss.backward()
        loss, kl = loss + batch_loss, kl + batch_kl
        log_ratios.append(log_ratio)
    return loss, kl, torch.cat(log_ratios) if log_ratios else torch.empty(0)


def optimizer_step(params, optimizer, max_grad_norm):
    """Clip the gradient norm and step, unless the norm is not finite (then the parameters stay untouched).
    Returns the gradient norm before clipping."""
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    if math.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def ratio_stats(log_ratio, clip_range):
    """What the ratios r = exp(log_ratio) of the trained members say: approx_kl = mean (log r)^2 / 2, the share
    clipped, and their mean, max and min."""
    ratio = log_ratio.exp()
    return {"approx_kl": float(0.5 * (log_ratio**2).mean()),
            "clipfrac": float(((ratio - 1).abs() > clip_range).float().mean()),
            "ratio_mean": float(ratio.mean()), "ratio_max": float(ratio.max()), "ratio_min": float(ratio.min())}


def update_stats(per_step, grad_norms, per_optimizer_step=False):
    """An update's statistics from its steps' (each a dict of floats, in order, or None where this rank trained no
    member) and its gradient norms: each averaged over the trained steps (loss and kl: over the optimizer steps
    when `per_optimizer_step`, where each entry holds its share of one optimizer step's objective), ratio_max the
    max, ratio_min the min, grad_norm over the steps taken, the counts optimizer_steps and skipped_steps, and
    first_ratio_error: max |r - 1| over the members of the first step scored, before any optimizer step, where the
    policy is still the rollout's and r is 1 up to rounding (nan where this rank scored none there)."""
    first = per_step[0] if per_step else None  # scored before the first optimizer step
    per_step = [s for s in per_step if s is not None]  # (steps no member of this rank trains give None)
    if not per_step:
        per_step = [dict(loss=0.0, kl=0.0, approx_kl=0.0, clipfrac=0.0, ratio_mean=1.0, ratio_max=1.0, ratio_min=1.0)]
    stats = {name: sum(s[name] for s in per_step) / len(per_step) for name in per_step[0]}
    if per_optimizer_step and grad_norms:
        stats.update({name: sum(s[name] for s in per_step) / len(grad_norms) for name in ("loss", "kl")})
    stats["ratio_max"] = max(s["ratio_max"] for s in per_step)
    stats["ratio_min"] = min(s["ratio_min"] for s in per_step)
    stats["first_ratio_error"] = (max(first["ratio_max"] - 1, 1 - first["ratio_min"]) if first is not None
                                  else float("nan"))
    taken = [g for g in grad_norms if math.isfinite(g)]
    stats["grad_norm"] = sum(taken) / len(taken) if taken else float("nan")
    stats["optimizer_steps"], stats["skipped_steps"] = len(taken), len(grad_norms) - len(taken)
    return stats


def sde_check_loss(velocity_fn, rollout, sigmas, step_fn):
    """The loss the gradient self-check (lab/kernels.py) compares kernels on, for every method that scores SDE
    steps: the first prompt's members at its first trained step, scored by one forward, as -mean_i r_i (the
    unclipped surrogate with advantages of one: at the first step r = 1, where a clip's mask would flip on ratio
    differences of 1e-4 that the math kernel's rounding alone makes; and its gradient is the log-likelihood's,
    which no advantage can zero). It draws no random numbers, so it can run under each kernel in turn."""
    k = rollout.sde_steps[0]
    members = rollout.next_latents.shape[2] // rollout.start_latents.shape[2]  # G, or 1 (one start per member)
    start = rollout.start_latents[:1, 0, 0]  # (1, ...)
    targets = rollout.next_latents[:1, 0, :members]  # (1, G/S, ...)
    index = torch.zeros(1, dtype=torch.long, device=start.device)

    def loss_fn():
        velocity = velocity_fn(start, sigmas[k].expand(1).to(start.device), index)  # (1, ...)
        log_probs = member_log_probs(step_fn, start, velocity, targets, sigmas, k)  # (1, G/S)
        ratio = torch.exp(log_probs - rollout.old_log_probs[:1, 0, :members].to(log_probs.device))
        return (-ratio).mean()
    return loss_fn


def check_sde_steps(sde_steps, num_steps):
    """Why a list of trained SDE steps (--sde-steps) cannot run on N steps, in one line, or None."""
    if not sde_steps:
        example = " ".join(map(str, range(max(1, min(4, num_steps - 1)))))  # (not the last: CPS cannot train it)
        return f"--sde-steps is empty; give the steps to branch and train, e.g. --sde-steps {example}"
    if len(set(sde_steps)) != len(sde_steps):
        return f"--sde-steps {sde_steps} repeats a step; list each step once"
    bad = [k for k in sde_steps if not 0 <= k < num_steps]
    if bad:
        return f"--sde-steps {bad} outside the schedule of --num-steps {num_steps}; use steps in 0..{num_steps - 1}"
    return None


# ---------------------------------------------------------------------------------------------------------------
# What the methods that score no SDE step share (DiffusionNFT, AWM): ODE rollouts that keep only the final latents,
# the forward process that noises them again for the update, the flow-matching loss of their self-check, and a
# frozen copy of the trained weights (an old or EMA policy) held as the method's state
# ---------------------------------------------------------------------------------------------------------------
SOLVERS = ("euler", "dpm++2m")  # the ODE solvers of a rollout that keeps only x0 (a method's --rollout-solver)


def dpm_solver_2m(velocity_fn, noise, sigmas, prompt_index):
    """DPM-Solver++(2M) (Lu et al. 2022, arXiv 2211.01095): the second-order multistep solver of the probability-flow
    ODE in its data prediction D = x - s v, one forward a step, on the run's schedule `sigmas` (diffusers' version
    builds its own grid). In this convention (alpha = 1 - s, lambda = log(alpha / s)) a step is
        x' = (s' / s) x + (1 - s' / s) D~,   D~ = D + (h / 2 h_prev) (D - D_prev),   h = lambda(s') - lambda(s)
    and with D~ = D it is exactly the Euler step. The first step has no D_prev and the one after it an infinite h_prev
    (s = 1: lambda = -inf), so both are first order, and so is the last (s' = 0: x' = D), as in diffusers (which, below
    15 steps, also takes the one before the last at first order; this solver does not).
    noise (n, ...), prompt_index (n,) -> x0 (n, ...), fp32."""
    x, previous = noise.float(), None  # x: (n, ...); previous: (D_prev, h_prev)
    # lambda(s) = log((1 - s) / s): -inf at s = 1 (pure noise), +inf at s = 0 (data)
    lam = [math.log((1 - s) / s) if 0 < s < 1 else (-math.inf if s >= 1 else math.inf) for s in sigmas.tolist()]
    for i in range(len(sigmas) - 1):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        # D = x - s v, the model's x0 at this step
        denoised = x - s * velocity_fn(x, sigmas[i].expand(x.shape[0]).to(x.device), prompt_index).float()  # (n, ...)
        if s_next == 0:
            return denoised  # the last step, first order: x0 = D
        h = lam[i + 1] - lam[i]
        # D~ = D + (h / 2 h_prev) (D - D_prev), once a finite previous step exists; else D~ = D (first order)
        target = denoised  # (n, ...)
        if previous is not None and math.isfinite(previous[1]):
            target = denoised + h / (2 * previous[1]) * (denoised - previous[0])  # (n, ...)
        # x' = (s' / s) x + (1 - s' / s) D~
        x = (s_next / s) * x + (1 - s_next / s) * target  # (n, ...)
        previous = (denoised, h)
    return x


@torch.no_grad()
def ode_rollout(velocity_fn, noise, sigmas, max_batch, trained=(), solver="euler"):
    """G deterministic samples per prompt from their own noise (B, G, ...), by `solver` (SOLVERS: the project's Euler
    ODE, sampler.ode_sample, or `dpm_solver_2m`), only the final latents kept: a `sampler.Rollout` with final latents
    (B, 1, 1, G, ...) and no SDE step sampled, so its start, next and log-prob parts are empty; its `sde_steps` are
    the steps of the schedule the update trains at (`trained`)."""
    from sampler import CountingVelocity, Rollout, ode_sample

    B, G = noise.shape[:2]
    forward = CountingVelocity(velocity_fn, max_batch)  # (counts the forwards)
    prompt_index = torch.arange(B, device=noise.device).repeat_interleave(G)  # (B*G,)
    if solver == "dpm++2m":
        x = dpm_solver_2m(forward, noise.flatten(0, 1), sigmas, prompt_index)  # (B*G, ...)
    else:
        x = ode_sample(forward, noise.flatten(0, 1), sigmas, max_batch=max_batch, prompt_index=prompt_index)
    final = x.view(B, 1, 1, G, *noise.shape[2:])  # (B, 1, 1, G, ...)
    empty = final.new_zeros(B, 0, G, *noise.shape[2:])  # (B, 0, G, ...)
    return Rollout(start_latents=empty, next_latents=empty, old_log_probs=final.new_zeros(B, 0, G),
                   final_latents=final, anchor_final=None, sde_steps=list(trained), granularities=[],
                   nfe=forward.nfe, calls=forward.calls)


TIME_SAMPLINGS = ("permuted", "discrete", "discrete_wo_init")  # a method's --time-sampling


def stratified_bins(num_steps, count, fraction, skip_first):
    """The bins [lo, hi) of a stratified draw of `count` indices into the schedule's first int(fraction N) steps:
    the floors of linspace(first, int(fraction N), count + 1), first = 1 without sigma 1 (discrete_wo_init), else 0
    (discrete). AWM's 14 steps, 6 indices, fraction 0.9, without sigma 1: [1,2) [2,4) [4,6) [6,8) [8,10) [10,12)."""
    edges = torch.linspace(1.0 if skip_first else 0.0, int(fraction * num_steps), count + 1).long().tolist()
    return list(zip(edges[:-1], edges[1:]))


def training_timesteps(sampling, generators, group_size, num_steps, count, fraction, micro_batch=1):
    """Which schedule steps each image trains at, drawn from its prompt's generator: (B, G, T) indices.
        permuted: each image its own random order of the N steps (sigma 1 included, the final 0 not), the first
                  T = count of them (DiffusionNFT's script: T = int(0.99 N));
        discrete, discrete_wo_init: one index from each of `stratified_bins` (lo + floor(u (hi - lo)), u uniform),
                  shared by each `micro_batch` consecutive members of a group (AWM's script: its micro-batch of 3).
    """
    out = []
    for gen in generators:
        if sampling == "permuted":
            out.append(torch.stack([torch.randperm(num_steps, generator=gen)[:count] for _ in range(group_size)]))
            continue
        lo, hi = torch.tensor(stratified_bins(num_steps, count, fraction, sampling == "discrete_wo_init")).T  # (T,)
        shared = [lo + (torch.rand(count, generator=gen, dtype=torch.float64) * (hi - lo)).long()
                  for _ in range(-(-group_size // micro_batch))]  # one (T,) draw a micro-batch
        out.append(torch.stack([shared[m // micro_batch] for m in range(group_size)]))  # (G, T)
    return torch.stack(out)  # (B, G, T)


def check_timesteps(sampling, count, fraction, num_steps):
    """Why a draw of training timesteps cannot run on N steps, in one line, or None."""
    if not 0 < fraction <= 1:
        return f"--time-fraction {fraction}: must be in (0, 1] (the share of the schedule the draw covers)"
    if count < 0 or (count or int(fraction * num_steps)) < 1:
        return f"--train-timesteps {count}: must be >= 1, or 0 with --time-fraction x --num-steps >= 1"
    if sampling == "permuted" and count > num_steps:
        return f"--train-timesteps {count}: more than the schedule's --num-steps {num_steps}"
    if sampling != "permuted":
        bins = stratified_bins(num_steps, count or int(fraction * num_steps), fraction, sampling == "discrete_wo_init")
        if any(hi <= lo for lo, hi in bins):
            return (f"--train-timesteps {count}: more bins than the {int(fraction * num_steps)} steps --time-fraction "
                    f"{fraction} of --num-steps {num_steps} covers; take fewer")
    return None


def forward_process(rollout, sigmas, generators, steps=None):
    """Each image of an `ode_rollout` at its training steps, with fresh noise eps from its prompt's generator (drawn
    after `steps`, when those came from it): x_s = (1 - s) x0 + s eps. `steps`: (B, G, T) indices into the schedule,
    each image's own; None: every image at rollout.sde_steps. Returns x0, eps, x_s, the sigma s of each row and its
    prompt index, each (B G T, ...) or (B G T,) in member-major order (row = (b G + m) T + t)."""
    final = rollout.final_latents[:, 0, 0]  # (B, G, ...)
    B, G = final.shape[0], final.shape[1]
    if steps is None:
        steps = torch.tensor(rollout.sde_steps, dtype=torch.long).expand(B, G, -1)  # (B, G, K)
    T = steps.shape[2]
    noise = torch.stack([torch.randn((G, T, *final.shape[2:]), generator=gen) for gen in generators])
    noise = noise.to(final.device).flatten(0, 2)  # (B G T, ...)
    x0 = final.repeat_interleave(T, 1).flatten(0, 1)  # (B G T, ...)
    sigma = sigmas[steps.flatten()].to(final.device)  # (B G T,)
    s = sigma.view(-1, *[1] * (x0.dim() - 1))
    x = (1 - s) * x0 + s * noise  # x_s = (1 - s) x0 + s eps
    index = torch.arange(B, device=final.device).repeat_interleave(G * T)  # (B G T,)
    return x0, noise, x, sigma, index


def flow_matching_check_loss(velocity_fn, rollout, sigmas, k):
    """The self-check's loss of a method that scores no SDE step: the flow-matching loss |v_theta - (eps - x0)|^2 of
    the first image at step k, with a fixed noise, so it draws nothing and runs under each kernel in turn."""
    x0 = rollout.final_latents[:1, 0, 0, 0]  # (1, ...)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0)).to(x0.device)
    sigma = sigmas[k].expand(1).to(x0.device)
    x = (1 - sigma) * x0 + sigma * noise

    def loss_fn():
        v = velocity_fn(x, sigma, torch.zeros(1, dtype=torch.long, device=x0.device))
        return ((v.float() - (noise - x0)) ** 2).mean()
    return loss_fn


class StepCount:
    """s, the optimizer steps the updates of iterations 0 .. i - 1 ran (a step skipped for a non-finite gradient
    counts too), for a schedule keyed on s (an old or EMA policy's decay). It is part of the
    method's state, so that --inner-epochs (or --member-chunks) changed on --resume changes the steps from then on,
    not the count of those before. An iteration it has not counted (a checkpoint written before the count was kept,
    an iteration whose update did not run for non-finite rewards) counts at the steps of the next update, as the
    count s = (i + 1) x steps that it replaces did for every iteration."""

    def __init__(self):
        self.steps, self.iteration = 0, 0  # s after the updates of iterations 0 .. iteration - 1

    def after(self, iteration, steps):
        """s at the end of iteration `iteration`'s update of `steps` optimizer steps."""
        if iteration < self.iteration:  # an iteration before those counted (another run): counted afresh
            self.steps, self.iteration = 0, 0
        # s = s_counted + (iterations not counted) x steps + steps
        self.steps += (iteration - self.iteration) * steps + steps
        self.iteration = iteration + 1
        return self.steps

    def state_dict(self):
        return {"steps": torch.tensor(self.steps), "iteration": torch.tensor(self.iteration)}

    def load_state_dict(self, state):
        """A state without the count (a checkpoint of before it) leaves it at none counted."""
        if state:
            self.steps, self.iteration = int(state["steps"]), int(state["iteration"])


class FrozenCopy:
    """A copy of the trained parameters (an old or EMA policy; lab.run.EMA is one) that the live ones can be swapped
    with: `with copy.swapped():` the model computes with the copy's weights, and with its own again after (also when
    a stop interrupts). `blend(eta)` moves the copy: copy <- eta copy + (1 - eta) live. `copies`: {name: tensor},
    its state (FSDP2: this rank's shards)."""

    def __init__(self, trained):
        self.named = list(trained)  # [(name, parameter)]
        self.copies = {name: p.detach().clone() for name, p in self.named}

    @torch.no_grad()
    def swap(self):
        """Exchange the live and the copied weights (call twice to restore)."""
        for name, p in self.named:
            live = p.detach().clone()
            p.copy_(self.copies[name])
            self.copies[name].copy_(live)

    @contextlib.contextmanager
    def swapped(self):
        self.swap()
        try:
            yield
        finally:
            self.swap()

    @torch.no_grad()
    def blend(self, eta: float):
        for name, p in self.named:
            self.copies[name].lerp_(p.detach(), 1 - eta)

    @torch.no_grad()
    def load(self, state):
        for name, tensor in self.copies.items():
            if state[name] is tensor:  # loaded in place already (a sharded checkpoint)
                continue
            saved = state[name].to(tensor.device, tensor.dtype)
            if hasattr(tensor, "device_mesh"):  # FSDP2: this rank's shard of the saved whole tensor
                from torch.distributed.tensor import distribute_tensor

                saved = distribute_tensor(saved, tensor.device_mesh, tensor.placements)
            tensor.copy_(saved)
