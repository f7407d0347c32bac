"""Train a text-to-image flow model with G2RPO: the program users run, and where the iteration reads top to bottom.

One iteration (`iteration` below), on each rank, for its own prompts (a group never spans ranks, so advantages need
no communication):
  1. encode the prompts; draw one initial noise per prompt and per-prompt SDE noise, seeded by
     (seed, iteration, global prompt position), so the run is the same on 1 rank or many and after a resume;
  2. roll out (sampler.py): G2RPO's anchor + singular SDE branches + multi-granularity completions, or full SDE;
  3. decode every final latent and score it with every reward model (rewards.py);
  4. advantages per (reward, granularity, step), normalised in the group and summed (advantage.py);
  5. the clipped policy update, one forward per prompt per trained step (g2rpo.py).
Around it (run.py): the output folder and its lock, checkpoints and resume, signals, faults, metrics, grids.

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
import importlib.util
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from math import isfinite
from typing import Annotated, Literal

import torch
import torch.distributed as dist
import tyro

import checkpoint
import rewards
from advantage import granular_advantages
from g2rpo import g2rpo_update
from kernels import ATTENTION_BACKENDS, update_loss
from models import ADAPTERS, RESOLUTION_MULTIPLE, ModelLoadError, add_lora
from run import EMA, Run, all_mean, any_rank, eval_noise_generator, fail, read_prompts
from sampler import (granular_schedule, ode_sample, rollout_full_sde, rollout_g2rpo, rollout_mixed, sde_step,
                     sigma_schedule, window_steps)


@dataclass
class TrainArgs:
    # --- model ---
    model: Literal["flux", "sd3", "tiny"] = "flux"
    """Model family and preset of defaults: flux (FLUX.1, the paper's), sd3 (SD3 / SD3.5, CFG), tiny (built-in, CPU)."""
    model_path: str = "black-forest-labs/FLUX.1-dev"
    """A diffusers pipeline folder or hub id. Ignored by --model tiny, which builds its own."""
    guidance: float = 3.5
    """FLUX: the guidance embedding value (reference 3.5). SD3: the classifier-free guidance scale (typ. 4.5)."""
    max_sequence_length: int = 512
    """T5 tokens per prompt (FLUX max 512, SD3 max 256); longer prompts are truncated with a warning."""
    lora_rank: int = 0
    """LoRA rank on the attention projections (typ. 16-128); 0 = full fine-tune (the reference)."""
    lora_alpha: float = 0.0
    """LoRA alpha; 0 means alpha = rank."""
    lora_feed_forward: bool = False
    """Also put LoRA on the feed-forward projections."""
    offload_text_encoders: bool = False
    """Keep the text encoders on the CPU between prompt batches (moved to the accelerator only to encode); frees
    ~10 GB for FLUX (T5-XXL) at the cost of two transfers per iteration."""
    mixed_precision: Literal["bf16", "no"] = "bf16"
    """bf16 autocast with fp32 master weights on CUDA (the reference); ignored on CPU, which runs fp32."""
    gradient_checkpointing: bool = True
    """Recompute activations in the backward pass (needed for FLUX at 720^2)."""
    attention_backend: Literal[ATTENTION_BACKENDS] = "auto"
    """Attention kernel of the update's forward and backward. auto: flash, memory-efficient or math on CUDA, never
    cuDNN attention, whose backward gave wrong gradients on an H200 (README, GPU); math is the slow, exact one."""
    rollout_attention_backend: Literal[ATTENTION_BACKENDS] = "auto"
    """Attention kernel of the no-grad rollout and evaluation (forward only)."""
    compile: bool = False
    """torch.compile the transformer's repeated blocks (regional compilation): a faster rollout and update after a
    compile of a minute or so on the first iteration."""
    gradient_check: bool = True
    """Compare the first update's gradient with the math attention kernel's (and fp32's) and stop the run if they
    disagree: a wrong kernel would otherwise skip or corrupt every step of a long GPU run."""
    # --- data and output ---
    prompt_file: str = "prompts/hpdv2_train.txt"
    """Training prompts, one a line (python prompts/hpdv2.py writes HPDv2's)."""
    eval_prompt_file: str = "prompts/hpdv2_test.txt"
    """Held-out prompts, one a line, for the eval reward and the sample grids."""
    output_dir: str = "runs/flux"
    """Where metrics.jsonl, config.json, samples/ and checkpoints/ go; one run at a time holds it."""
    resume: bool = False
    """Continue from the newest complete checkpoint in --output-dir."""
    overwrite: bool = False
    """Start afresh in an --output-dir that holds another run (its checkpoints and metrics are removed)."""
    # --- rollout ---
    resolution: int = 720
    """Image side in pixels (reference 720; a multiple of 16 for FLUX and SD3, of 4 for tiny)."""
    num_steps: int = 16
    """N, sampling steps of the rollout (reference 16)."""
    shift: float = 3.0
    """SD3 time shift of the sigma schedule (reference 3)."""
    eta: float = 0.7
    """eta, the SDE noise level of the branching step (reference 0.7; typ. 0.3-1.0)."""
    group_size: int = 12
    """G, samples per prompt over which rewards are normalised (reference 12; >= 2)."""
    sde_steps: list[int] = field(default_factory=lambda: list(range(8)))
    """M, the steps k that branch with an SDE step and are trained (reference 0..7, the first half)."""
    granularities: list[int] = field(default_factory=lambda: [1, 2, 3])
    """Lambda, ODE strides of the completions (paper {1, 2, 3}; released scripts {1, 2}); {1} ablates them."""
    sampling: Literal["g2rpo", "full", "mixed"] = "g2rpo"
    """g2rpo; full: G full SDE trajectories per prompt, one reward broadcast to the trained --sde-steps (DanceGRPO /
    Flow-GRPO); mixed: SDE only inside a window of steps, ODE elsewhere, the window trained (MixGRPO / Flow-GRPO-Fast;
    --sde-steps is then unused)."""
    window_size: int = 4
    """mixed: SDE steps in the window (MixGRPO 4; Flow-GRPO-Fast 1-2)."""
    window_stride: int = 1
    """mixed: steps the sliding window moves at each shift (wrapping round at the end of the schedule)."""
    window_every: int = 25
    """mixed: iterations between two shifts of the sliding window."""
    window_random: bool = False
    """mixed: draw the window afresh every iteration instead of sliding it (Flow-GRPO-Fast)."""
    prompts_per_iteration: int = 0
    """Prompts per iteration over all ranks (reference 16: one per GPU); 0 = one per rank."""
    max_batch: int = 24
    """Largest batch of one transformer call in the rollout and update (bounds memory)."""
    # --- rewards (each reward's model paths follow as their own flags, e.g. --hps-checkpoint) ---
    rewards: list[str] = field(default_factory=lambda: ["hps=1.0"])
    """Reward models with weights, name=weight (hps, clip, pickscore, aesthetic, imagereward, shapes, ...)."""
    reward_batch_size: int = 16
    """Images per reward-model call."""
    # --- optimisation ---
    num_iterations: int = 301
    """Policy iterations (reference 301)."""
    lr: float = 2e-6
    """AdamW learning rate (reference 2e-6 full fine-tune; typ. 1e-4 with LoRA)."""
    weight_decay: float = 1e-4
    """AdamW weight decay (reference 1e-4)."""
    clip_range: float = 1e-4
    """epsilon of the clipped ratio (reference 1e-4, for a per-element-mean log-prob)."""
    adv_clip_max: float = 5.0
    """Advantages are clamped to +- this (reference 5)."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip (reference 1.0)."""
    step_per_sde_step: bool = True
    """One optimizer step per trained step k (the reference scripts); False: one step on the loss averaged over
    k (the paper's objective)."""
    kl_beta: float = 0.0
    """beta, weight of the KL to the base model per trained step (0 in the reference; Flow-GRPO uses 0.01-0.04 on
    SD3.5). LoRA: the base is the model with its adapter off; full fine-tune: a frozen copy (twice the weights)."""
    ema_decay: float = 0.0
    """Decay of an EMA of the trained weights used for evaluation and saved in checkpoints (0 = off; typ. 0.9-0.995)."""
    ema_every: int = 1
    """Update the EMA every this many iterations."""
    max_faults: int = 5
    """Stop after this many iterations in a row whose rewards, loss or gradients were not finite."""
    # --- logging, evaluation, checkpoints ---
    eval_every: int = 25
    """Evaluate on the held-out prompts every this many iterations (and at start and end)."""
    eval_seeds: int = 2
    """Noise seeds per held-out prompt in the evaluation."""
    eval_prompts: int = 48
    """Held-out prompts in the in-training evaluation, spread evenly over --eval-prompt-file (0 = all). At the flux
    preset, 48 prompts x 2 seeds cost about 4 % of the run's rollout forwards; the full table is evaluate.py's job."""
    checkpoint_every: int = 50
    """Save a checkpoint every this many iterations (and at the end)."""
    log_with: Literal["none", "wandb", "tensorboard"] = "none"
    """Optional experiment tracker, imported only when asked for."""
    seed: int = 42
    """Seed of the data order and every noise (reference 42)."""
    tiny_cache: str = ".cache"
    """Where --model tiny keeps its pre-trained base model."""
    dist_timeout_minutes: float = 30.0
    """A rank waiting longer than this on a collective stops the run (a failed rank then cannot hang the rest)."""


# every reward's model paths become flags of their own, declared once in rewards.REWARDS
Args = dataclasses.make_dataclass(
    "Args", [(name, Annotated[str, tyro.conf.arg(help=help)], field(default=default))
             for name, default, help in rewards.path_fields()], bases=(TrainArgs,))

PRESETS = {
    "flux": {},
    "sd3": dict(model_path="stabilityai/stable-diffusion-3.5-medium", guidance=4.5, max_sequence_length=256,
                resolution=512, lora_rank=32, lr=1e-4, output_dir="runs/sd3"),
    # fp32 on every device (deviation 12): bf16 costs this small model a tenth of its held-out reward
    "tiny": dict(model_path="", max_sequence_length=16, resolution=32, num_steps=8, group_size=8,
                 sde_steps=[0, 1, 2, 3], granularities=[1, 2, 3], prompts_per_iteration=8, max_batch=512,
                 rewards=["shapes=1.0"], num_iterations=40, lr=5e-5, weight_decay=0.0, clip_range=1e-3,
                 eval_every=10, eval_seeds=3, eval_prompts=0, checkpoint_every=20, gradient_checkpointing=False,
                 mixed_precision="no", prompt_file="prompts/tiny_train.txt",
                 eval_prompt_file="prompts/tiny_eval.txt", output_dir="runs/tiny", seed=0),
}


def parse_args(argv=None, args_class=None):
    """`--model` picks a preset of defaults; every other flag overrides it (and --help shows the preset's values).
    `args_class`: a dataclass derived from Args, for a script that takes these flags and more (plan.py)."""
    argv = sys.argv[1:] if argv is None else argv
    model = "flux"
    for i, a in enumerate(argv):
        if a == "--model" and i + 1 < len(argv):
            model = argv[i + 1]
        elif a.startswith("--model="):
            model = a.split("=", 1)[1]
    if model not in PRESETS:
        fail(f"unknown --model '{model}'; choose one of: {', '.join(PRESETS)}")
    cls = args_class or Args
    return tyro.cli(cls, args=argv, default=cls(model=model, **PRESETS[model]),
                    description=(sys.modules[cls.__module__].__doc__ or __doc__).split("\n\n")[0])


# ---------------------------------------------------------------------------------------------------------------
# Input checks: all of them, once, before anything is loaded or written
# ---------------------------------------------------------------------------------------------------------------
# the valid range of every numeric flag (tests/test_reliability.py checks that none is missing)
RULES = {
    "guidance": (lambda v: isfinite(v) and v >= 0, ">= 0"),
    "max_sequence_length": (lambda v: v >= 1, ">= 1"),
    "lora_rank": (lambda v: v >= 0, ">= 0 (0 = full fine-tune)"),
    "lora_alpha": (lambda v: isfinite(v) and v >= 0, ">= 0 (0 = the rank)"),
    "resolution": (lambda v: v >= 4, ">= 4"),
    "num_steps": (lambda v: v >= 1, ">= 1"),
    "shift": (lambda v: isfinite(v) and v > 0, "> 0 (reference 3)"),
    "eta": (lambda v: isfinite(v) and v > 0, "> 0: the SDE step needs eta > 0 (typ. 0.7)"),
    "group_size": (lambda v: v >= 2, ">= 2: a group needs at least 2 samples to normalise rewards"),
    "prompts_per_iteration": (lambda v: v >= 0, ">= 0 (0 = one per rank)"),
    "max_batch": (lambda v: v >= 1, ">= 1"),
    "reward_batch_size": (lambda v: v >= 1, ">= 1"),
    "num_iterations": (lambda v: v >= 1, ">= 1"),
    "lr": (lambda v: isfinite(v) and v > 0, "a finite number > 0 (typ. 2e-6 full, 1e-4 LoRA)"),
    "weight_decay": (lambda v: isfinite(v) and v >= 0, ">= 0"),
    "clip_range": (lambda v: isfinite(v) and v > 0, "> 0 (reference 1e-4)"),
    "adv_clip_max": (lambda v: isfinite(v) and v > 0, "> 0 (reference 5)"),
    "max_grad_norm": (lambda v: isfinite(v) and v > 0, "> 0 (reference 1)"),
    "window_size": (lambda v: v >= 1, ">= 1"),
    "window_stride": (lambda v: v >= 1, ">= 1"),
    "window_every": (lambda v: v >= 1, ">= 1"),
    "kl_beta": (lambda v: isfinite(v) and v >= 0, ">= 0 (0 = no KL term)"),
    "ema_decay": (lambda v: 0 <= v < 1, "in [0, 1) (0 = no EMA)"),
    "ema_every": (lambda v: v >= 1, ">= 1"),
    "max_faults": (lambda v: v >= 1, ">= 1"),
    "eval_every": (lambda v: v >= 1, ">= 1"),
    "eval_seeds": (lambda v: v >= 1, ">= 1"),
    "eval_prompts": (lambda v: v >= 0, ">= 0 (0 = every held-out prompt)"),
    "checkpoint_every": (lambda v: v >= 1, ">= 1"),
    "seed": (lambda v: v >= 0, ">= 0"),
    "dist_timeout_minutes": (lambda v: isfinite(v) and v > 0, "> 0"),
}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def validate(args, world: int, log=print):
    """Every check that needs no model. Returns (train prompts, eval prompts, reward weights)."""
    weights = check_flags(args, world, log)
    return (read_prompts(args.prompt_file, "--prompt-file"),
            read_prompts(args.eval_prompt_file, "--eval-prompt-file"), weights)


def check_flags(args, world: int, log=print):
    """Every check of the flags themselves (no file is read). Returns the reward weights."""
    for f in dataclasses.fields(TrainArgs):
        if f.name in RULES and not RULES[f.name][0](getattr(args, f.name)):
            fail(f"{flag(f.name)} {getattr(args, f.name)}: must be {RULES[f.name][1]}")
    if not args.sde_steps:
        fail("--sde-steps is empty; give the steps to branch and train, e.g. --sde-steps 0 1 2 3")
    if len(set(args.sde_steps)) != len(args.sde_steps):
        fail(f"--sde-steps {args.sde_steps} repeats a step; list each step once")
    bad = [k for k in args.sde_steps if not 0 <= k < args.num_steps]
    if bad and args.sampling != "mixed":  # mixed trains its window instead
        fail(f"--sde-steps {bad} outside the schedule of --num-steps {args.num_steps}; "
             f"use steps in 0..{args.num_steps - 1}")
    if not args.granularities or min(args.granularities) < 1 or len(set(args.granularities)) != len(args.granularities):
        fail(f"--granularities {args.granularities}: give distinct strides >= 1, e.g. --granularities 1 2 3")
    if args.window_size > args.num_steps:
        fail(f"--window-size {args.window_size} is longer than the schedule of --num-steps {args.num_steps}")
    multiple = RESOLUTION_MULTIPLE[args.model]
    if args.resolution % multiple:
        fail(f"--resolution {args.resolution} is not a multiple of {multiple} (VAE factor x 2x2 patches); "
             f"use e.g. {args.resolution // multiple * multiple or multiple}")
    if args.prompts_per_iteration % world:
        fail(f"--prompts-per-iteration {args.prompts_per_iteration} does not split over {world} ranks; "
             f"use a multiple of {world}")
    if args.resume and args.overwrite:
        fail("--resume and --overwrite contradict each other; pass one")
    if args.log_with != "none" and importlib.util.find_spec(args.log_with) is None:  # the package is named so
        fail(f"--log-with {args.log_with} needs its package: pip install {args.log_with}")
    if args.model != "tiny" and not (os.path.isdir(args.model_path) or args.model_path.count("/") == 1):
        fail(f"--model-path '{args.model_path}' is neither a folder nor a hub id (org/name); "
             f"pass the folder holding model_index.json")
    try:
        weights = rewards.parse_rewards(args.rewards)
    except rewards.RewardError as err:
        fail(str(err))
    _note_coinciding_granularities(args, log)
    return weights


def _note_coinciding_granularities(args, log):
    """Granularities whose schedules coincide at a step give the same completion, so its reward counts several
    times in the advantage (as in the reference code); say so rather than let it pass silently."""
    if args.sampling != "g2rpo":
        return
    sigmas = sigma_schedule(args.num_steps, args.shift)
    for k in args.sde_steps:
        seen = {}
        for g in args.granularities:
            seen.setdefault(tuple(granular_schedule(sigmas, k, g).tolist()), []).append(g)
        for same in (gs for gs in seen.values() if len(gs) > 1):
            log(f"note: at SDE step {k} the granularities {same} give the same completion; its reward counts "
                f"{len(same)} times in the advantage (as in the reference code)")


# ---------------------------------------------------------------------------------------------------------------
# Models: the trained transformer (LoRA or full, DDP or FSDP2), its optimizer, the reward models
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Policy:
    adapter: object  # models.Adapter: encode, noise, velocity, decode
    transformer: torch.nn.Module  # the diffusers module (sharded in place under FSDP2)
    model: torch.nn.Module  # what the update calls: DDP-wrapped for LoRA, else the transformer
    params: list
    optimizer: torch.optim.Optimizer
    reward_fns: dict
    reward_weights: dict
    reference: torch.nn.Module | None = None  # frozen base for the KL term of a full fine-tune
    ema: EMA | None = None


def build_policy(args, device, dtype, reward_weights, distributed, log) -> Policy:
    """Load the pipeline and the reward models, then make the trained policy of them (`make_policy`)."""
    torch.manual_seed(args.seed)  # LoRA's initialisation; everything else draws from per-prompt generators
    model_path = args.model_path
    if args.model == "tiny":
        import tiny

        model_path = tiny.ensure_pretrained_on_ranks(args.tiny_cache, log=log)
    full = args.lora_rank == 0
    try:
        adapter = ADAPTERS[args.model].load(
            model_path, device, dtype, guidance=args.guidance, max_sequence_length=args.max_sequence_length,
            offload_text_encoders=args.offload_text_encoders, attention_backend=args.attention_backend,
            rollout_attention_backend=args.rollout_attention_backend, compile=args.compile,
            # full fine-tune: fp32 master weights; LoRA: the frozen base in the compute dtype (bf16 on GPU)
            transformer_dtype=torch.float32 if full else dtype, place_transformer=not (distributed and full))
    except ModelLoadError as err:
        fail(str(err))
    policy = make_policy(args, adapter, reward_weights, device, dtype, distributed)
    try:
        policy.reward_fns.update({name: rewards.load_reward(name, device, dtype, args.reward_batch_size, vars(args))
                                  for name in reward_weights})
    except rewards.RewardError as err:
        fail(str(err))
    return policy


def make_policy(args, adapter, reward_weights, device, dtype, distributed, foreach=None, mesh=None) -> Policy:
    """The trained part around a loaded adapter: full weights or LoRA, the KL reference, gradient checkpointing,
    DDP (LoRA) or FSDP2 (full) across ranks, AdamW (`foreach`: torch's default, multi-tensor on CUDA) and the EMA.
    The reward models are added by the caller (`reward_fns`)."""
    transformer = adapter.transformer
    full = args.lora_rank == 0
    if full:
        transformer.requires_grad_(True)
    else:
        add_lora(transformer, args.lora_rank, args.lora_alpha or args.lora_rank, args.lora_feed_forward)
    reference = None
    if full and args.kl_beta > 0:  # the base model of the KL term: a frozen copy of the starting weights
        import copy

        reference = copy.deepcopy(transformer).requires_grad_(False).eval()
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    model = transformer
    if distributed and not full:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(transformer, device_ids=[device.index] if device.type == "cuda" else None)
    elif distributed:
        for module in [transformer] + ([reference] if reference is not None else []):
            _shard(module, dtype, device, mesh)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay,
                                  foreach=foreach)
    ema = None
    if args.ema_decay > 0:
        trained = [(name, p) for name, p in transformer.named_parameters() if p.requires_grad]
        ema = EMA(trained, args.ema_decay, args.ema_every)
    return Policy(adapter, transformer, model, params, optimizer, {}, reward_weights, reference, ema)


