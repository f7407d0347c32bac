"""Train a text-to-image flow model with G2RPO: the program users run.

One iteration, on each rank, for its own prompts (a group never spans ranks, so advantages need no communication):
  1. encode the prompts; draw one initial noise per prompt and per-prompt SDE noise, seeded by
     (seed, iteration, global prompt position), so the run is the same on 1 rank or many and after a resume;
  2. roll out (sampler.py): G2RPO's anchor + singular SDE branches + multi-granularity completions, or full SDE;
  3. decode every final latent and score it with every reward model (rewards.py);
  4. advantages per (reward, granularity, step), normalised in the group and summed (advantage.py);
  5. the clipped policy update, one forward per prompt per trained step (g2rpo.py).

Run it:
    python train.py --model tiny                                      # CPU, minutes: the built-in tiny model
    python train.py --model flux --lora-rank 64                       # one GPU, LoRA
    torchrun --nproc_per_node 8 train.py --model flux                 # one node, full fine-tune, FSDP2
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 train.py --model flux
    python train.py --model flux --help                               # every flag, with the preset's values

Deviations from the reference code (bcmi/Granular-GRPO; see also sampler.py, g2rpo.py):
  1. Prompts are shuffled per epoch with a seed and each rank takes whole prompts of the global batch.
  2. `--model flux` defaults to the paper's granularities {1, 2, 3}; the released scripts use {1, 2}.
  3. Held-out evaluation (anchor ODE images on fixed seeds) during training, and sample grids.
"""
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
import tyro

from trainer import Trainer, fail, read_prompts



@dataclass
class Args:
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
    # --- data and output ---
    prompt_file: str = "prompts/hpdv2_train.txt"
    """Training prompts, one a line (HPDv2's format)."""
    eval_prompt_file: str = "prompts/hpdv2_eval.txt"
    """Held-out prompts, one a line, for the eval reward and the sample grids."""
    output_dir: str = "runs/flux"
    """Where metrics.jsonl, config.json, samples/ and checkpoints/ go."""
    resume: bool = False
    """Continue from the newest complete checkpoint in --output-dir."""
    overwrite: bool = False
    """Start afresh in an --output-dir that holds another run (its checkpoints and metrics are removed)."""
    # --- rollout ---
    resolution: int = 720
    """Image side in pixels (reference 720; must be a multiple of 16 for FLUX)."""
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
    sampling: Literal["g2rpo", "full"] = "g2rpo"
    """g2rpo, or full: G full SDE trajectories per prompt, one reward broadcast to its trained steps (the
    DanceGRPO / Flow-GRPO-style control)."""
    prompts_per_iteration: int = 0
    """Prompts per iteration over all ranks (reference 16: one per GPU); 0 = one per rank."""
    max_batch: int = 24
    """Largest batch of one transformer call in the rollout and update (bounds memory)."""
    # --- rewards ---
    rewards: list[str] = field(default_factory=lambda: ["hps=1.0"])
    """Reward models with weights, name=weight (hps, clip, pickscore, aesthetic, imagereward, shapes)."""
    reward_batch_size: int = 16
    """Images per reward-model call."""
    hps_checkpoint: str = "xswu/HPSv2/HPS_v2.1_compressed.pt"
    """HPS-v2.1 state dict: a local file or hub repo/filename."""
    hps_arch: str = "ViT-H-14"
    """open_clip architecture of HPS (or an open_clip folder)."""
    clip_model: str = "hf-hub:apple/DFN5B-CLIP-ViT-H-14"
    """open_clip model of the CLIP-score reward: an open_clip folder or hf-hub:id."""
    pickscore_model: str = "yuvalkirstain/PickScore_v1"
    """PickScore CLIPModel folder or hub id."""
    pickscore_processor: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
    """PickScore CLIPProcessor folder or hub id."""
    aesthetic_clip: str = "openai/clip-vit-large-patch14"
    """CLIP ViT-L/14 of the aesthetic reward."""
    aesthetic_head: str = "sac+logos+ava1-l14-linearMSE.pth"
    """The LAION aesthetic v2 MLP head file."""
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
    max_faults: int = 5
    """Stop after this many iterations in a row whose rewards, loss or gradients were not finite."""
    # --- logging, evaluation, checkpoints ---
    eval_every: int = 25
    """Evaluate on the held-out prompts every this many iterations (and at start and end)."""
    eval_seeds: int = 2
    """Noise seeds per held-out prompt in the evaluation."""
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


PRESETS = {
    "flux": {},
    "sd3": dict(model_path="stabilityai/stable-diffusion-3.5-medium", guidance=4.5, max_sequence_length=256,
                resolution=512, lora_rank=32, lr=1e-4, output_dir="runs/sd3"),
    "tiny": dict(model_path="", max_sequence_length=16, resolution=32, num_steps=8, group_size=8,
                 sde_steps=[0, 1, 2, 3], granularities=[1, 2, 3], prompts_per_iteration=8, max_batch=512,
                 rewards=["shapes=1.0"], num_iterations=40, lr=5e-5, weight_decay=0.0, clip_range=1e-3,
                 eval_every=10, eval_seeds=3, checkpoint_every=20, gradient_checkpointing=False,
                 prompt_file="prompts/tiny_train.txt", eval_prompt_file="prompts/tiny_eval.txt",
                 output_dir="runs/tiny", seed=0),
}


