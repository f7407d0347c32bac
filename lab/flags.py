"""The flags of a training run, defined once for every script that takes them (train.py, evaluate.py, tools/plan.py).

`TrainArgs` holds every flag that every method shares, with its meaning, typical range, the paper's symbol and the
reference value; the chosen method's own flags join them (its class in methods/ declares them, `args_class`), and
so do each reward's model paths (rewards.REWARDS declares them). `--model` picks a preset of defaults (`PRESETS`:
the model's own settings), over which every method starts from the default method's values on that model (g2rpo.py's
`VALUES`) and `--method` lays its own (the `recipe` and `presets` at the top of its file); every other flag
overrides them all, and --show-config prints where each value came from. `check_flags`
checks every flag before anything is loaded or written (each numeric TrainArgs flag has its range in `RULES`, a
method's own in its `problem`, after one rule for all: its float flags are finite, `non_finite_problem`) and prints
the notes that need no model; `warn_long_prompts` is the one warning that needs the tokenizer. `resume_keys(method)`
are those a resumed run must share with its checkpoint: `RESUME_FLAGS` and the method's own.
"""
import ast
import dataclasses
import functools
import importlib.util
import inspect
import os
import re
import sys
import textwrap
import types
import typing
import weakref
from dataclasses import dataclass, field
from math import isfinite
from typing import Annotated, Literal, Optional

import tyro

import rewards
from lab import fail
from lab.kernels import ATTENTION_BACKENDS, ROLLOUT_PRECISIONS, fp8_problem
from lab.models import ADAPTERS, RESOLUTION_MULTIPLE
from methods import DEFAULT_METHOD, METHODS, STEP_CREDITS
from sampler import SIGMA_GRIDS, sigma_schedule