def _shard(module, dtype, device, mesh=None):
    """FSDP2: shard every transformer block, then the rest; the shards alone move to the device. `mesh`: the
    ranks' device mesh (default: all ranks of the process group)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for name in ("transformer_blocks", "single_transformer_blocks"):
        for block in getattr(module, name, []):
            fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    module.to(device)


def make_velocity_fn(args, policy, module, cond):
    """v(x, sigma | prompt) of `module` (the transformer, or its DDP wrapper in the update)."""
    return lambda x, sigma, idx: policy.adapter.velocity(module, cond, x, sigma, idx, args.resolution)


def reference_velocity_fn(args, policy, cond):
    """The base model's velocity for the KL term: LoRA with its adapter off, or the frozen copy; None without KL."""
    if args.kl_beta == 0:
        return None
    if policy.reference is not None:
        return make_velocity_fn(args, policy, policy.reference, cond)

    def base_velocity(x, sigma, idx):
        policy.transformer.disable_adapters()
        try:
            return policy.adapter.velocity(policy.transformer, cond, x, sigma, idx, args.resolution)
        finally:
            policy.transformer.enable_adapters()

    return base_velocity


# ---------------------------------------------------------------------------------------------------------------
# One iteration: prompts -> rollout -> rewards -> advantages -> update
# ---------------------------------------------------------------------------------------------------------------
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
def score(args, policy, latents, prompts):
    """Decode latents (M, ...) in micro-batches and score them with every reward: (M, R)."""
    scores = []
    for i in range(0, latents.shape[0], args.reward_batch_size):
        images = policy.adapter.decode(latents[i : i + args.reward_batch_size], args.resolution)
        batch = prompts[i : i + args.reward_batch_size]
        scores.append(torch.stack([fn(images, batch).cpu() for fn in policy.reward_fns.values()], -1))
    return torch.cat(scores)  # (M, R)


