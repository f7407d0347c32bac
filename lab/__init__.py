"""The lab: everything a run needs that is not the method.

    loop.py        the harness of train.py's loop: an iteration's data, forwards, rewards, update context and
                   metrics (`Harness`), the held-out evaluation, the first update's self-checks, and the loop
                   around the iterations (evaluations, the watch, checkpoints, stops, closing lines)
    policy.py      the trained policy (LoRA or full, DDP or FSDP2, AdamW, EMA, the KL's base), the reward models,
                   the velocity functions, and the distributed set-up train.py and evaluate.py share
    flags.py       the command line: the run's flags once, the model presets, the checks before anything loads (a
                   method's own flags, values and checks are its class's, methods/)
    run.py         the run folder and its lock, signals, faults, metrics, trackers, grids, EMA, collectives
    checkpoint.py  checkpoints: atomic saves, verification, resume, sharded (FSDP2) save and export
    models.py      one adapter per model family: encode, noise, velocity, decode, LoRA targets
    kernels.py     attention kernels, autocast, compilation, the FP8 rollout copy, the gradient self-check
    tiny.py        the tiny world: a small FLUX-architecture model pre-trained on the CPU, and its shapes reward
    judge.py       the HTTP client of a vision-language judge (UnifiedReward)
    watch.py       the reward-hacking watch: statistics of the held-out images, the alarm on their changes

It names no method: it asks a method through the interface of methods/base.py. The method files (sampler.py,
advantage.py, g2rpo.py) and methods/ never import this package; the scripts (train.py, evaluate.py, tools/) use
both. Inside it imports flow one way: loop -> policy -> run -> flags -> models -> kernels, run -> checkpoint, and
flags and checkpoint read the registries of rewards.py and methods/ (rewards.py loads the tiny world's rule and the
judge client from here, inside the factories that need them); `fail` lives here so that every module can end a run
with one line without importing flags.
"""
import os
import sys


def fail(message: str):
    """Bad input or an unusable state: one line (on rank 0 only, so torchrun shows it once), exit status 2."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
