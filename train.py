"""Train a text-to-image flow model with G2RPO: the program users run, and the paper's loop, top to bottom.

One iteration (`iteration` below), on each rank, for its own prompts:
  1. prompts and noise: this rank's prompts (the shuffled data order, or the method's own choice from a pool of
     candidates), one initial noise per prompt (or per member, for the methods that want it) and per-prompt SDE
     noise, seeded by (seed, iteration, global prompt position), so the run is the same on 1 rank or many (at a
     fixed --prompts-per-iteration: its default, one prompt a rank, grows with the ranks) and after a resume;
  2. roll out (sampler.py): G2RPO's anchor + singular SDE branches + multi-granularity completions;
  3. decode every final latent and score it with every reward model (rewards.py);
  4. advantages per (reward, granularity, step), normalised in the group and summed (advantage.py);
  5. the clipped policy update (g2rpo.py): the members of a prompt share their start latent, so one forward per
     prompt and trained step scores all G.
The method (--method) answers steps 1, 2, 4 and 5: `g2rpo.G2RPO`, or one of methods/, on the interface of
methods/base.py. A group never spans ranks, so advantages need no communication; the methods that do communicate
say so (a reward std taken over all prompts gathers every rank's rewards; a pool of candidates, their scores).
Around the loop (lab/loop.py): the held-out evaluations and the reward-hacking watch, checkpoints and resume, stops,
metrics, the first update's self-checks, the FP8 copy and the EMA. The flags and their checks are lab/flags.py (a
method's own, its class); the models and how they are called, lab/policy.py, lab/models.py and lab/kernels.py.

Run it:
    python train.py --model tiny                                      # CPU, minutes: the built-in tiny model
    python train.py --model flux --lora-rank 64 --lr 1e-4             # one GPU, LoRA
    torchrun --nproc_per_node 8 train.py --model flux                 # one node, full fine-tune, FSDP2
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 train.py --model flux
    python train.py --model flux --help                               # every flag, with the preset's values
    python train.py --model flux --show-config                        # every value of the run, and whose it is
    python train.py --model tiny --method NAME --help                 # a method's own flags (NAME: --help lists them)

Deviations from the reference code (numbers of the README's list): 6 (granularities {1, 2, 3}), 7 (per-prompt
noise and data order), 8 (faults), 9 (held-out evaluation), 11 (attention kernels and the gradient self-check).
"""
import os
import signal
import sys

if __name__ == "__main__":  # a Ctrl-C while torch and the models' libraries import or the flags parse: one line
    def _interrupted(*_):
        # nothing is open yet, so leave at once: an exception raised here could unwind through torch's C++ import
        # code, which then aborts the process
        print("\ninterrupted; nothing was written", file=sys.stderr, flush=True)
        os._exit(130)

    signal.signal(signal.SIGINT, _interrupted)

import torch
import torch.distributed as dist

from lab import checkpoint
from lab.flags import method_of, parse_args, run_config, validate, warn_long_prompts
from lab.loop import Harness, fp8_copy, restore, train_loop
from lab.policy import build_policy, load_reward_models, setup_distributed
from lab.run import Run, collective_failures
from methods import step_credit


# ALGO LOGIC: one iteration, prompts -> rollout -> rewards -> advantages -> update
def iteration(it, method, h):
    """Iteration `it` of `method` (g2rpo.G2RPO, or one of methods/) on this rank's prompts, `h` the harness
    (lab.loop.Harness); returns its metrics (floats)."""
    # 1. the prompts (the data order, or the method's choice), a generator per prompt, and the initial noise
    batch = method.prompts(it, h)
    generators = h.generators(it, batch.positions)  # each prompt's: its x_T, then its members' SDE noise
    cond = h.encode(batch.prompts)
    noise = method.initial_noise(h.noise, generators)  # (B, ...) shared by a prompt's members, or (B, G, ...)

    # 2. roll out with the current policy, no gradients (with --rollout-precision fp8 the forwards that only make
    # images run on the FP8 copy, the trained steps on the policy)
    steps = method.trained_steps(it)
    rollout = method.rollout(h.velocity(cond), noise, h.sigmas, generators, steps, h.image_only_velocity(cond))

    # 3. rewards of every completion: (B, J, K, G, R), the rollout's order with the reward models last
    scores = h.score_rollout(rollout, batch.prompts)

    # 4. advantages: per trained step (or one per trajectory, broadcast to its steps); --step-credit's controls
    B, G = len(batch.prompts), method.group_size
    advantages = method.advantages(scores, h.weights, h.ranks, rollout)  # (B, K or 1, G)
    advantages = step_credit(advantages.expand(B, len(steps), G), h.args.step_credit)  # (B, K, G)

    # 5. the policy update, taken on every rank or on none
    stats = h.update(method, it, cond, rollout, advantages, scores, generators)
    return h.iteration_metrics(method, batch, rollout, stats)


