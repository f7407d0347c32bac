"""BranchGRPO (arXiv 2509.06040): a tree rollout that branches at chosen steps, node rewards from the leaves, and
advantages normalised per depth, so that every edge of the tree trains with its own advantage.

Where DanceGRPO samples G independent trajectories and G2RPO branches G members off one ODE anchor at each trained
step, BranchGRPO grows one tree per prompt from a shared x_T: DanceGRPO's SDE step on every step (std_dev = eta,
methods/dancegrpo.py), each node splitting in two at the split points, one child elsewhere. With splits at 0, 3, 6
and 9 of 20 steps the tree has 2^4 = 16 leaves, the group; its 218 edges cost 203 forwards where 16 trajectories
cost 320. A split's children are drawn with `--split-noise-scale` times the step's noise (4.0), while the edge's
log-probability keeps the step's own std. Each leaf's image is decoded from the last step's x0_hat = x - sigma v.

Rewards and advantages, for the tree of one prompt:
    R(leaf)   = the weighted sum of its rewards
    R(node)   = the mean of R over its leaves, or with --tree-prob-weighted
              = sum_c softmax_c(log pi_old(edge to c)) R(c)  over its children c (alpha 1)
    A(node)   = (R(node) - mean_d R) / (std_d R + 1e-8)   over the nodes of its depth d (std unbiased; A = 0 where
                the depth has one node or std < 1e-6),  clipped to +-5
Edge parent -> child at step i (the child at depth i + 1) trains with A(child), by PPO's clipped surrogate of
the edge's ratio r = pi_theta(child | parent) / pi_old(child | parent) (g2rpo.clipped_loss). All edges of a tree are
trained, in a random order; an optimizer step every `--edges-per-step` edges of each prompt, each edge's loss times
1 / (B x --edges-per-step x the edges of a tree). The edges of an optimizer step go to the transformer together,
each row at its own step's sigma.

Pruning drops edges from the loss only (the rollout and the rewards stay whole), while the iteration is within the
first --pruning-until of the run:
  - depth: the edges into the depths of --depth-pruning; --depth-pruning-slide moves those depths one shallower
    every --depth-pruning-interval iterations, until the shallowest reaches --depth-pruning-stop;
  - width, after the last split, among the edges depth pruning left: mode 1 keeps, of each leaf's chain of edges
    after the last split, the top max(1, int(--width-pruning-ratio n)) by advantage (equal along a chain, so its
    earliest); mode 2 keeps, over the tree's such edges, the best and the worst, k = max(2, int(ratio n)) in all.

Leaves sit in the tree's order, so the rollout stores each trained step in the interface's (B, K, G) layout: edge e
of m at step i is leaf block e (G / m leaves), its representative the first leaf of the block, which alone trains it
(the others repeat its latents and advantage, weight 0).

From the authors' `Fredreic1849/BranchGRPO` (`scripts/finetune/finetune_flux_branchgrpo_8gpus.sh`,
`fastvideo/train_branchgrpo_flux.py`): FLUX.1-dev, 20 steps, shift 3, eta 0.3, splits 0,3,6,9, split noise 4.0, G 16
leaves, 720^2, lr 1e-5, weight decay 1e-4, clip 1e-3, advantages clipped to 5, gradient clip 1, 2 prompts on each
of 8 GPUs, an optimizer step every 12 edges of a GPU, 300 iterations, HPS-v2.1, full fine-tune, no KL; no pruning
in that script. Its README reports 13.68 NFE per leaf and 493 s an iteration, against DanceGRPO's 20 and 698 s.

Differences from the authors' code:
  1. Each prompt's edges are shuffled on their own (its generator) and every optimizer step takes --edges-per-step
     edges of each prompt (theirs shuffles a GPU's 2 trees together, 12 edges a step: the flux preset's 6 a prompt).
  2. Width pruning's mode 2 ranks the edges of each tree (theirs, those of a GPU's trees together), in their order:
     depth first, so that tied advantages keep the edges theirs keeps.
  3. Each prompt's tree has its own x_T (theirs, `--init_same_noise`, shares one across a GPU's prompts).
  4. Pruning applies while iteration + 1 <= int(--pruning-until x --num-iterations), as theirs; its mixed ODE-SDE
     tree (`--mix_ode_sde_tree`) is not built here.
  5. The random draws come from this project's per-prompt generators; the exact sigma goes to the transformer (theirs
     passes int(1000 sigma) / 1000), and the log-prob keeps the Gaussian's constants, which cancel in the ratio.
  6. With --sde-type cps the last step has no noise, so it is sampled but not trained; a split's scaled noise then
     carries x' past the schedule's noise level, which the CPS step otherwise keeps.
  7. On presets other than --model flux, the preset's sizes stand; the tiny model's 8 steps and 8 leaves split at
     0, 2 and 4.

Run it:
    python train.py --model tiny --method branchgrpo
    torchrun --nproc_per_node 8 train.py --model flux --method branchgrpo

Shapes: B prompts, G leaves (the group), K trained steps, m_i edges at step i, (...) a latent.
"""
import dataclasses
import math
import weakref
from dataclasses import dataclass, field

