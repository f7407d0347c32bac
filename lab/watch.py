"""The reward-hacking watch: statistics of the held-out images, and an alarm on the changes since the first evaluation.

Reward hacking is a trained reward that climbs while the images get worse: grid artifacts, blown-out colours, every
seed of a prompt drawing the same picture. A run sees it only through what it does not train on, so at every
held-out evaluation train.py scores the same images with
  - the held-out rewards (--eval-rewards), reward models the training never sees (logged as eval/heldout/<name>):
    FLUX's CLIP and PickScore; the tiny world's strict pass (shapes-strict, a success rate), and `shapes` when a
    run trains on another reward;
  - three image statistics (eval/stats/<name>), each with its standard error:
      saturation  the share of clipped channel values (0 or 1 after decoding), per image;
      grid        the share of an image's spectral power (its mean removed) on the lattice of the VAE's patch
                  period (FLUX: 8-pixel latents in 2 x 2 patches, a 16-pixel period), where a pattern repeating at
                  that period, a grid artifact, has all of its, per image;
      diversity   the root-mean-square distance between the images of one prompt over its seeds, averaged over its
                  pairs, per prompt (it falls when the policy collapses onto one picture a prompt).
After each evaluation `check` compares the change since the first in each trained reward with the change in each
held-out reward and statistic. It fires when a trained reward has risen by more than `z` standard errors while a
held-out reward has fallen by more than `z`, or while a statistic has moved past its limit (`Limits`, the flags
--watch-*). train.py prints its one warning line, logs watch/..., and with --stop-on-hacking saves and stops.
"""
import math
from dataclasses import dataclass

import torch


def saturation(images):
    """The share of each image's channel values at 0 or 1 (within half a level of 8-bit): (N, 3, H, W) -> (N,)."""
    x = images.float()
    return ((x <= 0.5 / 255) | (x >= 254.5 / 255)).float().mean((1, 2, 3))


def grid_energy(images, period: int):
    """The share of each image's spectral power, its mean removed, on the lattice of `period`: the frequencies whose
    row and column are both multiples of 1 / period (in cycles per pixel), where everything that repeats every
    `period` pixels has all its power and a smooth image almost none: (N, 3, H, W) -> (N,). 0 when the period does
    not divide the image."""
    grey = images.float().mean(1)  # (N, H, W)
    N, H, W = grey.shape
    if period < 2 or H % period or W % period:
        return torch.zeros(N)
    power = torch.fft.fft2(grey - grey.mean((1, 2), keepdim=True)).abs() ** 2  # (N, H, W)
    lattice = torch.zeros(H, W, dtype=torch.bool, device=grey.device)
    lattice[:: H // period, :: W // period] = True  # (0, 0) too, whose power the mean's removal zeroed
    return (power * lattice).sum((1, 2)) / power.sum((1, 2)).clamp_min(1e-12)


def diversity(images, prompt_of):
    """The root-mean-square pixel distance between the images of one prompt, over its pairs of seeds, one value a
    prompt with at least two images: images (N, 3, H, W), prompt_of (N,) prompt indices -> (P,)."""
    x = images.float().flatten(1)  # (N, D)
    values = []
    for p in sorted(set(prompt_of.tolist())):
        mine = x[prompt_of == p]
        if len(mine) > 1:
            distances = torch.cdist(mine, mine) / math.sqrt(x.shape[1])  # RMS over pixels
            values.append(distances[torch.triu_indices(len(mine), len(mine), 1).unbind()].mean())
    return torch.stack(values) if values else torch.empty(0)


GRID_FLOOR = 0.02  # grid energy below this share is no pattern (the tiny world's images: 0.001-0.015): no ratio counts


@dataclass
class Limits:
    """How far a statistic may move from the first evaluation before the watch names it."""

    saturation: float = 0.05  # absolute rise of the clipped share
    grid: float = 2.0  # ratio to the first evaluation's grid energy
    diversity: float = 0.3  # ratio to the first evaluation's diversity (a fall below it)
    z: float = 2.0  # standard errors of a reward's change that count as a rise or a fall


def _change(first, now, key):
    """(first value, now value, the change in standard errors of the difference), or None if either lacks it."""
    if f"eval/{key}" not in first or f"eval/{key}" not in now:
        return None
    kind, name = key.split("/", 1)
    a, b = first[f"eval/{key}"], now[f"eval/{key}"]
    se = math.hypot(first.get(f"eval/{kind}_se/{name}", 0.0), now.get(f"eval/{kind}_se/{name}", 0.0))
    return a, b, (b - a) / se if se > 0 else (math.inf if b > a else -math.inf if b < a else 0.0)


def check(first: dict, now: dict, limits: Limits):
    """The watch's verdict on the evaluation metrics `now` against the first ones (eval/reward/<name>,
    eval/heldout/<name>, eval/stats/<name>, each with its _se). Returns (the reasons it fires, as phrases; its
    watch/... metrics)."""
    names = lambda kind: sorted(k.split("/", 2)[2] for k in now if k.startswith(f"eval/{kind}/"))
    metrics, risen, worse = {}, [], []
    for name in names("reward"):
        change = _change(first, now, f"reward/{name}")
        if change is not None:
            metrics[f"watch/trained_z/{name}"] = change[2]
            if change[2] > limits.z:
                risen.append(f"the trained reward {name} rose {change[0]:.4f} -> {change[1]:.4f} "
                             f"({change[2]:+.1f} SE)")
    for name in names("heldout"):  # the rewards of --eval-rewards, which training never sees
        change = _change(first, now, f"heldout/{name}")
        if change is not None:
            metrics[f"watch/heldout_z/{name}"] = change[2]
            if change[2] < -limits.z:
                worse.append(f"the held-out reward {name} fell {change[0]:.4f} -> {change[1]:.4f} "
                             f"({change[2]:+.1f} SE)")
    first_stats = {name: first.get(f"eval/stats/{name}") for name in names("stats")}
    for name, moved in (("saturation", lambda a, b: b - a > limits.saturation),
                        ("grid", lambda a, b: b > limits.grid * max(a, GRID_FLOOR)),
                        ("diversity", lambda a, b: b < limits.diversity * a)):
        a, b = first_stats.get(name), now.get(f"eval/stats/{name}")
        if a is None or b is None:
            continue
        metrics[f"watch/{name}_change"] = b - a
        if moved(a, b):
            worse.append(f"the image statistic {name} moved {a:.4f} -> {b:.4f}, past its limit")
    fired = bool(risen and worse)
    metrics["watch/fired"] = float(fired)
    return ([f"{'; '.join(risen)}, while {'; '.join(worse)}"] if fired else []), metrics