def iteration(args, it, policy, prompts, sigmas, rank, world, distributed, first_update_check=None):
    """One G2RPO iteration on this rank's prompts; returns its metrics (floats)."""
    t0 = time.time()
    # 1. prompts and noise: one initial noise per prompt, and a generator per prompt for its members' SDE noise
    global_batch = args.prompts_per_iteration or world
    batch, positions = batch_prompts(prompts, args.seed, it, global_batch, rank, global_batch // world)
    cond = policy.adapter.encode(batch)
    gens = generators(args.seed, it, positions)
    noise = policy.adapter.noise(gens, args.resolution)  # (B, ...)
    B, G = len(batch), args.group_size

    # 2. rollout with the current policy, no gradients
    steps = trained_steps(args, it)
    rollout = roll_out(args, make_velocity_fn(args, policy, policy.transformer, cond), noise, sigmas, gens, steps)
    t1 = time.time()

    # 3. rewards of every completion: (B, J, K, G, R), the rollout's order with the reward models last
    J, K = rollout.final_latents.shape[1:3]
    scores = score(args, policy, rollout.final_latents.flatten(0, 3), [p for p in batch for _ in range(J * K * G)])
    scores = scores.view(B, J, K, G, -1)  # (B, J, K, G, R)
    metrics = reward_metrics(args, policy, rollout, scores, batch)
    t2 = time.time()

    # 4. advantages: normalised per (reward, granularity, step) within each group, summed, clamped
    weights = torch.tensor(list(policy.reward_weights.values()))  # (R,)
    advantages = granular_advantages(scores, adv_clip_max=args.adv_clip_max, weights=weights)  # (B, K or 1, G)
    advantages = advantages.expand(B, len(steps), G).to(noise.device)  # (B, K, G)

    # 5. the clipped policy update, taken on every rank or on none
    finite_rewards = not any_rank(not bool(torch.isfinite(scores).all()), distributed)
    if finite_rewards:
        update_velocity = make_velocity_fn(args, policy, policy.model, cond)  # through DDP / FSDP2, with gradients
        if first_update_check is not None:
            first_update_check(update_velocity, rollout, advantages)
        stats = g2rpo_update(update_velocity, policy.params, policy.optimizer, rollout,
                             advantages, sigmas, eta=args.eta, clip_range=args.clip_range,
                             max_grad_norm=args.max_grad_norm, step_per_sde_step=args.step_per_sde_step,
                             max_batch=args.max_batch, kl_beta=args.kl_beta,
                             reference_velocity_fn=reference_velocity_fn(args, policy, cond))
    else:
        stats = {"optimizer_steps": 0, "skipped_steps": len(steps) if args.step_per_sde_step else 1}
    if policy.ema is not None:
        policy.ema.update(it + 1)
    t3 = time.time()
    metrics.update({f"losses/{k}": v for k, v in stats.items() if k not in ("skipped_steps", "optimizer_steps")})
    metrics.update({"faults/skipped_steps": stats["skipped_steps"],
                    "faults/nonfinite_rewards": float(not finite_rewards),
                    "perf/optimizer_steps": stats["optimizer_steps"], "perf/nfe": rollout.nfe,
                    "perf/calls": rollout.calls, "time/rollout": t1 - t0, "time/decode_and_reward": t2 - t1,
                    "time/update": t3 - t2, "time/iteration": t3 - t0})
    return metrics


def roll_out(args, velocity_fn, noise, sigmas, generators, steps):
    """The rollout of --sampling: G2RPO's tree, or whole trajectories (full SDE, mixed window)."""
    if args.sampling == "g2rpo":
        return rollout_g2rpo(velocity_fn, noise, sigmas, generators, group_size=args.group_size, sde_steps=steps,
                             granularities=args.granularities, eta=args.eta, max_batch=args.max_batch)
    return (rollout_full_sde if args.sampling == "full" else rollout_mixed)(
        velocity_fn, noise, sigmas, generators, group_size=args.group_size, sde_steps=steps, eta=args.eta,
        max_batch=args.max_batch)


def trained_steps(args, it):
    """The SDE steps of iteration `it`: --sde-steps, or the mixed sampler's window."""
    if args.sampling != "mixed":
        return args.sde_steps
    return window_steps(it, num_steps=args.num_steps, size=args.window_size, stride=args.window_stride,
                        every=args.window_every, random=args.window_random, seed=args.seed)


def reward_metrics(args, policy, rollout, scores, batch):
    """Mean raw reward per model (and per granularity), and the anchor's reward (logged, not trained on)."""
    metrics = {}
    for r, name in enumerate(policy.reward_fns):
        metrics[f"train/reward/{name}"] = float(scores[..., r].mean())
        for j, g in enumerate(args.granularities if args.sampling == "g2rpo" else []):
            metrics[f"train/reward/{name}/g{g}"] = float(scores[:, j, ..., r].mean())
    if rollout.anchor_final is not None:
        anchor = score(args, policy, rollout.anchor_final, batch)  # (B, R)
        metrics.update({f"train/anchor_reward/{name}": float(anchor[:, r].mean())
                        for r, name in enumerate(policy.reward_fns)})
    return metrics


def eval_items(num_prompts: int, eval_prompts: int, eval_seeds: int):
    """The (prompt index, seed) pairs of the held-out evaluation: `eval_prompts` prompts spread evenly over the file
    (all of them when 0), seed-major; prompt indices are positions in the file, so the noise of a pair does not
    depend on the subset (evaluate.py draws the same)."""
    n = min(eval_prompts or num_prompts, num_prompts)
    chosen = sorted({i * num_prompts // n for i in range(n)})
    return [(p, s) for s in range(eval_seeds) for p in chosen]


GRID_IMAGES = 24  # images of the first evaluation batch kept (on the CPU) for the sample grid


@torch.no_grad()
def evaluate(args, policy, eval_prompts, sigmas, rank, world, distributed):
    """Held-out reward of the deterministic (ODE) images on fixed seeds; with an EMA, of the EMA weights.
    Encodes, samples, decodes and scores --max-batch items at a time, so no phase of it needs more memory than a
    rollout call. Returns metrics and up to GRID_IMAGES of this rank's images (on the CPU)."""
    items = eval_items(len(eval_prompts), args.eval_prompts, args.eval_seeds)
    per_rank = -(-len(items) // world)
    mine = items[rank * per_rank : (rank + 1) * per_rank]
    valid = len(mine)
    mine = mine + [items[-1]] * (per_rank - valid)  # equal work on every rank (FSDP forwards are collective)
    names = list(policy.reward_fns)
    per_seed = torch.zeros(len(names), args.eval_seeds, 2, dtype=torch.float64)  # (R, seeds, (sum, count))
    grid = []
    if policy.ema is not None:
        policy.ema.swap()
    try:
        for start in range(0, len(mine), args.max_batch):
            chunk = mine[start : start + args.max_batch]
            prompts = [eval_prompts[p] for p, _ in chunk]
            cond = policy.adapter.encode(prompts)
            noise = policy.adapter.noise([eval_noise_generator(p, s) for p, s in chunk], args.resolution)  # (b, ...)
            velocity_fn = make_velocity_fn(args, policy, policy.transformer, cond)
            x0, _, _ = ode_sample(velocity_fn, noise, sigmas, max_batch=args.max_batch, keep_trajectory=False)
            for i in range(0, len(chunk), args.reward_batch_size):
                images = policy.adapter.decode(x0[i : i + args.reward_batch_size], args.resolution)  # (b', 3, H, W)
                batch = chunk[i : i + args.reward_batch_size]
                for r, fn in enumerate(policy.reward_fns.values()):
                    scores = fn(images, prompts[i : i + args.reward_batch_size]).cpu()  # (b',)
                    for n, ((_, s), v) in enumerate(zip(batch, scores)):
                        if start + i + n < valid:  # not a padding item
                            per_seed[r, s] += torch.tensor([float(v), 1.0], dtype=torch.float64)
                if len(grid) < GRID_IMAGES:
                    grid.extend(images[: GRID_IMAGES - len(grid)].cpu())
    finally:
        if policy.ema is not None:
            policy.ema.swap()
    if distributed:
        dist.all_reduce(per_seed)
    metrics = {}
    for r, name in enumerate(names):
        means = per_seed[r, :, 0] / per_seed[r, :, 1].clamp_min(1)  # (seeds,)
        metrics[f"eval/reward/{name}"] = float(per_seed[r, :, 0].sum() / per_seed[r, :, 1].sum())
        metrics[f"eval/reward_seed_std/{name}"] = float(means.std()) if args.eval_seeds > 1 else 0.0
    return metrics, torch.stack(grid[:valid]) if valid else torch.empty(0)


# ---------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------
def train(args, config, policy, run, prompts, eval_prompts, start, rank, world, distributed):
    from tqdm import tqdm

    sigmas = sigma_schedule(args.num_steps, args.shift)
    evaluate_ = lambda: evaluate(args, policy, eval_prompts, sigmas, rank, world, distributed)
    shown = min(args.eval_prompts or len(eval_prompts), len(eval_prompts))  # prompts per seed in the grids
    if start == 0:
        before, images = evaluate_()
        run.save_grid(images, "eval_iter_000000.png", shown)
        run.write_metrics(0, before)
    else:
        before = run.resume_metrics(start)
    check = gradient_check(args, policy, sigmas, run.log)  # on this process's first update
    bar = tqdm(range(start, args.num_iterations), initial=start, total=args.num_iterations, disable=not run.master,
               dynamic_ncols=True)
    metrics, first_reward = {}, f"train/reward/{next(iter(policy.reward_fns))}"
    for it in bar:
        metrics = all_mean(iteration(args, it, policy, prompts, sigmas, rank, world, distributed, check), distributed)
        if not metrics["faults/nonfinite_rewards"]:
            check = None  # it ran with this iteration's update
        faulty = run.count_faults(metrics)
        done = it + 1
        if done % args.eval_every == 0 or done == args.num_iterations:
            eval_metrics, images = evaluate_()
            metrics.update(eval_metrics)
            run.save_grid(images, f"eval_iter_{done:06d}.png", shown)
        run.write_metrics(done, metrics)
        run.stop_after_too_many_faults()
        bar.set_postfix(reward=f"{metrics[first_reward]:.4f}", loss=f"{metrics.get('losses/loss', 0):.2e}",
                        s_it=f"{metrics['time/iteration']:.1f}")
        stop = run.should_stop()
        # no periodic checkpoint from a faulty iteration: the last good one must survive the rotation
        if (done % args.checkpoint_every == 0 or done == args.num_iterations) and not faulty or stop:
            run.save(done, policy.model, policy.transformer, policy.optimizer, config,
                     policy.adapter.pipeline_class, policy.params, policy.ema)
        if stop:
            run.log(f"stopped after iteration {done}; continue with the same command plus --resume")
            return
    bar.close()
    if run.optimizer_steps == 0:
        raise SystemExit(f"error: no optimizer step succeeded in iterations {start}..{args.num_iterations}; "
                         f"nothing was learned (see faults/* in metrics.jsonl)")
    if distributed:
        run.check_ranks_agree(policy.params)
    if run.master and before and metrics:
        run.summary(before, metrics, policy.reward_fns)


def gradient_check(args, policy, sigmas, log):
    """A closure that checks the first update's gradient against the math attention kernel's (and fp32's where
    the run is bf16 on fp32 weights) and stops the run with one line when they disagree; None when turned off.
    It costs two or three forward-backward passes of one sample, once, and matters on accelerators, where the
    fast kernels live (on the CPU it passes trivially)."""
    if not args.gradient_check:
        return None

    def check(update_velocity, rollout, advantages):
        # the log-likelihood of the first prompt's members at its first trained step, through the update's path
        loss_fn = update_loss(update_velocity, rollout, sigmas, args.eta)
        result = policy.adapter.kernels.check_gradient(loss_fn, policy.params)
        if not result.ok:
            raise SystemExit(f"error: gradient self-check failed: {result.message}")
        log(f"gradient self-check passed: {result.message}")

    return check


def main(args):
    # ---- distributed: one short block keyed on RANK, so the same script runs on a laptop and on many GPUs ----
    distributed = int(os.environ.get("RANK", -1)) != -1
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if distributed else (0, 1)
    master = rank == 0
    log = print if master else (lambda *a, **k: None)
    prompts, eval_prompts, reward_weights = validate(args, world, log)
    run = Run(args, rank, world, distributed, log)
    config = dataclasses.asdict(args)
    try:
        resume_from = run.open(config) if master else None
        if distributed:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, timeout=timedelta(minutes=args.dist_timeout_minutes))
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
                return
        policy = build_policy(args, device, dtype, reward_weights, distributed, log)
        _warn_long_prompts(args, policy, prompts + eval_prompts, log)
        if resume_from:
            state = checkpoint.load(resume_from, policy.model, policy.transformer, policy.optimizer, args.lora_rank > 0)
            if policy.ema is not None:
                if "ema" not in state["extra"]:
                    fail(f"{resume_from} holds no EMA weights; resume without --ema-decay or start a new run")
                policy.ema.load_state_dict(state["extra"]["ema"])
            log(f"resumed from {resume_from} at iteration {start}")
        if master:
            run.begin(config, fresh=not resume_from)
        run.open_tracker(config)
        run.catch_signals()
        train(args, config, policy, run, prompts, eval_prompts, start, rank, world, distributed)
        if distributed:
            dist.barrier()  # leave together: a rank tearing down its process group early can abort another
    finally:
        run.close()
        if distributed and dist.is_initialized():
            dist.destroy_process_group()


def _warn_long_prompts(args, policy, prompts, log):
    pipe = policy.adapter.pipe  # the T5 tokenizer that --max-sequence-length limits: SD3's third, FLUX's second
    tokenizer = getattr(pipe, "tokenizer_3", None) or getattr(pipe, "tokenizer_2", None) or pipe.tokenizer
    long = [p for p in prompts if len(tokenizer(p).input_ids) > args.max_sequence_length]
    if long:
        log(f"warning: {len(long)} prompts exceed {args.max_sequence_length} text tokens and are truncated "
            f"(first: '{long[0][:60]}...')")


if __name__ == "__main__":
    main(parse_args())