def parse_args(argv=None) -> Args:
    """`--model` picks a preset of defaults; every other flag overrides it (and --help shows the preset's values)."""
    argv = sys.argv[1:] if argv is None else argv
    model = "flux"
    for i, a in enumerate(argv):
        if a == "--model" and i + 1 < len(argv):
            model = argv[i + 1]
        elif a.startswith("--model="):
            model = a.split("=", 1)[1]
    if model not in PRESETS:
        fail(f"unknown --model '{model}'; choose one of: {', '.join(PRESETS)}")
    return tyro.cli(Args, args=argv, default=Args(model=model, **PRESETS[model]),
                    description=__doc__.split("\n\n")[0])


def validate(args: Args, world: int):
    """Every check that needs no model, before anything is loaded or written."""
    from rewards import RewardError, parse_rewards

    if args.group_size < 2:
        fail(f"--group-size {args.group_size}: a group needs at least 2 samples to normalise rewards; use >= 2")
    if not args.sde_steps:
        fail("--sde-steps is empty; give the steps to branch and train, e.g. --sde-steps 0 1 2 3")
    if len(set(args.sde_steps)) != len(args.sde_steps):
        fail(f"--sde-steps {args.sde_steps} repeats a step; list each step once")
    bad = [k for k in args.sde_steps if not 0 <= k < args.num_steps]
    if bad:
        fail(f"--sde-steps {bad} outside the schedule of --num-steps {args.num_steps}; use steps in 0..{args.num_steps - 1}")
    if not args.granularities or min(args.granularities) < 1 or len(set(args.granularities)) != len(args.granularities):
        fail(f"--granularities {args.granularities}: give distinct strides >= 1, e.g. --granularities 1 2 3")
    if args.eta <= 0:
        fail(f"--eta {args.eta}: the SDE step needs eta > 0 (typ. 0.7)")
    multiple = 4 if args.model == "tiny" else 16
    if args.resolution % multiple:
        fail(f"--resolution {args.resolution} is not a multiple of {multiple} (VAE factor x 2x2 patches); "
             f"use e.g. {args.resolution // multiple * multiple or multiple}")
    if args.prompts_per_iteration and args.prompts_per_iteration % world:
        fail(f"--prompts-per-iteration {args.prompts_per_iteration} does not split over {world} ranks; "
             f"use a multiple of {world}")
    read_prompts(args.prompt_file, "--prompt-file")
    read_prompts(args.eval_prompt_file, "--eval-prompt-file")
    try:
        parse_rewards(args.rewards)
    except RewardError as err:
        fail(str(err))
    if args.model != "tiny" and not (os.path.isdir(args.model_path) or args.model_path.count("/") == 1):
        fail(f"--model-path '{args.model_path}' is neither a folder nor a hub id (org/name); "
             f"pass the folder holding model_index.json")


def prepare_output(args: Args):
    """Refuse to mix runs: an output folder holding another run needs --resume or --overwrite."""
    import checkpoint

    config_path = os.path.join(args.output_dir, "config.json")
    try:
        os.makedirs(args.output_dir, exist_ok=True)
        probe = os.path.join(args.output_dir, ".write_test")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as err:
        fail(f"--output-dir '{args.output_dir}' is not writable ({err.strerror}); choose another folder")
    latest = checkpoint.latest_checkpoint(args.output_dir)
    if args.resume:
        if latest is None:
            fail(f"--resume but '{args.output_dir}' holds no complete checkpoint; drop --resume to start afresh")
        diff = checkpoint.incompatible(checkpoint.read_trainer_state(latest)["config"], dataclasses.asdict(args))
        if diff:
            fail(f"checkpoint {latest} is from another configuration ({diff[0]}: {diff[1]} there, {diff[2]} here); "
                 f"resume with the same settings or use a new --output-dir")
        return latest
    if os.path.exists(config_path) and not args.overwrite:
        fail(f"--output-dir '{args.output_dir}' already holds a run; pass --resume to continue it, "
             f"--overwrite to replace it, or choose another folder")
    return None


def main(args: Args):
    # ---- distributed: one short block keyed on RANK, so the same script runs on a laptop and on many GPUs ----
    distributed = int(os.environ.get("RANK", -1)) != -1
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if distributed else (0, 1)
    validate(args, world)
    resume_from = prepare_output(args) if rank == 0 else None
    if distributed:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timedelta(minutes=args.dist_timeout_minutes))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        shared = [resume_from]
        dist.broadcast_object_list(shared, src=0)
        resume_from = shared[0]
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    master = rank == 0
    dtype = torch.bfloat16 if device.type == "cuda" and args.mixed_precision == "bf16" else torch.float32
    log = print if master else (lambda *a, **k: None)

    trainer = Trainer(args, device, dtype, rank, world, distributed, log)
    trainer.run(resume_from)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