HACKING_EXIT = 3  # the exit status of a stop by the reward-hacking watch (--stop-on-hacking); a signal's stop is 0


def main(args):
    """Train. Returns None when the run finished (or was complete already), else the exit status of a stop, its
    checkpoint written: 0 for a signal's, HACKING_EXIT for the reward-hacking watch's."""
    # ---- distributed: keyed on RANK, so the same script runs on a laptop and on many GPUs ----
    distributed = int(os.environ.get("RANK", -1)) != -1
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if distributed else (0, 1)
    master = rank == 0
    log = print if master else (lambda *a, **k: None)
    prompts, eval_prompts, reward_weights = validate(args, world, log)
    run = Run(args, rank, world, distributed, log)
    config = run_config(args)
    try:
        resume_from = run.open(config) if master else None  # (rank 0 holds the folder's lock)
        start = checkpoint.read_trainer_state(resume_from)["iteration"] if resume_from else 0
        # complete: every iteration ran and the final evaluation is recorded (a stop may have come before it)
        complete = start > args.num_iterations or start == args.num_iterations and master and run.evaluated(start)
        _, _, _, device = setup_distributed(args.dist_timeout_minutes)
        if distributed:
            shared = [resume_from, start, complete]
            dist.broadcast_object_list(shared, src=0)
            resume_from, start, complete = shared
        dtype = torch.bfloat16 if device.type == "cuda" and args.mixed_precision == "bf16" else torch.float32
        if complete:
            log(f"{resume_from} is already at iteration {start} of --num-iterations {args.num_iterations}: "
                f"the run is complete; pass a larger --num-iterations to extend it")
            return None

        # ---- the models, the method, and where the run starts ----
        # the rewards first: one that cannot load stops the run before the largest load
        reward_models = load_reward_models(args, device, dtype, reward_weights, log)
        policy = build_policy(args, device, dtype, distributed, log)
        warn_long_prompts(args, policy.adapter.pipe, prompts + eval_prompts, log)
        method = method_of(args)
        method.start([(name, p) for name, p in policy.transformer.named_parameters() if p.requires_grad])
        if resume_from:
            restore(run, method, policy, resume_from, config)
            log(f"resumed from {resume_from} at iteration {start}")
        if args.rollout_precision == "fp8":
            fp8_copy(policy, dtype, log)
        if master:
            run.begin(config, fresh=not resume_from)
        run.open_tracker(config, start)
        run.catch_signals()
        if distributed:  # under torchrun a stop cuts a long update short (its grace); one process finishes it, so
            run.stop_between_steps(policy.optimizer)  # that its resume equals the uninterrupted run
        run.steps_taken = 0

        # ---- the loop ----
        h = Harness(args, policy, reward_models, run, prompts, eval_prompts, rank, world, distributed)
        train_loop(h, method, lambda it: iteration(it, method, h), config, start)
        if distributed:
            dist.barrier()  # leave together: a rank tearing down its process group early can abort another
    finally:
        run.close()
        if distributed and dist.is_initialized():
            dist.destroy_process_group()
    if run.stopped_at is None:
        return None
    return HACKING_EXIT if run.hacking_stop else 0


if __name__ == "__main__":
    args = parse_args()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # parsed: Ctrl-C is the run's to handle from here
    with collective_failures(args):  # a rank stuck or dead: one line from rank 0, not every rank's traceback
        status = main(args)
    if status is not None:  # stopped: leave at once, before Python's shutdown restores the default signal handlers
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