def read_prompts(path: str, what: str):
    """The non-empty lines of a UTF-8 text file (a byte-order mark dropped), or one clear error line; control
    characters (a NUL, an escape) are refused with their line, since they silently change what a prompt means."""
    import stat

    if os.path.isdir(path):
        fail(f"{what} '{path}' is a folder; pass a text file with one prompt a line")
    if path and os.path.exists(path) and not os.path.isfile(path):
        mode = os.stat(path).st_mode
        kind = ("a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or
                stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        fail(f"{what} '{path}' is {kind}; pass a text file with one prompt a line")
    if not path or not os.path.isfile(path):
        hint = how_to_write(path) if path else ""
        fail(f"{what} '{path}' not found; " + (hint or "pass a text file with one prompt a line"))
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a byte-order mark is not part of the first prompt
            lines = list(enumerate(f, start=1))
    except (OSError, UnicodeDecodeError) as err:
        fail(f"{what} '{path}' cannot be read ({type(err).__name__}); pass a readable UTF-8 text file")
    for number, line in lines:
        bad = next((c for c in line.rstrip("\r\n") if ord(c) < 32 and c != "\t" or ord(c) == 127), None)
        if bad is not None:
            fail(f"{what} '{path}' line {number} holds the control character {bad!r}; remove it (a prompt is text)")
    prompts = [line.strip() for _, line in lines if line.strip()]
    if not prompts:
        fail(f"{what} '{path}' holds no prompts; put one prompt on each line")
    return prompts


def how_to_write(path: str) -> str:
    """The command that writes a missing prompt file, or '' when no tool of this project writes that file."""
    hpdv2 = {"hpdv2_train.txt", "hpdv2_test.txt"}
    return "write it with: python -m tools.hpdv2" if os.path.basename(path) in hpdv2 else ""


# the shared method flags' defaults: the default method's values on --model flux (g2rpo.py's VALUES), defined there
START = METHODS[DEFAULT_METHOD].presets["flux"]


@dataclass
class TrainArgs:
    # --- model ---
    model: Literal["flux", "sd3", "zimage", "flux2", "qwenimage", "wan", "wan22", "tiny"] = "flux"
    """Model family and preset of defaults: flux (FLUX.1, the paper's), sd3 (SD3 / SD3.5, CFG), zimage (Z-Image-Turbo),
    flux2 (FLUX.2 klein 4B), qwenimage (Qwen-Image, true CFG), wan (Wan 2.1 text-to-video 1.3B, CFG), wan22 (Wan 2.2
    TI2V 5B, text-to-video, CFG), tiny (built-in, CPU)."""
    model_path: str = "black-forest-labs/FLUX.1-dev"
    """A diffusers pipeline folder or hub id. Ignored by --model tiny, which builds its own."""
    guidance: float = 3.5
    """FLUX: the guidance embedding value (reference 3.5). SD3, Z-Image, FLUX.2, Wan: the classifier-free guidance
    scale (SD3.5 typ. 4.5; Z-Image-Turbo and FLUX.2 klein 0, no guidance; the klein base models 4; Wan 5, > 1 on)."""
    max_sequence_length: int = 512
    """Text tokens per prompt (FLUX max 512, SD3 max 256); longer prompts are truncated with a warning."""
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
    cuDNN attention, whose backward gave wrong gradients on an H200 (docs/performance.md, "GPU"); math is the slow,
    exact one."""
    rollout_attention_backend: Literal[ATTENTION_BACKENDS] = "auto"
    """Attention kernel of the no-grad rollout and evaluation (forward only)."""
    rollout_precision: Literal[ROLLOUT_PRECISIONS] = "bf16"
    """bf16: every rollout forward in the run's precision. fp8: the forwards that only make images to score (the
    ODE completions, the anchor's untrained steps: 1,700 of the 1,708 a prompt at the FLUX preset) run on a compiled
    FP8 copy of the transformer (torchao, per-row scales; CUDA compute capability 8.9+; requirements-fp8.txt); the
    trained steps, whose log-probabilities the update divides by, the update and the evaluations stay as they are."""
    compile: bool = False
    """torch.compile the transformer's repeated blocks (regional compilation): a faster rollout and update after a
    compile of a minute or so on the first iteration."""
    gradient_check: bool = True
    """The first update's self-checks: compare its gradient with the math attention kernel's (and fp32's), and its
    first step's ratio with 1, and stop the run if either is off: a wrong kernel would otherwise skip or corrupt
    every step of a long GPU run."""
    # --- data and output ---
    prompt_file: str = "prompts/hpdv2_train.txt"
    """Training prompts, one a line (python -m tools.hpdv2 writes HPDv2's)."""
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
    """Image (or video frame) side in pixels (reference 720; a multiple of 16, of 4 for tiny)."""
    height: int = 0
    """Image (or video frame) height in pixels, when it is not --resolution (0: --resolution); the same multiple."""
    width: int = 0
    """Image (or video frame) width in pixels, when it is not --resolution (0: --resolution); the same multiple."""
    num_frames: int = 1
    """Video models (--model wan, wan22): frames per sample, 4k + 1 (the VAE packs 4 frames a latent frame). Images:
    1."""
    reward_frames: int = 1
    """Video models: the rewards score every this-many-th frame and average (an image reward per frame)."""
    num_steps: int = 16
    """N, sampling steps of the rollout (reference 16)."""
    shift: float = 3.0
    """SD3 time shift of the sigma schedule (reference 3)."""
    sigma_grid: Literal[SIGMA_GRIDS] = "linear"
    """The grid the shift bends (sampler.sigma_schedule): linear, shift(linspace(1, 0, N + 1)) (the reference's), or
    sd3, shift(linspace(1, shift(1/1000), N)) then 0 (diffusers' FlowMatchEulerDiscreteScheduler's; a method's
    presets say which grid its authors sample on). Rollouts, updates and held-out evaluations all sample on it."""
    eta: float = START["eta"]
    """eta, the SDE noise level of the branching step (typ. 0.3-1.0; each method's file gives its value)."""
    group_size: int = START["group_size"]
    """G, samples per prompt over which rewards are normalised (>= 2)."""
    sde_steps: list[int] = field(default_factory=lambda: list(START["sde_steps"]))
    """M, the steps k that branch with an SDE step and are trained (G2RPO's: the first half). A method of
    whole trajectories trains these steps of every trajectory (its recipe may set them); one with a window of its
    own trains that instead (docs/methods.md)."""
    # --- the method (each method's own flags join these under its --method: methods/) ---
    method: Literal[tuple(METHODS)] = DEFAULT_METHOD
    """The method, one of the registry's (methods/, a file each; the choices above list them; docs/methods.md
    compares them): g2rpo, the paper's, by default. A method sets its algorithm's values on every --model, and with
    --model flux also its published sizes (G, N, resolution, lr, clip range, LoRA); any flag given overrides them.
    --method NAME --help lists that method's own flags."""
    step_credit: Literal[STEP_CREDITS] = "own"
    """The advantage each trained step gets: own (the method: its own branch's); mean (every step of a member the
    mean of its steps') and rolled (step k gets step k + 1's) destroy the step credit: the bench's controls. For
    every method whose steps have their own advantages (g2rpo and its authors' follow-ups)."""
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
    lr: float = START["lr"]
    """AdamW learning rate (a full fine-tune's; typ. 1e-4 with LoRA)."""
    weight_decay: float = START["weight_decay"]
    """AdamW weight decay."""
    clip_range: float = START["clip_range"]
    """epsilon of the clipped ratio (for a per-element-mean log-prob; its scale sets what a ratio means)."""
    adv_clip_max: float = START["adv_clip_max"]
    """Advantages are clamped to +- this."""
    max_grad_norm: float = START["max_grad_norm"]
    """Gradient-norm clip."""
    inner_epochs: int = START["inner_epochs"]
    """Passes of the update over each rollout (PPO's epochs; 1 in the reference and its peers' scripts). Only the
    first optimizer step of an iteration scores under the rollout's own policy (ratio exactly 1); every later one,
    in the first pass already where a method steps more than once (G2RPO: once per trained step), scores under the
    moved policy, and the clip range bounds how far. A later pass scores the whole rollout again so. The update is
    cheap beside the rollout, so passes are a lever on learning per second."""
    kl_beta: float = START["kl_beta"]
    """beta, weight of the KL to the base model per trained step (0 in the reference), each method's own form of it
    (its `kl`, whose docstring says how its beta compares): G2RPO's is the step's exact Gaussian KL. LoRA: the base
    is the model with its adapter off; full fine-tune: a frozen copy (twice the weights)."""
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
    final_eval_seeds: int = 0
    """Noise seeds per held-out prompt in the first and last evaluations, which a run's result is read from (0 =
    --eval-seeds). The tiny preset's 96 give 1,152 images: a success rate's standard error of at most 0.015."""
    first_eval_seeds: int = 0
    """Noise seeds per held-out prompt in the evaluation before training, of the base model (0 = --final-eval-seeds).
    Runs from one base that measure it elsewhere (tools/bench.py) pass 1; it does not change the training."""
    eval_prompts: int = 48
    """Held-out prompts in the in-training evaluation, spread evenly over --eval-prompt-file (0 = all). At the flux
    preset, 48 prompts x 2 seeds cost about 4 % of the run's rollout forwards; the full table is evaluate.py's job."""
    eval_rewards: list[str] = field(default_factory=list)
    """Held-out reward models (names as in --rewards, no weights) that score every held-out evaluation's images and
    that training never sees, logged as eval/heldout/<name>; the reward-hacking watch compares them with the trained
    rewards (lab/watch.py). The presets' less the rewards a run trains on: --model flux clip and pickscore (the paper's
    other columns with public weights), --model tiny shapes and its strict pass shapes-strict (a success rate); a list
    given replaces the preset's."""
    stop_on_hacking: bool = False
    """When the reward-hacking watch fires after an evaluation, save a checkpoint and stop (else it warns)."""
    watch_z: float = 2.0
    """The watch counts a reward's change since the first evaluation as a rise or a fall beyond this many standard
    errors of the difference."""
    watch_saturation: float = 0.05
    """The watch's limit on the rise of the held-out images' clipped share (eval/stats/saturation)."""
    watch_grid: float = 2.0
    """The watch's limit on the held-out images' grid energy, as a multiple of the first evaluation's."""
    watch_diversity: float = 0.3
    """The watch's limit on the held-out images' diversity over seeds, as a fraction of the first evaluation's (the
    tiny quick start's honest runs end at about half of it: RL narrows a prompt's pictures)."""
    keep_checkpoints: int = 2
    """Checkpoints kept in checkpoints/: the newest this many (0 = all); each removal is printed, and one holding
    files the run did not write (an export) is kept."""
    checkpoint_every: int = 50
    """Save a checkpoint every this many iterations (and at the end). This bounds what a crash loses; a SIGTERM or
    Ctrl-C saves the last completed iteration anyway (docs/reliability.md)."""
    log_with: Literal["none", "wandb", "tensorboard"] = "none"
    """Experiment tracker: scalars every iteration, held-out samples at every evaluation; files in the run folder."""
    run_name: str = ""
    """wandb's name for the run (default: the run folder's name); TensorBoard logs into the run folder."""
    tracker_project: str = "g2rpo"
    """The wandb project."""
    seed: int = 42
    """Seed of the data order and every noise (reference 42)."""
    tiny_cache: str = ".cache"
    """Where --model tiny keeps its pre-trained base model."""
    dist_timeout_minutes: float = 30.0
    """A rank waiting longer than this on a collective stops the run (a failed rank then cannot hang the rest)."""

    # --- what follows from the flags, defined once (properties and methods are not flags) ---------------------------
    @property
    def size(self) -> tuple[int, int]:
        """(height, width) in pixels (`image_size`)."""
        return image_size(self.resolution, self.height, self.width)

    @property
    def full(self) -> bool:
        """Full fine-tuning (--lora-rank 0; FSDP2 across ranks), else LoRA (DDP)."""
        return self.lora_rank == 0

    @property
    def lora_alpha_applied(self) -> float:
        """LoRA's alpha as trained: --lora-alpha, or the rank when it is 0."""
        return lora_alpha(self.lora_rank, self.lora_alpha)

    def global_batch(self, world: int) -> int:
        """Prompts per iteration over all `world` ranks: --prompts-per-iteration, or one per rank when it is 0."""
        return self.prompts_per_iteration or world


def image_size(resolution: int, height: int, width: int) -> tuple[int, int]:
    """(height, width) in pixels: --height and --width, each --resolution where 0 (train.py's flags, or a run's
    config.json as evaluate.py reads it)."""
    return height or resolution, width or resolution


def lora_alpha(rank: int, alpha: float) -> float:
    """The alpha of a LoRA of this rank saved with this --lora-alpha (0: alpha = rank); evaluate.py reads a run's."""
    return alpha or rank


def reward_path_fields(defaults=None) -> list:
    """Dataclass fields, one flag per path field of rewards.REWARDS (its help and default, or `defaults`' value),
    for every script that loads reward models (train.py, evaluate.py)."""
    return [(name, Annotated[str, tyro.conf.arg(help=help_)], field(default=(defaults or {}).get(name, default)))
            for name, default, help_ in rewards.path_fields()]


# the flags a resumed run must share with its checkpoint (the model, the data and the algorithm), to which every
# method's own flags are added (`resume_keys`); the rest may change on --resume, applied from then on
RESUME_FLAGS = ("method", "model", "model_path", "lora_rank", "lora_alpha", "lora_feed_forward", "guidance",
                "max_sequence_length", "eta", "resolution", "height", "width", "group_size", "num_steps", "shift",
                "sigma_grid", "sde_steps", "rewards", "seed", "prompts_per_iteration", "kl_beta", "ema_decay",
                "ema_every", "num_frames", "reward_frames", "step_credit")


def resume_keys(method: str) -> list[str]:
    """The flags a resumed run of `method` must share with its checkpoint."""
    return [*RESUME_FLAGS, *own_flags(method)]


def method_fields(method: str) -> list:
    """Dataclass fields, one flag per field of the method's class that is not a TrainArgs flag: its own flags, with
    their defaults and the docstrings under them as help."""
    cls, common = METHODS[method], {f.name for f in dataclasses.fields(TrainArgs)}
    hints, helps = typing.get_type_hints(cls), _field_docstrings(cls)
    return [(f.name, Annotated[hints[f.name], tyro.conf.arg(help=helps.get(f.name, ""))],
             field(default_factory=f.default_factory) if f.default_factory is not dataclasses.MISSING
             else field(default=f.default))
            for f in dataclasses.fields(cls) if f.name not in common]


def args_class(method: str, base=None):
    """The flags of a run of `method`: TrainArgs (or `base`, a dataclass derived from it, for a script that takes
    these flags and more: tools/plan.py), the method's own flags, and every reward's model paths, declared once in
    rewards.REWARDS."""
    # --method's choices are read now, so that a method registered after import (a fork's, a test's) is one of them
    choice = ("method", Annotated[Literal[tuple(METHODS)], tyro.conf.arg(help=flag_help("method"))],
              field(default=DEFAULT_METHOD))
    return dataclasses.make_dataclass("Args", [choice, *method_fields(method), *reward_path_fields()],
                                      bases=(base or TrainArgs,))


def own_flags(method: str) -> list[str]:
    """The names of a method's own flags."""
    return [name for name, _, _ in method_fields(method)]

PRESETS = {
    "flux": dict(eval_rewards=["clip", "pickscore"]),
    "sd3": dict(model_path="stabilityai/stable-diffusion-3.5-medium", guidance=4.5, max_sequence_length=256,
                resolution=512, lora_rank=32, output_dir="runs/sd3"),
    # Z-Image-Turbo as its model card samples it: 1024², 9 steps of the shift-3 schedule, no guidance; LoRA on one GPU
    "zimage": dict(model_path="Tongyi-MAI/Z-Image-Turbo", guidance=0.0, max_sequence_length=512, resolution=1024,
                   num_steps=9, shift=3.0, lora_rank=32, output_dir="runs/zimage"),
    # FLUX.2 klein 4B (distilled) as its card samples it: 1024², 4 steps, no guidance. The pipeline shifts the
    # schedule by exp(mu), mu = compute_empirical_mu(4096 tokens, 4 steps): 9.89 (recompute for other sizes)
    "flux2": dict(model_path="black-forest-labs/FLUX.2-klein-4B", guidance=0.0, max_sequence_length=512,
                  resolution=1024, num_steps=4, shift=9.89, lora_rank=32, output_dir="runs/flux2"),
    # Qwen-Image as its model card samples it: 1328² (the card's 1:1 size; the pipeline's default is 1024²), 50 steps
    # (card and pipeline), true CFG 4 against the negative prompt " " (card; the pipeline's true_cfg_scale default is
    # 4 too). Its scheduler shifts the schedule by exp(mu), mu = calculate_shift(6889 tokens, 256, 8192, 0.5, 0.9) =
    # 0.834: 2.30 (recompute for other sizes); it also stretches the schedule to end at sigma 0.02 before 0
    # (shift_terminal), which this project does not (deviation 15). Calls of 8 (16 sequences with CFG) and decodes of
    # 2 images (tools/plan.py: 24 and 16 would need 148 GiB)
    "qwenimage": dict(model_path="Qwen/Qwen-Image", guidance=4.0, max_sequence_length=512, resolution=1328,
                      num_steps=50, shift=2.30, lora_rank=32, max_batch=8, reward_batch_size=2,
                      output_dir="runs/qwenimage"),
    # Wan 2.1 T2V 1.3B as its card samples it: 832 x 480, 81 frames, 50 steps, flow shift 3, guidance 5. Rewards score
    # every 4th frame
    "wan": dict(model_path="Wan-AI/Wan2.1-T2V-1.3B-Diffusers", guidance=5.0, max_sequence_length=512, resolution=480,
                width=832, num_frames=81, reward_frames=4, num_steps=50, shift=3.0, max_batch=8, reward_batch_size=4,
                lora_rank=32, output_dir="runs/wan"),
    # Wan 2.2 TI2V 5B as its card's text-to-video example samples it: 1280 x 704, 121 frames, 50 steps, guidance 5,
    # and its shift 5 (the Wan 2.2 repository's sample shift for ti2v-5B); its VAE is 16x, so sides are multiples of
    # 32. The reward frames as Wan 2.1's preset; videos decoded one at a time (tools/plan.py: decoding one 121-frame
    # video at 1280 x 704 takes 18.9 GiB of activations, a batch of 4 a 102 GiB phase)
    "wan22": dict(model_path="Wan-AI/Wan2.2-TI2V-5B-Diffusers", guidance=5.0, max_sequence_length=512,
                  resolution=704, width=1280, num_frames=121, reward_frames=4, num_steps=50, shift=5.0, max_batch=4,
                  reward_batch_size=1, lora_rank=32, output_dir="runs/wan22"),
    # fp32 on every device (deviation 12): bf16 cost the first tiny world a tenth of its held-out reward. 8 eval seeds:
    # 96 held-out images, a success rate's standard error about 0.05, in training; the first and last evaluations
    # take 96 seeds, 1,152 images: at most 0.015 (8.7 s each on 2 cores). 120 iterations: 4 of 5 seeds end 0.2 above the
    # base on one machine of this project's kind, 5 of 5 on another (160: 5 of 5 on both), docs/tiny_world.md
    "tiny": dict(model_path="", max_sequence_length=16, resolution=32, num_steps=8, prompts_per_iteration=8,
                 max_batch=512, rewards=["shapes=1.0"], num_iterations=120, eval_every=20, eval_seeds=8,
                 final_eval_seeds=96, eval_prompts=0, checkpoint_every=40,
                 gradient_checkpointing=False, mixed_precision="no", prompt_file="prompts/tiny_train.txt",
                 eval_prompt_file="prompts/tiny_eval.txt", output_dir="runs/tiny", seed=0,
                 eval_rewards=["shapes", "shapes-strict"]),  # held out: the strict pass's success rate
}


def run_config(args) -> dict:
    """The run's flags as its config.json records them: a --model-path folder as an absolute path, which reads the
    same from any folder (evaluate.py, a resume)."""
    config = dataclasses.asdict(args)
    if os.path.isdir(args.model_path):
        config["model_path"] = os.path.abspath(args.model_path)
    return config


def method_of(args):
    """The method of a run's flags (methods/): its class, each field from the flag of its name."""
    cls = METHODS[args.method]
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def recipe_values(method: str, model: str, num_steps: int, sde_type=None) -> dict:
    """Every value --method sets under --model, for a run of `num_steps` steps: the method's recipe (on every
    --model), its values for this --model (its published sizes on flux), those of its --sde-type `sde_type` there
    (None: its default's; a CPS step's clip range), and the values that follow N."""
    cls = METHODS[method]
    values = {**cls.recipe, **cls.presets.get(model, {})}
    values.update(getattr(cls, "per_sde_type", {}).get(sde_type, {}).get(model, {}))
    values.update({name: rule(num_steps) for name, rule in cls.per_steps.items()})
    return values


def starting_values(model: str) -> dict:
    """The values of the shared method flags every method starts from under --model: the default method's there
    (g2rpo.py's VALUES); a method's own file overrides them."""
    names = {f.name for f in dataclasses.fields(TrainArgs)}
    return {k: v for k, v in {**START, **METHODS[DEFAULT_METHOD].presets.get(model, {})}.items() if k in names}


def method_defaults(model: str, method: str, sde_type=None) -> dict:
    """The defaults under --model and --method (and a method's --sde-type): the recipe over the starting values
    over the preset, each where the method has that flag."""
    names = {f.name for f in dataclasses.fields(TrainArgs)} | set(own_flags(method))
    values = {**PRESETS[model], **starting_values(model),
              **recipe_values(method, model, _preset_steps(model, method), sde_type)}
    return {name: value for name, value in values.items() if name in names}


_GIVEN = {}  # id(args) -> the names of the flags its command line gave (kept off the args: vars(args) is the config)


def recipe_note(args, message: str) -> str:
    """`message`, saying which of the values it names the user did not give (--method's recipe, --model's preset or
    the flag's default set them), so the user can tell what to change; parse_args records the flags given."""
    given = _GIVEN.get(id(args))
    if given is None:
        return message
    set_for_them = [f.name for f in dataclasses.fields(args) if f.name not in given | {"model", "method"}
                    and re.search(rf"{re.escape(flag(f.name))}\b(?!-)", message)]
    if not set_for_them:
        return message
    values = ", ".join(f"{flag(name)} {_spelled(getattr(args, name))}" for name in set_for_them)
    it = "it" if len(set_for_them) == 1 else "them"
    return (f"{message} ({values}: the default of --model {args.model} --method {args.method}, not given; give {it} "
            f"to change {it})")


def _spelled(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _given(argv, name: str) -> bool:
    """Whether the command line sets the flag of field `name` (--name value or --name=value; tyro's --no-name)."""
    spelled = {flag(name), "--" + name, "--no-" + name.replace("_", "-"), "--no_" + name}
    return any(a.split("=", 1)[0] in spelled for a in argv)


# flags of an earlier version, whose algorithm axes each method now fixes as its authors run it
REMOVED = {
    "--sampling": "use --method full-sde for whole SDE trajectories, or a peer's --method (docs/methods.md)",
    **{name: "each method now runs its own, as its authors do; choose the --method (docs/methods.md)"
       for name in ("--decode", "--adv-std", "--same-noise", "--no-same-noise", "--kl-form",
                    "--reward-fusion", "--window-schedule")},
}


def _members(t) -> list:
    """A field's type seen through Annotated[...] and unions (Optional[...], X | None): the types it may hold."""
    origin = typing.get_origin(t)
    if origin is Annotated:
        return _members(typing.get_args(t)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(t) for m in _members(arg)]
    return [t]


def refuse_repeats(argv, cls):
    """A list flag of the dataclass `cls` given twice is refused in one line: its parser would silently keep the
    last list. (A scalar flag given twice keeps the last, as command lines do, so a later flag overrides a script's.)"""
    def is_list(t):
        return any(typing.get_origin(m) in (list, tuple) or m in (list, tuple) for m in _members(t))

    lists = {flag(f.name) for f in dataclasses.fields(cls) if is_list(f.type)}
    lists |= {"--" + name[2:].replace("-", "_") for name in lists}  # tyro's other spelling
    seen = set()
    for a in argv:
        name = a.split("=", 1)[0]
        if name in lists:
            name = flag(name[2:])
            if name in seen:
                fail(f"{name} is given twice; give it once (a list flag takes all its values after one {name}: "
                     f"{name} A B)")
            seen.add(name)


def refuse_unread(argv, method: str):
    """A run flag that --method never reads, given, is refused in one line: it would change nothing (the shared
    fields a method lists in `unread`, and --sde-steps under a method that has no such field)."""
    cls = METHODS[method]
    unread = dict(cls.unread)
    if "sde_steps" not in {f.name for f in dataclasses.fields(cls)}:
        unread["sde_steps"] = "it chooses the steps it trains itself, by its own flags"
    for name, why in unread.items():
        if _given(argv, name):
            fail(f"{flag(name)} is not read by --method {method} ({why}); drop it")


def refuse_bad_choices(argv, cls):
    """A flag of the dataclass `cls` with a fixed set of values, given another, is refused in one line (its parser
    would print a box of several)."""
    for f in dataclasses.fields(cls):
        members = _members(f.type)
        if not any(typing.get_origin(m) is Literal for m in members):
            continue
        choices = [str(c) for m in members for c in (typing.get_args(m) if typing.get_origin(m) is Literal
                                                     else ("None",) if m is type(None) else ())]
        spelled = {flag(f.name), "--" + f.name}
        for i, a in enumerate(argv):
            name, eq, value = a.partition("=")
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
            if name in spelled and value is not None and not value.startswith("--") and value not in choices:
                fail(f"{flag(f.name)} {value}: not one of its values; choose one of {', '.join(choices)}")


def _choice(argv, name: str, default: str) -> str:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return default


def parse_args(argv=None, base=None):
    """`--model` picks a preset of defaults and `--method` a recipe over it; every other flag overrides both (and
    --help shows the resulting values). `base`: a dataclass derived from TrainArgs, for a script that takes these
    flags and more (tools/plan.py)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--show-config" in argv:  # print the resolved values and where they came from, load nothing, and leave
        args = parse_args([a for a in argv if a != "--show-config"], base)
        print(show_config(args))
        raise SystemExit(0)
    model, method = _choice(argv, "--model", "flux"), _choice(argv, "--method", DEFAULT_METHOD)
    if model not in PRESETS:
        fail(f"unknown --model '{model}'; choose one of: {', '.join(PRESETS)}")
    if method not in METHODS:
        fail(f"unknown --method '{method}'; choose one of: {', '.join(METHODS)}")
    mine = {flag(name) for name in own_flags(method)}
    owners = {}  # each flag of another method given here: the methods whose flag it is
    for other in METHODS:
        for name in own_flags(other):
            spelled = {flag(name), "--no-" + name.replace("_", "-")}
            if flag(name) not in mine and any(a.split("=", 1)[0] in spelled for a in argv):
                owners.setdefault(flag(name), []).append(other)
    for name, others in owners.items():
        named = " or ".join([", ".join(others[:-1]), others[-1]] if len(others) > 1 else others)
        fail(f"{name} is a flag of --method {named}, not of --method {method}; drop it, or use "
             + (f"--method {others[0]}" if len(others) == 1 else "one of those methods"))
    refuse_unread(argv, method)
    cls = args_class(method, base)
    refuse_repeats(argv, cls)
    refuse_bad_choices(argv, cls)
    known = {spelling for f in dataclasses.fields(cls) for spelling in (flag(f.name), "--" + f.name,
                                                                         "--no-" + f.name.replace("_", "-"))}
    for a in argv:
        name = a.split("=", 1)[0]
        if name.startswith("--") and name not in known | {"--help"}:
            fail(f"unknown flag {name}" + (f": {REMOVED[name]}" if name in REMOVED else
                                            f" for --method {method}; see python train.py --method {method} --help"))
    sde_type = _choice(argv, "--sde-type", None) if "sde_type" in own_flags(method) else None
    args = tyro.cli(cls, args=argv, default=cls(model=model, method=method, **method_defaults(model, method, sde_type)),
                    description=description(base))
    # the recipe's values that follow N, for the N this run has (a --num-steps given), unless given themselves
    for name, rule in METHODS[method].per_steps.items():
        if not _given(argv, name):
            setattr(args, name, rule(args.num_steps))
    _GIVEN[id(args)] = frozenset(f.name for f in dataclasses.fields(cls) if _given(argv, f.name))  # (recipe_note)
    weakref.finalize(args, _GIVEN.pop, id(args), None)
    # the preset's held-out rewards leave out those the run trains on (the paper's HPS + CLIP run keeps pickscore)
    if not _given(argv, "eval_rewards"):
        args.eval_rewards = held_out_less_trained(args.eval_rewards, args.rewards)
    # a --resolution given is a square: it replaces the preset's own height and width (Wan's 832 x 480) unless they
    # are given too
    if _given(argv, "resolution"):
        for side in ("height", "width"):
            if not _given(argv, side):
                setattr(args, side, 0)
    return args


def show_config(args) -> str:
    """--show-config: every resolved value of a run's flags and where it came from, the layers of `parse_args` from
    the top (the command line; the method's file: its values that follow N, those of its --sde-type, its values on
    this --model, on every model; the values every method starts from, g2rpo.py's; the model's preset; a flag's own
    default), as aligned lines."""
    method, model = METHODS[args.method], args.model
    here = lambda cls: os.path.relpath(inspect.getsourcefile(cls), os.path.dirname(os.path.dirname(__file__)))
    sde_type = getattr(args, "sde_type", None)
    own, common = set(own_flags(args.method)), {f.name for f in dataclasses.fields(TrainArgs)}
    layers = [  # (values, where they come from), the first that holds a flag gave its value
        ({name: None for name in _GIVEN.get(id(args), ())}, "the command line"),
        (method.per_steps, f"{here(method)}: follows --num-steps"),
        (getattr(method, "per_sde_type", {}).get(sde_type, {}).get(model, {}),
         f"{here(method)}: --sde-type {sde_type} on --model {model}"),
        (method.presets.get(model, {}), f"{here(method)}: on --model {model}"),
        (method.recipe, f"{here(method)}: on every model"),
        (METHODS[DEFAULT_METHOD].presets.get(model, {}), f"{here(METHODS[DEFAULT_METHOD])}: every method's start on "
                                                         f"--model {model}"),
        (START, f"{here(METHODS[DEFAULT_METHOD])}: every method's start"),
        (PRESETS[model], f"lab/flags.py: the --model {model} preset"),
    ]
    rows = {}
    for f in dataclasses.fields(args):
        where = next((w for values, w in layers if f.name in values and (f.name in own or f.name in common)),
                     f"{here(method)}: its default" if f.name in own else
                     "lab/flags.py: its default" if f.name in common else "rewards.py: its default")
        if f.name == "eval_rewards" and where != "the command line":
            where += ", less the rewards trained on"
        rows[f.name] = (flag(f.name), _spelled(getattr(args, f.name)) or "(none)", where)
    width = [max(len(row[i]) for row in rows.values()) for i in (0, 1)]
    line = lambda name: f"  {rows[name][0]:<{width[0]}}  {rows[name][1]:<{width[1]}}  {rows[name][2]}"  # noqa: E731
    # the method's values first: its fields and the optimizer's, then the run's (the model, data, harness)
    mine = [f.name for f in dataclasses.fields(method)] + [n for n in START if n not in own | {"sde_steps"}]
    mine = [name for name in dict.fromkeys(mine) if name in rows]
    return "\n".join([f"--model {model} --method {args.method}: every value of the run, and where it came from",
                      f"the method's ({method.__module__}.{method.__name__}):", *map(line, mine), "the run's:",
                      *[line(name) for name in rows if name not in mine and name not in ("model", "method")]])


def description(base=None) -> str:
    """--help's first line: the script's own (the docstring of the module that defines `base`, e.g. tools/plan.py's,
    else of the script run, e.g. train.py's), or this module's."""
    module = sys.modules.get(base.__module__ if base is not None else "__main__")
    return ((module.__doc__ if module is not None else None) or __doc__).split("\n\n")[0]


def _preset_steps(model: str, method: str) -> int:
    return {**PRESETS[model], **METHODS[method].presets.get(model, {})}.get(
        "num_steps", TrainArgs.num_steps)


def preset(model: str, method: str = DEFAULT_METHOD, sde_type=None) -> dict:
    """Every flag's value under `--model model --method method` (and its --sde-type) and no other flag: the recipe
    over the preset over the defaults."""
    return dataclasses.asdict(args_class(method)(model=model, method=method,
                                                 **method_defaults(model, method, sde_type)))


def changed_from_preset(args) -> list[str]:
    """The flags of a run that differ from its --model and --method defaults, where they change what is computed
    (not its seed, folder, cache, logging or run management)."""
    ignored = {"seed", "output_dir", "tiny_cache", "resume", "overwrite", "log_with", "run_name", "tracker_project",
               "dist_timeout_minutes", "max_faults", "checkpoint_every", "max_batch", "reward_batch_size"}
    defaults = preset(args.model, args.method, getattr(args, "sde_type", None))
    # the preset's held-out rewards less those this run trains on, as parse_args leaves them when none are given
    defaults["eval_rewards"] = held_out_less_trained(defaults["eval_rewards"], args.rewards)
    return [flag(k) for k, v in dataclasses.asdict(args).items() if k not in ignored and defaults.get(k) != v]


def held_out_less_trained(eval_rewards, rewards) -> list:
    """The held-out rewards that a run training on `rewards` (name=weight) keeps: those it does not train on."""
    trained = {spec.partition("=")[0] for spec in rewards}
    return [name for name in eval_rewards if name not in trained]


# ---------------------------------------------------------------------------------------------------------------
# Input checks: all of them, once, before anything is loaded or written
# ---------------------------------------------------------------------------------------------------------------
# the valid range of every numeric flag (tests/test_reliability.py checks that none is missing)
def at_least(low, note=""):
    """A rule: the value is finite and >= low."""
    return (lambda v: isfinite(v) and v >= low), f">= {low}{note}"


def above(low, note=""):
    """A rule: the value is finite and > low."""
    return (lambda v: isfinite(v) and v > low), f"> {low}{note}"


RULES = {
    "guidance": at_least(0), "max_sequence_length": at_least(1), "lora_rank": at_least(0, " (0 = full fine-tune)"),
    "lora_alpha": at_least(0, " (0 = the rank)"), "resolution": at_least(4), "num_steps": at_least(1),
    "height": at_least(0, " (0 = --resolution)"), "width": at_least(0, " (0 = --resolution)"),
    "num_frames": at_least(1), "reward_frames": at_least(1, " (1 = every frame)"),
    "shift": above(0, " (reference 3)"), "eta": above(0, ": the SDE step needs eta > 0 (typ. 0.7)"),
    "group_size": at_least(2, ": a group needs at least 2 samples to normalise rewards"),
    "prompts_per_iteration": at_least(0, " (0 = one per rank)"), "max_batch": at_least(1),
    "reward_batch_size": at_least(1), "num_iterations": at_least(1),
    "lr": at_least(0, " (typ. 2e-6 full, 1e-4 LoRA; 0 learns nothing: the bench's control)"),
    "weight_decay": at_least(0),
    "clip_range": above(0, " (reference 1e-4)"), "adv_clip_max": above(0, " (reference 5)"),
    "max_grad_norm": above(0, " (reference 1)"), "kl_beta": at_least(0, " (0 = no KL term)"),
    "inner_epochs": at_least(1),
    "ema_decay": ((lambda v: 0 <= v < 1), "in [0, 1) (0 = no EMA)"), "ema_every": at_least(1),
    "max_faults": at_least(1), "eval_every": at_least(1), "eval_seeds": at_least(1),
    "final_eval_seeds": at_least(0, " (0 = --eval-seeds)"),
    "first_eval_seeds": at_least(0, " (0 = --final-eval-seeds)"),
    "eval_prompts": at_least(0, " (0 = every held-out prompt)"), "checkpoint_every": at_least(1),
    "keep_checkpoints": at_least(0, " (0 = keep all)"),
    "watch_z": above(0, " (typ. 2)"), "watch_saturation": above(0, " (a share, typ. 0.05)"),
    "watch_grid": above(1, " (a multiple of the first evaluation's, typ. 2)"),
    "watch_diversity": ((lambda v: 0 < v < 1), "in (0, 1) (a fraction of the first evaluation's, typ. 0.3)"),
    "seed": ((lambda v: 0 <= v <= 10**9), "in 0..1000000000 (it keys every noise generator, which must not overflow)"),
    "dist_timeout_minutes": above(0),
}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def flag_help(name: str) -> str:
    """A TrainArgs flag's help text: the docstring under its field, the text tyro shows in train.py --help."""
    return _field_docstrings(TrainArgs)[name]


@functools.cache
def _field_docstrings(cls) -> dict:
    """The docstring under each field of a dataclass's source (and its dataclass bases'), one line each."""
    helps = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        helps.update({a.target.id: " ".join(b.value.value.split()) for a, b in zip(body, body[1:]) if
                      isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)})
    return helps


def train_fields(names, elsewhere=(), note="", notes=None):
    """Dataclass fields of train.py's flags `names` for another script's arguments (evaluate.py): each with its
    TrainArgs type, default and help, so that no script restates a flag. A name in `elsewhere` defaults to None
    instead (its value then comes from elsewhere, which `note` says); `notes` adds a sentence to a flag's help."""
    hints, notes = typing.get_type_hints(TrainArgs, include_extras=True), notes or {}
    fields = []
    for name in names:
        help_ = " ".join(part for part in (flag_help(name), notes.get(name), name in elsewhere and note) if part)
        type_, default = (Optional[hints[name]], None) if name in elsewhere else (hints[name], getattr(TrainArgs, name))
        fields.append((name, Annotated[type_, tyro.conf.arg(help=help_)], field(default=default)))
    return fields


def validate(args, world: int, log=print):
    """Every check that needs no model: the flags, the machine (for --rollout-precision fp8), the prompt files.
    Returns (train prompts, eval prompts, reward weights)."""
    weights = check_flags(args, world, log)
    if args.rollout_precision == "fp8":  # (tools/plan.py plans an FP8 run on any machine: it checks the flags alone)
        problem = fp8_problem(world, args.full, args.mixed_precision)
        if problem:
            fail(problem)
    prompts = (read_prompts(args.prompt_file, "--prompt-file"),
               read_prompts(args.eval_prompt_file, "--eval-prompt-file"))
    # the rewards' files, before anything is loaded or written: a trained reward's, or a held-out one named by the
    # user, must be there; a held-out one of the preset's that is not is left out with a line (an offline node)
    for name in weights:
        try:
            rewards.check_files(name, vars(args))
        except rewards.RewardError as err:
            fail(str(err))
    for name in list(rewards.parse_rewards(args.eval_rewards, weighted=False) if args.eval_rewards else []):
        try:
            rewards.check_files(name, vars(args))
        except rewards.RewardError as err:
            leave_out_held_out(args, name, err, log)
    return (*prompts, weights)


def leave_out_held_out(args, name: str, err, log=print):
    """A held-out reward that cannot be had (its file, or its model offline): refused in one line when the user
    named it in --eval-rewards; the preset's is left out of args.eval_rewards with a line, and the run goes on
    without it (the watch keeps its image statistics)."""
    if given(args, "eval_rewards"):
        fail(f"--eval-rewards: {err}; or leave it out of --eval-rewards")
    log(f"note: the held-out reward {name} of the --model {args.model} preset is left out: {err}")
    args.eval_rewards = [n for n in args.eval_rewards if n != name]


def given(args, name: str) -> bool:
    """Whether the command line that made `args` (parse_args) gave the flag of field `name`; True for args made
    otherwise (then every value counts as the user's)."""
    names = _GIVEN.get(id(args))
    return names is None or name in names


# the pipeline class each family's model_index.json names (what `folder_family` reads): its adapter's
PIPELINES = {family: adapter.pipeline_class.__name__ for family, adapter in ADAPTERS.items() if family != "tiny"}


def _model_index(path: str) -> dict:
    """A local pipeline folder's model_index.json, or {} (a hub id, no such file, not JSON)."""
    import json

    try:
        with open(os.path.join(path, "model_index.json")) as f:
            index = json.load(f)
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def folder_family(path: str) -> str | None:
    """The family of a local pipeline folder by its model_index.json's `_class_name`, or None (a hub id, no such
    file, or a pipeline class of no family here)."""
    index = _model_index(path)
    if index.get("_class_name") == "WanPipeline":  # Wan 2.2 TI2V 5B is the one that expands its timesteps per token
        return "wan22" if index.get("expand_timesteps") else "wan"
    return next((family for family, pipeline in PIPELINES.items() if pipeline == index.get("_class_name")), None)


VIDEO_MODELS = ("wan", "wan22")


def frames_problem(model: str, num_frames: int, name: str) -> str | None:
    """Why `num_frames` (the setting `name`) does not suit `model`, in one line, or None: Wan takes 4k + 1 frames,
    image models 1."""
    if model in VIDEO_MODELS and (num_frames < 1 or (num_frames - 1) % 4):
        return (f"{name} {num_frames}: Wan takes 4k + 1 frames (the VAE packs 4 frames a latent frame); use e.g. "
                f"{max(1, (num_frames - 1) // 4 * 4 + 1)}")
    if model not in VIDEO_MODELS and num_frames != 1:
        return f"{name} {num_frames} is for video models (--model wan, wan22); --model {model} makes images"
    return None


def reward_frames_problem(model: str, num_frames: int, reward_frames: int, name: str) -> str | None:
    """Why scoring every `reward_frames`-th frame (the setting `name`) does not suit `model` and `num_frames`, in one
    line, or None: it is for video models, and at most the frame count (past it only frame 0 would be scored)."""
    if model not in VIDEO_MODELS and reward_frames != 1:
        return (f"{name} {reward_frames} is for video models (--model wan, wan22); --model {model} makes images, so "
                f"drop it")
    if reward_frames > num_frames:
        return (f"{name} {reward_frames} is more than the {num_frames} frames: only frame 0 would be scored; use at "
                f"most {num_frames} (1 = every frame)")
    return None


def non_finite_problem(args) -> str | None:
    """The first float flag of the method's own (or float in a list flag of its own) that is not finite (nan, inf),
    in one line, or None: one rule for every method, before its `problem`, whose comparisons (x < 0) nan passes. A
    flag the method names in its `non_finite` may be so."""
    cls = METHODS[args.method]
    for name in own_flags(args.method):
        value = getattr(args, name)
        values = value if isinstance(value, (list, tuple)) else [value]
        if name not in cls.non_finite and any(isinstance(v, float) and not isfinite(v) for v in values):
            own = cls.__dataclass_fields__[name]
            default = method_defaults(args.model, args.method, getattr(args, "sde_type", None)).get(
                name, own.default_factory() if own.default is dataclasses.MISSING else own.default)
            return f"{flag(name)} {_spelled(value)}: must be a finite number (the default: {_spelled(default)})"
    return None


def check_flags(args, world: int, log=print):
    """Every check of the flags themselves (no file is read). Returns the reward weights."""
    def refuse(message):
        fail(recipe_note(args, message))

    for f in dataclasses.fields(TrainArgs):
        if f.name in RULES and not RULES[f.name][0](getattr(args, f.name)):
            refuse(f"{flag(f.name)} {getattr(args, f.name)}: must be {RULES[f.name][1]}")
    method = method_of(args)
    problem = non_finite_problem(args) or method.problem(args.num_steps)
    if problem:  # (a run's flag the method reads, such as --sde-steps, is named as it is)
        refuse(problem if problem.startswith("--sde-steps") else f"--method {args.method}: {problem}")
    if args.step_credit != "own" and not method.per_step_advantages:
        refuse(f"--step-credit {args.step_credit} moves advantages between steps, and --method {args.method} gives a "
             f"whole trajectory one advantage for all of them; it is a control for the methods whose steps have "
             f"their own advantages")
    problem = frames_problem(args.model, args.num_frames, "--num-frames")
    if problem:
        refuse(problem)
    problem = reward_frames_problem(args.model, args.num_frames, args.reward_frames, "--reward-frames")
    if problem:
        refuse(problem)
    if args.model == "flux2" and args.guidance > 1 and _model_index(args.model_path).get("is_distilled"):
        refuse(f"--guidance {args.guidance}: '{args.model_path}' is a distilled FLUX.2 klein, which samples without "
             f"guidance (its pipeline ignores the value); use --guidance 0, or a base (non-distilled) model")
    family = folder_family(args.model_path) if args.model != "tiny" else None
    named = _model_index(args.model_path).get("_class_name") if args.model != "tiny" else None
    if named and family is None:  # a variant (an image-to-image pipeline, say) of no family here
        refuse(f"--model-path '{args.model_path}' holds a {named} (its model_index.json), which no --model trains; "
             f"pass a folder of one of: {', '.join(sorted(set(PIPELINES.values())))}")
    if family and family != args.model:
        refuse(f"--model-path '{args.model_path}' is a {family} folder (its model_index.json names the "
             f"{PIPELINES[family]}); use --model {family}, or a {args.model} folder")
    multiple = RESOLUTION_MULTIPLE[args.model]
    sides = [("--height", args.height), ("--width", args.width)]
    for name, value in ([] if args.height and args.width else [("--resolution", args.resolution)]) + sides:
        if value % multiple:
            refuse(f"{name} {value} is not a multiple of {multiple} (VAE factor x 2x2 patches); "
                 f"use e.g. {value // multiple * multiple or multiple}")
    if args.prompts_per_iteration % world:
        refuse(f"--prompts-per-iteration {args.prompts_per_iteration} does not split over {world} ranks; "
             f"use a multiple of {world}")
    if args.resume and args.overwrite:
        refuse("--resume and --overwrite contradict each other; pass one")
    if args.log_with == "wandb" and (not args.tracker_project or any(c in args.tracker_project for c in "/\\#?%:")):
        refuse(f"--tracker-project '{args.tracker_project}': a wandb project name cannot be empty or hold / \\ # ? % :; "
             f"use e.g. g2rpo")
    if args.log_with != "none" and importlib.util.find_spec(args.log_with) is None:  # the package is named so
        refuse(f"--log-with {args.log_with} needs its package: pip install -r requirements.txt")
    if args.log_with != "none":  # installed but broken (a stub, a half-removed package): now, not after the models load
        try:
            importlib.import_module("torch.utils.tensorboard" if args.log_with == "tensorboard" else "wandb")
        except Exception as err:
            refuse(f"--log-with {args.log_with}: its package does not import ({type(err).__name__}: "
                 f"{str(err).splitlines()[0] if str(err) else ''}); reinstall it: pip install -r requirements.txt")
    if args.model != "tiny" and not (os.path.isdir(args.model_path) or args.model_path.count("/") == 1):
        refuse(f"--model-path '{args.model_path}' is neither a folder nor a hub id (org/name); "
             f"pass the folder holding model_index.json")
    try:
        weights = rewards.parse_rewards(args.rewards)
    except rewards.RewardError as err:
        refuse(str(err))
    try:
        held_out = rewards.parse_rewards(args.eval_rewards, weighted=False) if args.eval_rewards else {}
    except rewards.RewardError as err:
        refuse(f"--eval-rewards: {err}")
    trained = sorted(set(held_out) & set(weights))
    if trained:
        refuse(f"--eval-rewards {trained[0]} is trained on (--rewards); a held-out reward must be one training never "
               f"sees: drop it from one of the two")
    if any(held_out[n] != 1.0 for n in held_out):
        refuse(f"--eval-rewards takes names without weights ({args.eval_rewards}); e.g. --eval-rewards clip pickscore")
    if args.eval_seeds < 2:
        log("note: with --eval-seeds 1 the evaluations in training have one image a prompt, so the reward-hacking "
            "watch has no diversity over seeds there (it needs 2 or more); it watches the other statistics")
    for line in method.notes(sigma_schedule(args.num_steps, args.shift, args.sigma_grid)):
        log(line)
    return weights


def warn_long_prompts(args, pipe, prompts, log=print):
    """Prompts longer than --max-sequence-length text tokens are truncated by the text encoder: say how many."""
  # the T5 tokenizer that --max-sequence-length limits: SD3's third, FLUX's second
    tokenizer = getattr(pipe, "tokenizer_3", None) or getattr(pipe, "tokenizer_2", None) or pipe.tokenizer
    long = [p for p in prompts if len(tokenizer(p).input_ids) > args.max_sequence_length]
    if long:
        log(f"warning: {len(long)} prompts exceed {args.max_sequence_length} text tokens and are truncated "
            f"(first: '{long[0][:60]}...')")