import torch

from g2rpo import clipped_loss
from methods.base import Method, SDEStep, optimizer_step, ratio_stats, update_stats
from sampler import CountingVelocity, Rollout, prompt_noise
# -----------------------------------------------------------------------------------------------------------------
# The values BranchGRPO runs with, each with whose it is; what they do not name is every method's start
# (g2rpo.py's VALUES) and the model's preset (lab/flags.py). `python train.py --model M --method NAME
# --show-config` prints a run's, each value with where it came from.
# -----------------------------------------------------------------------------------------------------------------
RECIPE = dict(eta=0.3)
# its FLUX.1-dev script: 8 GPUs x 2 prompts, 300 iterations, HPS-v2.1, full fine-tune
PRESETS = {"flux": dict(num_steps=20, shift=3.0, group_size=16, resolution=720, lr=1e-5, weight_decay=1e-4,
                        clip_range=1e-3, max_grad_norm=1.0, kl_beta=0.0, lora_rank=0, prompts_per_iteration=16,
                        num_iterations=300, rewards=["hps=1.0"]),
           "tiny": dict(split_points=[0, 2, 4])}


def edges_per_step(num_steps, split_points):
    """m_i, the edges at each step i: 2^(splits at steps <= i)."""
    return [2 ** sum(s <= i for s in split_points) for i in range(num_steps)]


def tree_advice(group_size, num_steps):
    """Flags of a tree that runs with --group-size G on N steps, for a message: log2(G) split points spread over
    0..N-2 for a power of two G, else the largest power of two below G (at least 2) and its splits."""
    if num_steps < 2:
        return "--num-steps 2 or more (a split into sigma 0 would decode its two leaves alike)"
    splits = min(max(1, int(math.log2(group_size))), num_steps - 1)  # log2 of the largest power of two <= G
    points = " ".join(str(j * (num_steps - 1) // splits) for j in range(splits))  # distinct, each <= N - 2
    sizes = "" if group_size == 2**splits else f" --group-size {2**splits}"
    return f"--split-points {points}{sizes}"


def to_leaves(values, leaves):
    """A value per edge (B, m, ...) -> per leaf (B, G, ...): each edge's value over its block of G / m leaves."""
    return values.repeat_interleave(leaves // values.shape[1], dim=1)


@torch.no_grad()
def tree_rollout(velocity_fn, noise, sigmas, generators, *, leaves, split_points, split_noise_scale, trained,
                 step_fn, max_batch, image_only_fn=None):
    """One tree per prompt from its x_T (B, ...): `step_fn`'s SDE step on every step, each node splitting in two
    at `split_points` (the children's noise times `split_noise_scale`). Keeps, at each step of `trained`, each
    leaf's edge (parent latent, child latent, log-prob) in leaf layout, and decodes each leaf from the last step's
    x0_hat. Returns a `sampler.Rollout` with start and next latents (B, K, G, ...), final latents (B, 1, 1, G, ...)."""
    B, shape, device = noise.shape[0], noise.shape[1:], noise.device
    forward, image_forward = CountingVelocity.pair(velocity_fn, image_only_fn, max_batch)
    x, kept = noise.float()[:, None], {}  # (B, n, ...): the live nodes, the root first
    for i in range(len(sigmas) - 1):
        n, children = x.shape[1], 2 if i in split_points else 1
        flat = x.flatten(0, 1)  # (B n, ...)
        index = torch.arange(B, device=device).repeat_interleave(n)  # (B n,)
        v = (forward if i in trained else image_forward)(flat, sigmas[i].expand(B * n).to(device), index)  # (B n, ...)
        eps = prompt_noise(generators, (n * children, *shape), device).flatten(0, 1)  # (B n c, ...)
        scale = split_noise_scale if children == 2 else 1.0
        # the sample has scale x the step's noise; its log-prob is taken under the step's own std
        x_next, log_prob = step_fn(flat.repeat_interleave(children, 0), v.repeat_interleave(children, 0), sigmas, i,
                                   noise=scale * eps)  # (B n c, ...), (B n c,)
        x_next = x_next.view(B, n * children, *shape)  # (B, n c, ...): node p's children at p c .. p c + c - 1
        if i in trained:  # the parent of edge e is node e // c; each (B, G, ...) or (B, G)
            kept[i] = (to_leaves(x.repeat_interleave(children, 1), leaves), to_leaves(x_next, leaves),
                       to_leaves(log_prob.view(B, n * children), leaves))
        if i == len(sigmas) - 2:
            final = (flat - float(sigmas[i]) * v.float()).view(B, n, *shape)  # x0_hat of the last step: (B, G, ...)
        x = x_next

    def stack(part):  # the trained steps' part along dim 1: (B, K, G, ...)
        return torch.stack([kept[k][part] for k in trained], 1)
    return Rollout(start_latents=stack(0), next_latents=stack(1), old_log_probs=stack(2),
                   final_latents=final.view(B, 1, 1, leaves, *shape), anchor_final=None, sde_steps=list(trained),
                   granularities=[], **CountingVelocity.totals(forward, image_forward))


def node_rewards(leaf_rewards, edges, split_points, log_probs=None):
    """R of every step's children (B, m_i), from the leaves' (B, G) up: the mean of a node's leaves, or with
    `log_probs` ({step: (B, m_i)}, the edges' old log-probs at the split steps) the softmax-weighted sum of its two
    children's R. Returns [(B, m_i) for each step i]."""
    rewards = [None] * len(edges)
    rewards[-1] = leaf_rewards[:, :: leaf_rewards.shape[1] // edges[-1]]  # (B, m_{N-1})
    for i in range(len(edges) - 1, 0, -1):  # R of step i - 1's children from step i's
        r = rewards[i]
        if i in split_points:  # each node of depth i has two children at step i
            pairs = r.view(r.shape[0], -1, 2)  # (B, m_i / 2, 2)
            w = (torch.softmax(log_probs[i].view(pairs.shape), -1) if log_probs is not None
                 else torch.full_like(pairs, 0.5))
            r = (w * pairs).sum(-1)  # (B, m_{i-1})
        rewards[i - 1] = r
    return rewards


def depth_advantages(rewards):
    """Per depth: (R - mean R) / (std R + 1e-8) over one tree's nodes of that depth (B, m), unbiased std; 0 where
    the depth has one node or std < 1e-6."""
    if rewards.shape[1] <= 1:
        return torch.zeros_like(rewards)
    std = rewards.std(1, keepdim=True)  # (B, 1), unbiased
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (std + 1e-8)
    return torch.where(std < 1e-6, torch.zeros_like(advantages), advantages)


def kept_by_width(advantages, alive, mode, ratio):
    """Width pruning of the edges after the last split: advantages and alive (B, E, G) over those E steps, one edge a
    leaf a step, alive where depth pruning left the edge. Among the alive edges, mode 1 keeps the top
    max(1, int(ratio n)) of each leaf's chain of n by advantage, mode 2 the best int(k / 2) and the worst
    k - int(k / 2) of the tree's n, k = max(2, int(ratio n)). Both rank in the authors' order, depth first (their
    `collect_all_transitions`): a leaf's chain, earliest step first, before the next leaf's; the sort is stable, so
    of tied edges the best are the first in that order and the worst the last. Returns (B, E, G) bool."""
    B, E, G = advantages.shape
    keep = torch.zeros_like(alive)  # (B, E, G)
    for b in range(B):
        if mode == 1:  # each leaf's chain, earliest step first
            chains = [[(e, g) for e in range(E)] for g in range(G)]
        else:  # the tree's, depth first: leaf 0's chain, then leaf 1's, ...
            chains = [[(e, g) for g in range(G) for e in range(E)]]
        for group in chains:
            live = [(e, g) for e, g in group if alive[b, e, g]]
            ranked = sorted(live, key=lambda edge: -float(advantages[b, edge[0], edge[1]]))  # best first, stable
            n = len(ranked)
            if mode == 1:
                chosen = ranked[: max(1, int(ratio * n))]
            else:
                k = min(n, max(2, int(ratio * n)))
                chosen = ranked[: k // 2] + ranked[n - (k - k // 2):]
            for e, g in chosen:
                keep[b, e, g] = True
    return keep


@dataclass
class BranchGRPO(Method, SDEStep):
    """BranchGRPO: the run's flags it reads (methods/base.py's, --num-steps and --num-iterations), then its own
    (train.py's under --method branchgrpo)."""

    label = "BranchGRPO"

    num_steps: int
    num_iterations: int
    # --- its own flags ---
    split_points: list[int] = field(default_factory=lambda: [0, 3, 6, 9])
    """The steps at which every node splits in two; 2^(their count) leaves must be --group-size (BranchGRPO 0 3 6 9
    of 20 steps, 16 leaves)."""
    split_noise_scale: float = 4.0
    """A split's children are drawn with this times the step's noise (its log-prob keeps the step's std; 4.0)."""
    tree_prob_weighted: bool = False
    """A node's reward: the softmax over its children's edge log-probs of their rewards, instead of the mean of its
    leaves (BranchGRPO off)."""
    edges_per_step: int = 6
    """An optimizer step every this many edges of each prompt (BranchGRPO 12 of a GPU's 2 prompts)."""
    depth_pruning: list[int] = field(default_factory=list)
    """Depths whose edges leave the loss (the child of step i has depth i + 1); [] = none (its script)."""
    depth_pruning_slide: bool = True
    """The pruned depths move one shallower every --depth-pruning-interval iterations (its script: on)."""
    depth_pruning_interval: int = 30
    """Iterations between two moves of the pruned depths (its script 30)."""
    depth_pruning_stop: int = 0
    """The shallowest depth the sliding pruned depths reach; 0 = the last split point (its script 9)."""
    width_pruning: int = 0
    """Width pruning after the last split: 0 off (its script), 1 the top of each leaf's chain of edges by advantage,
    2 the best and the worst of the tree's edges (`kept_by_width`)."""
    width_pruning_ratio: float = 0.5
    """The share of the edges after the last split that width pruning keeps (BranchGRPO 0.5)."""
    pruning_until: float = 1.0
    """Pruning applies during this share of --num-iterations (BranchGRPO 1.0: all of it)."""

    per_step_advantages = True  # each edge its own depth's advantage
    recipe, presets = RECIPE, PRESETS  # (the file's top)

    def __post_init__(self):
        self._forwarded = None  # (the rollout, weakly; the forwards its update ran), for `update_nfe`

    def std_dev(self, sigmas, i):
        """Its SDE step is DanceGRPO's: the flow step's mean and std at a constant std_dev = eta."""
        return self.eta

    def problem(self, num_steps):
        splits = self.split_points
        if len(set(splits)) != len(splits) or any(not 0 <= s < num_steps - 1 for s in splits):
            return (f"--split-points {splits}: give distinct steps in 0..{num_steps - 2} (a split into sigma 0 "
                    f"would decode its two leaves alike)")
        if not splits:
            return f"--split-points is empty: a tree needs a split; e.g. {tree_advice(self.group_size, num_steps)}"
        if self.group_size != 2 ** len(splits):
            return (f"--group-size {self.group_size}: a tree with {len(splits)} binary splits has "
                    f"{2 ** len(splits)} leaves; set --group-size {2 ** len(splits)} or change --split-points (e.g. "
                    f"{tree_advice(self.group_size, num_steps)})")
        if self.split_noise_scale <= 0 or self.edges_per_step < 1:
            return (f"--split-noise-scale {self.split_noise_scale} --edges-per-step {self.edges_per_step}: the "
                    f"scale must be > 0 and the edges >= 1 (BranchGRPO 4.0, 6)")
        if self.width_pruning not in (0, 1, 2) or not 0 < self.width_pruning_ratio <= 1:
            return (f"--width-pruning {self.width_pruning} --width-pruning-ratio {self.width_pruning_ratio}: mode "
                    f"0, 1 or 2, a ratio in (0, 1]")
        if not all(1 <= d <= num_steps for d in self.depth_pruning):
            return f"--depth-pruning {self.depth_pruning}: depths in 1..{num_steps} (the child of step i: i + 1)"
        if self.depth_pruning_interval < 1:
            return f"--depth-pruning-interval {self.depth_pruning_interval}: must be >= 1 (BranchGRPO 30)"
        if self.depth_pruning_stop < 0:
            return f"--depth-pruning-stop {self.depth_pruning_stop}: must be >= 0 (0: the last split point)"
        if not 0 <= self.pruning_until <= 1:
            return f"--pruning-until {self.pruning_until}: must be in [0, 1] (a share of --num-iterations)"
        return self.sde_type_problem(self.trained_steps(0), num_steps)

    # ALGO LOGIC (the SDE step is DanceGRPO's, or --sde-type cps)
    def trained_steps(self, iteration):
        """Every step: the edges of the whole tree (but the last with --sde-type cps, which has no noise)."""
        return list(range(self.num_steps - (self.sde_type == "cps")))

    def rollout(self, velocity_fn, noise, sigmas, generators, steps, image_only_fn=None):
        """noise: (B, ...), the root of each prompt's tree."""
        return tree_rollout(velocity_fn, noise, sigmas, generators, leaves=self.group_size,
                            split_points=self.split_points, split_noise_scale=self.split_noise_scale, trained=steps,
                            step_fn=self.step, max_batch=self.max_batch, image_only_fn=image_only_fn)

    def advantages(self, scores, weights, ranks=None, rollout=None):
        """scores: (B, 1, 1, G, R) -> (B, K, G): each leaf's edge at each trained step gets the advantage of the
        edge's child among its depth."""
        leaf = (scores[:, 0, 0].float() * weights.to(scores.device)).sum(-1)  # (B, G)
        edges = edges_per_step(self.num_steps, self.split_points)
        log_probs = None
        if self.tree_prob_weighted:  # each split step's edges' old log-probs, one per edge
            if rollout is None:
                raise ValueError("--tree-prob-weighted takes its node rewards from the rollout's log-probs: pass it")
            log_probs = {i: rollout.old_log_probs[:, rollout.sde_steps.index(i), :: self.group_size // edges[i]]
                         for i in self.split_points}
        rewards = node_rewards(leaf, edges, self.split_points, log_probs)
        steps = rollout.sde_steps if rollout is not None else self.trained_steps(0)
        # (B, K, G): each trained step's children, normalised within their depth, over their leaf blocks
        advantages = torch.stack([to_leaves(depth_advantages(rewards[i]), self.group_size) for i in steps], 1)
        return advantages.clamp(-self.adv_clip_max, self.adv_clip_max)  # (B, K, G)

    def pruning(self, iteration):
        """Whether pruning applies in iteration `iteration` (0-based): iteration + 1 <= int(until x iterations)."""
        return iteration + 1 <= int(self.pruning_until * self.num_iterations)

    def pruned_depths(self, iteration):
        """The depths whose edges leave the loss in iteration `iteration`: --depth-pruning, moved one shallower every
        interval of iterations counted from 1, down to the stop."""
        if not self.depth_pruning or not self.pruning(iteration):
            return set()
        shift = 0
        if self.depth_pruning_slide:
            stop = self.depth_pruning_stop or max(self.split_points)
            shift = max(0, min((iteration + 1) // self.depth_pruning_interval, min(self.depth_pruning) - stop))
        return {d - shift for d in self.depth_pruning}

    def edge_mask(self, iteration, advantages, steps):
        """The edges trained, each at its leaf block's first leaf: (B, K, G) bool."""
        B, K, G = advantages.shape
        edges = edges_per_step(self.num_steps, self.split_points)
        mask = torch.zeros(B, K, G, dtype=torch.bool)
        pruned = self.pruned_depths(iteration)
        for ki, i in enumerate(steps):
            if i + 1 not in pruned:
                mask[:, ki, :: G // edges[i]] = True
        after = [ki for ki, i in enumerate(steps) if i > max(self.split_points)]  # one edge a leaf a step
        if self.width_pruning and self.pruning(iteration) and after:
            alive = torch.zeros(B, len(after), G, dtype=torch.bool)  # (B, E, G): every leaf's edge, if not pruned
            alive[:, [a for a, ki in enumerate(after) if mask[0, ki].any()]] = True
            mask[:, after] = kept_by_width(advantages[:, after].cpu(), alive, self.width_pruning,
                                           self.width_pruning_ratio)
        return mask

    def optimizer_steps(self, num_trained_steps):
        """Without pruning: one every --edges-per-step of a tree's edges."""
        edges = edges_per_step(self.num_steps, self.split_points)
        return self.inner_epochs * math.ceil(sum(edges[:num_trained_steps]) / self.edges_per_step)

    def trained_edges(self, iteration, steps):
        """The edges of a tree the update trains in iteration `iteration` over the trained `steps`, after pruning.
        The count does not depend on the advantages (depth pruning follows the iteration, width pruning keeps a
        share of each chain or of the tree by its size), so zero advantages give it."""
        return int(self.edge_mask(iteration, torch.zeros(1, len(steps), self.group_size), steps)[0].sum())

    def update_nfe(self, rollout):
        """One forward with gradients per trained edge and inner epoch: those the update forwarded when it ran on
        this rollout; else (a rollout no update ran on: tools/bench.py's cost, an update skipped for non-finite
        rewards) the count pruning implies, B x `trained_edges` x inner epochs, averaged over the run's
        --num-iterations (depth pruning slides with the iteration, and pruning ends at --pruning-until)."""
        if self._forwarded is not None and self._forwarded[0]() is rollout:
            return self._forwarded[1]
        counts, per_tree = {}, []  # counts: per (pruning on, pruned depths), all an iteration's count depends on
        for it in range(self.num_iterations):
            key = (self.pruning(it), frozenset(self.pruned_depths(it)))
            if key not in counts:
                counts[key] = self.trained_edges(it, rollout.sde_steps)
            per_tree.append(counts[key])
        if len(set(per_tree)) == 1:  # (a whole count where it is the same every iteration)
            return rollout.start_latents.shape[0] * per_tree[0] * self.inner_epochs
        return rollout.start_latents.shape[0] * sum(per_tree) / len(per_tree) * self.inner_epochs

    def for_planning(self):
        return dataclasses.replace(self, depth_pruning=[], width_pruning=0)

    def update(self, rollout, advantages, ctx):
        """Each prompt's trained edges in a random order of its own; each optimizer step on the next
        --edges-per-step edges of every prompt, each edge's loss times 1 / (B x --edges-per-step x a tree's edges)."""
        B = advantages.shape[0]
        mask = self.edge_mask(ctx.iteration, advantages, rollout.sde_steps)  # (B, K, G)
        per_tree = int(mask[0].sum())  # the same on every prompt, and so on every rank
        # the forwards with gradients this update runs, for `update_nfe` on this rollout (held weakly: its latents
        # are not kept past the iteration)
        self._forwarded = (weakref.ref(rollout), B * per_tree * self.inner_epochs)
        if per_tree == 0:
            return {"optimizer_steps": 0, "skipped_steps": 0}
        # each prompt's edges, (per_tree, 2): (trained step, leaf), shuffled by its generator
        orders = [mask[b].nonzero()[torch.randperm(per_tree, generator=ctx.generators[b])] for b in range(B)]
        per_step, grad_norms = [], []
        ctx.optimizer.zero_grad(set_to_none=True)
        for _ in range(self.inner_epochs):
            for start in range(0, per_tree, self.edges_per_step):
                edges = torch.cat([torch.cat([torch.full((len(chunk), 1), b), chunk], 1) for b, chunk in
                                   enumerate(order[start : start + self.edges_per_step] for order in orders)])
                # (n, 3): prompt, trained step, leaf of the step's edges, every prompt's next ones
                per_step.append(self.edges_loss_backward(ctx, rollout, advantages, edges,
                                                         1.0 / (B * self.edges_per_step * per_tree)))
                grad_norms.append(optimizer_step(ctx.params, ctx.optimizer, self.max_grad_norm))
        return update_stats(per_step, grad_norms, per_optimizer_step=True)

    def edges_loss_backward(self, ctx, rollout, advantages, edges, weight):
        """The clipped loss of `edges` ((n, 3): prompt, trained step, leaf), each times `weight`, back-propagated in
        micro-batches of at most --max-batch edges, each one transformer call whatever its edges' steps (the sigma
        goes per row): not `methods.base.step_backward`, whose micro-batches hold one step's start latents. Returns its
        statistics."""
        loss, kl, log_ratios = 0.0, 0.0, []
        for rows in edges.split(self.max_batch):
            b, ki, leaf = rows.T  # (m,) each
            x = rollout.start_latents[b, ki, leaf]  # (m, ...)
            steps = torch.tensor(rollout.sde_steps)[ki]  # (m,) the step of each edge
            sigma, index = ctx.sigmas[steps].to(x.device), b.to(x.device)
            velocity = ctx.velocity_fn(x, sigma, index)  # (m, ...)
            base = None
            if self.kl_beta > 0:
                with torch.no_grad():
                    base = ctx.base_velocity_fn(x, sigma, index)
            batch_loss = 0.0
            for k in steps.unique().tolist():  # the step's formula, per step of the batch
                at = (steps == k).nonzero().flatten()
                _, log_probs = self.step(x[at], velocity[at], ctx.sigmas, k,
                                         next_latents=rollout.next_latents[b[at], ki[at], leaf[at]])  # (m_k,)
                old = rollout.old_log_probs[b[at], ki[at], leaf[at]].to(log_probs.device)
                batch_loss = batch_loss + clipped_loss(log_probs, old, advantages[b[at], ki[at], leaf[at]].to(
                    log_probs.device), self.clip_range, torch.full_like(old, weight))
                if base is not None:
                    step_kl = self.kl(velocity[at], base[at], ctx.sigmas, k).sum() * weight
                    batch_loss = batch_loss + self.kl_beta * step_kl
                    kl += float(step_kl.detach())
                log_ratios.append((log_probs - old).detach())
            batch_loss.backward()  # (not finite: the gradient norm skips the step on every rank alike)
            loss += float(batch_loss.detach())
        return {"loss": loss, "kl": kl, **ratio_stats(torch.cat(log_ratios), self.clip_range)}
