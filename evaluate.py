"""Evaluate base and fine-tuned text-to-image models side by side: the paper's table and a grid.

Every model (the base, and each `--checkpoint` as train.py saves it) generates one image per prompt and noise seed
with the deterministic sampler (Euler ODE, eta = 0) from the same initial noise, at the checkpoint run's settings
(steps, shift, guidance, resolution from its config.json unless a flag overrides them). Every metric of
`--metrics` (a reward of rewards.py) scores every image; a strict pass (the tiny world's `shapes-strict`) scores 1
or 0 an image, so its mean is the success rate. The table gives, per model and metric, the mean over all (prompt,
seed) images and its standard error std / sqrt(n), in the paper's units (PickScore / 100).

Noise: image (prompt p, seed s) starts from `run.eval_noise_generator(p, s)`, the noise of train.py's held-out
evaluation. For the tiny model, whose evaluation takes every held-out prompt, `--seeds` equal to the run's last
evaluation's (`final_eval_seeds`, or `eval_seeds` when 0) reproduces its final `eval/reward/*` on the CPU, and up to
precision on a GPU (this script keeps the transformer in bf16, training keeps fp32 master weights).

Weights: a checkpoint of a run trained with --ema-decay holds the trained weights and their EMA, and train.py's
evaluations score the EMA; so does this script by default, and says so (`--weights trained` scores the others).

Run:
    python evaluate.py --model tiny --checkpoint runs/tiny                # base vs trained, held-out tiny prompts
    python evaluate.py --model flux --model-path FLUX.1-dev --checkpoint runs/flux \\
        --metrics hps clip pickscore imagereward --hps-checkpoint HPS_v2.1_compressed.pt   # the paper's table
    torchrun --nproc_per_node 8 evaluate.py --checkpoint runs/flux        # prompts sharded over 8 GPUs

Outputs (in --output-dir; default runs/<name>/eval/ of the first checkpoint's run, runs/eval_<model> for the base
alone): table.md, results.json (settings, weights, means, standard errors, every score), grid.png (the first
--grid-prompts prompts, one row per model), images/ with --save-images. Training curves: `python -m tools.plot RUN
[RUN ...]`.
"""
import os
import signal
import sys

if __name__ == "__main__":  # a Ctrl-C while torch and the models' libraries import: the one line of any other time
    def _interrupted(*_):
        # nothing is open yet, so leave at once: an exception raised here could unwind through torch's C++ import
        # code, which then aborts the process (pybind11's error_already_set; seen in a CI run)
        print("\ninterrupted; nothing more was written", file=sys.stderr, flush=True)
        os._exit(130)

    signal.signal(signal.SIGINT, _interrupted)

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Annotated, Literal, Optional

import torch
import tyro

from lab import flags
import rewards
from lab.flags import fail, read_prompts
from lab.policy import setup_distributed
from lab.run import eval_noise_generator

ROOT = os.path.dirname(os.path.abspath(__file__))

# What evaluation adds to the training presets (flags.PRESETS, whose sampling settings and held-out prompt file it
# takes): seeds per prompt (default: the preset's last evaluation's, --final-eval-seeds or --eval-seeds), images
# per transformer call, metrics. A checkpoint's config.json takes precedence over the presets; flags take precedence
# over both.
EVAL_DEFAULTS = {
    "flux": dict(seeds=1, batch_size=8, metrics=["hps", "clip", "pickscore", "imagereward"]),
    "sd3": dict(seeds=1, batch_size=8, metrics=["hps", "clip", "pickscore", "imagereward"]),
    "zimage": dict(seeds=1, batch_size=8, metrics=["hps", "clip", "pickscore", "imagereward"]),
    "flux2": dict(seeds=1, batch_size=8, metrics=["hps", "clip", "pickscore", "imagereward"]),
    "qwenimage": dict(seeds=1, batch_size=4, metrics=["hps", "clip", "pickscore", "imagereward"]),
    "wan": dict(seeds=1, batch_size=2, metrics=["hps", "clip", "pickscore", "imagereward"]),
    "wan22": dict(seeds=1, batch_size=1, metrics=["hps", "clip", "pickscore", "imagereward"]),
    "tiny": dict(batch_size=64, metrics=["shapes", "shapes-strict"]),
}


def family_defaults(model: str) -> dict:
    """The model family's sampling settings, prompt file, seeds, batch size and metrics."""
    p = flags.preset(model)
    return {**{key: p[key] for key in SETTINGS[1:]}, "prompt_file": p["eval_prompt_file"],
            "seeds": p["final_eval_seeds"] or p["eval_seeds"],
            **EVAL_DEFAULTS[model]}


SETTINGS = ["model", "model_path", "num_steps", "shift", "sigma_grid", "guidance", "resolution", "height", "width",
            "max_sequence_length", "num_frames", "reward_frames"]
SHARED = SETTINGS + ["reward_batch_size", "mixed_precision", "offload_text_encoders", "tiny_cache"]
PAPER_SCALE = {"pickscore": 0.01}  # the paper reports PickScore / 100
EVAL_PATH_DEFAULTS = {"clip_model": "hf-hub:apple/DFN5B-CLIP-ViT-H-14-384"}  # the reference's evaluation CLIP


# train.py's flags that evaluation takes too, with train.py's help: the sampling settings default to the checkpoint
# run's (its config.json), else the family preset's
TrainFlags = dataclasses.make_dataclass("TrainFlags", flags.train_fields(
    SHARED, elsewhere=SETTINGS + ["tiny_cache"], note="Default: the checkpoint run's, else the family preset's.",
    notes={"mixed_precision": "Evaluation keeps the weights themselves in bf16 (no training, no master weights)."}))


@dataclass
class BaseArgs(TrainFlags):
    checkpoint: list[str] = field(default_factory=list)
    """Checkpoints to compare with the base: a checkpoint folder (iter_XXXXXX) or a run folder (its newest)."""
    base: bool = True
    """Include the base model as the first row (--no-base leaves it out)."""
    prompt_file: str = ""
    """Prompts, one a line (default: the family preset's --eval-prompt-file: prompts/hpdv2_test.txt, or
    prompts/tiny_eval.txt for tiny)."""
    num_prompts: int = 0
    """Evaluate only the first this many prompts; 0 = all."""
    seeds: Optional[int] = None
    """Noise seeds per prompt, n = prompts x seeds images per model (default 1; tiny: 96, as its training run's last
    evaluation)."""
    metrics: Annotated[list[str], tyro.conf.arg(
        help=f"Metrics, rewards of rewards.py: {' '.join(rewards.REWARDS)}.",
        help_behavior_hint="(default: hps clip pickscore imagereward; tiny: shapes shapes-strict)")] = \
        field(default_factory=list)
    batch_size: Optional[int] = None
    """Images generated per transformer call (default 8; tiny: 64)."""
    output_dir: str = ""
    """Where table.md, results.json, grid.png (and images/) are written; default: eval/ in the first
    checkpoint's run folder (runs/<name>/eval), or runs/eval_<model> for the base alone. One evaluation at a time
    holds it (a lock, as train.py's output folder)."""
    grid_prompts: int = 8
    """Prompts (seed 0) shown in grid.png, one row per model; 0 = no grid."""
    save_images: bool = False
    """Also save every image as images/<model>/<prompt>_<seed>.png."""
    weights: Optional[Literal["ema", "trained"]] = None
    """Which weights of each checkpoint to score: ema, the EMA a run trained with --ema-decay keeps (what its own
    evaluations scored), or trained, the optimizer's. Default: the EMA where a checkpoint holds one, else the
    trained weights."""


# one flag per reward path (the evaluation's CLIP defaults to -384)
Args = dataclasses.make_dataclass("Args", flags.reward_path_fields(EVAL_PATH_DEFAULTS), bases=(BaseArgs,))


# ---------------------------------------------------------------- inputs: checkpoints, settings, prompts


def is_checkpoint(folder: str) -> bool:
    """A LoRA checkpoint, a full fine-tune's transformer/, or a sharded full fine-tune's dcp/."""
    return (os.path.isfile(os.path.join(folder, "lora", "pytorch_lora_weights.safetensors"))
            or os.path.isfile(os.path.join(folder, "transformer", "config.json"))
            or os.path.isfile(os.path.join(folder, "dcp", ".metadata")))


def resolve_checkpoint(path: str) -> str:
    """A checkpoint folder as given, or a run folder's newest checkpoint that verifies, by train.py --resume's rule
    (iter_N folders only: not .tmp, .damaged, .replaced or a user's copy); either must verify."""
    from lab import checkpoint

    if is_checkpoint(path):
        problem = checkpoint.verify(path)
        if problem:
            fail(f"--checkpoint '{path}' is damaged ({problem}); pass another checkpoint or its run folder")
        return path
    found = checkpoint.latest_checkpoint(path, set_aside=False)
    if found is None:
        fail(f"--checkpoint '{path}' is neither a checkpoint (lora/, transformer/ or dcp/ inside) nor a run folder "
             f"with a complete checkpoint in checkpoints/; pass a runs/<name> or "
             f"runs/<name>/checkpoints/iter_XXXXXX folder")
    return found


def run_config(checkpoint: str) -> dict:
    """The training run's config.json (every flag), two levels above its checkpoint; a checkpoint moved out of its
    run folder has its own copy in trainer.pt / trainer.json; {} when neither holds one."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(checkpoint))), "config.json")
    if not os.path.isfile(path):
        from lab import checkpoint as checkpoints

        try:
            saved = checkpoints.read_trainer_state(checkpoint).get("config") or {}
        except Exception:  # an unreadable trainer state: the flags and the family decide, as below
            saved = {}
        if saved:
            print(f"note: no config.json for {checkpoint}; its settings come from the run's record in the checkpoint")
            return saved
        print(f"warning: no config.json for {checkpoint}; its settings come from the flags and the model family")
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        fail(f"{path} cannot be read ({type(err).__name__}); fix it or pass every setting as a flag")


def settings_for(args, config: dict, fallback: dict) -> dict:
    """Each sampling setting: the flag if given, else the run's config.json, else `fallback` (the first run's),
    else the model family's preset."""
    model = args.model or config.get("model") or fallback.get("model")
    if model is None:
        fail(f"no model: pass --model {'|'.join(flags.PRESETS)}, or a --checkpoint whose run folder holds "
             f"config.json")
    out = {"model": model}
    for key in SETTINGS[1:]:
        flag = getattr(args, key)
        out[key] = flag if flag is not None else config.get(key, fallback.get(key, family_defaults(model)[key]))
    if args.resolution is not None:  # a square, as train.py's: the run's own height and width unless given too
        out.update({side: getattr(args, side) or 0 for side in ("height", "width")})
    return out


def check_settings(s: dict, where: str):
    from lab.models import RESOLUTION_MULTIPLE

    family = flags.folder_family(s["model_path"]) if s["model"] != "tiny" and s["model_path"] else None
    if family and family != s["model"]:
        fail(f"{where}: model_path '{s['model_path']}' is a {family} folder, not a {s['model']} one; pass --model "
             f"{family}, or a {s['model']} folder as --model-path")
    multiple = RESOLUTION_MULTIPLE[s["model"]]
    if s["num_steps"] < 1 or s["max_sequence_length"] < 1 or not s["guidance"] >= 0 or not s["shift"] > 0:
        fail(f"{where}: num_steps and max_sequence_length must be >= 1, guidance >= 0 and shift > 0 (got {s})")
    for key in ("resolution", "height", "width"):
        if s[key] < (multiple if key == "resolution" else 0) or s[key] % multiple:
            fail(f"{where}: {key} {s[key]} is not a positive multiple of {multiple}")
    problem = flags.frames_problem(s["model"], s["num_frames"], f"{where}: num_frames")
    if problem:
        fail(problem)
    if s["reward_frames"] < 1:
        fail(f"{where}: reward_frames {s['reward_frames']} must be >= 1 (1 = every frame)")
    problem = flags.reward_frames_problem(s["model"], s["num_frames"], s["reward_frames"], f"{where}: reward_frames")
    if problem:
        fail(problem)


def check_args(args):
    for name in ("num_prompts", "grid_prompts"):
        if getattr(args, name) < 0:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)} is negative; use 0 (all / none) or more")
    for name in ("seeds", "batch_size", "reward_batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)}: use 1 or more")
    unknown = [m for m in args.metrics if m not in rewards.REWARDS]
    if unknown:
        fail(f"unknown metric '{unknown[0]}'; known: {', '.join(rewards.REWARDS)}")
    if len(set(args.metrics)) != len(args.metrics):
        fail(f"--metrics {' '.join(args.metrics)} names a metric twice")
    if not args.base and not args.checkpoint:
        fail("nothing to evaluate: --no-base needs at least one --checkpoint")


@dataclass
class Row:
    """One model of the table: a name, its checkpoint folder (None for the base), its sampling settings, and which
    of its weights it samples with ("trained", or "ema": its EMA's)."""
    name: str
    checkpoint: Optional[str]
    settings: dict
    config: dict
    weights: str = "trained"


def choose_weights(flag: Optional[str], folder: str, name: str) -> str:
    """Which weights of checkpoint `folder` to score: --weights when given, else what the run's own evaluations
    scored (its EMA when it holds one); said in a line whenever the checkpoint holds an EMA. --weights ema for a
    checkpoint without one, or an EMA that does not match the weights, is refused before any model loads."""
    from lab import checkpoint

    names = checkpoint.ema_names(folder)
    if flag == "ema" and names is None:
        fail(f"--weights ema: checkpoint '{folder}' holds no EMA weights (its run had no --ema-decay); pass --weights "
             f"trained, or a checkpoint of a run trained with --ema-decay")
    if names is None:
        return "trained"
    problem = ema_problem(folder, names)
    if problem:
        fail(f"checkpoint '{folder}': its EMA does not match its weights ({problem}); pass --weights trained to score "
             f"the trained weights")
    weights = flag or "ema"
    print(f"note: {name}: scoring its EMA weights, as the run's own evaluations did (--weights trained scores the "
          f"trained ones)" if weights == "ema" else
          f"note: {name}: scoring its trained weights (--weights trained), not the EMA its run's evaluations scored")
    return weights


def lora_key(name: str) -> str:
    """A LoRA weight's name without its prefix or adapter name, the same in the EMA ("x.lora_A.default.weight"),
    in the saved file ("transformer.x.lora_A.weight") and loaded ("x.lora_A.checkpoint.weight")."""
    name = re.sub(r"\.(lora_[AB])\.[^.]+\.", r".\1.", name)
    return name.removeprefix("transformer.")


def ema_problem(folder: str, names: list) -> Optional[str]:
    """Why the EMA of checkpoint `folder` (its tensor names) cannot stand in for its weights, or None: every EMA
    tensor must be one of the checkpoint's weights (read from the files' headers, no tensor loaded)."""
    from safetensors import safe_open

    from lab import checkpoint

    lora_file = os.path.join(folder, checkpoint.LORA_WEIGHTS)
    if os.path.isfile(lora_file):
        with safe_open(lora_file, "pt") as f:
            weights = {lora_key(k) for k in f.keys()}
        ema = {lora_key(k) for k in names}
    else:
        weights, ema = set(checkpoint.weight_names(folder)), set(names)
    missing = sorted(ema - weights)
    return f"{len(missing)} of its {len(ema)} tensors are no weight, e.g. '{missing[0]}'" if missing else None


def plan_rows(args) -> list[Row]:
    """Resolve every checkpoint and its settings; the base samples at the first checkpoint run's settings."""
    rows = []
    for path in args.checkpoint:
        folder = resolve_checkpoint(path)
        config = run_config(folder)
        if args.model and config.get("model") and config["model"] != args.model:
            fail(f"--checkpoint '{path}' is from a --model {config['model']} run, not --model {args.model}; drop "
                 f"--model (the run's family is used) or pass a checkpoint of the {args.model} family")
        run_name = os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(folder))))
        name = f"{run_name}/{os.path.basename(folder)}"
        weights = choose_weights(args.weights, folder, name)
        rows.append(Row(name + (" (EMA)" if weights == "ema" else ""), folder, settings_for(args, config, {}), config,
                        weights))
    first = rows[0].settings if rows else {}
    if args.base:
        rows.insert(0, Row("base", None, settings_for(args, {}, first), {}))
    bases = {(r.settings["model"], r.settings["model_path"]) for r in rows}
    if len(bases) > 1:
        fail(f"the checkpoints come from different base models {sorted(bases)}; evaluate them separately or pass "
             f"--model and --model-path")
    for row in rows:
        check_settings(row.settings, row.name)
    seen = {}
    for row in rows:  # two runs' checkpoints may share a name: number them
        seen[row.name] = seen.get(row.name, 0) + 1
        if seen[row.name] > 1:
            row.name += f" ({seen[row.name]})"
    return rows


# ---------------------------------------------------------------- models


def load_base(settings: dict, args, device, dtype, config: dict):
    """The base pipeline's adapter (lab/models.py); the tiny family's empty path means its cached pre-trained model
    (in --tiny-cache, else where the run kept it)."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    from lab import models

    diffusers_logging.disable_progress_bar()  # one bar: ours
    transformers_logging.disable_progress_bar()
    path = settings["model_path"]
    if settings["model"] == "tiny" and not path:
        from lab import tiny

        cache = args.tiny_cache or config.get("tiny_cache") or ".cache"
        path = tiny.ensure_pretrained_on_ranks(cache)
    try:
        return models.ADAPTERS[settings["model"]].load(
            path, device, dtype, transformer_dtype=dtype, guidance=settings["guidance"],
            max_sequence_length=settings["max_sequence_length"], offload_text_encoders=args.offload_text_encoders,
            num_frames=settings["num_frames"])
    except models.ModelLoadError as err:
        fail(str(err))


def lora_scale(lora_file: str, config: dict) -> float:
    """LoRA files saved without adapter metadata load with alpha = rank; a run trained with another alpha needs
    its scale alpha / rank applied at load."""
    from safetensors import safe_open

    with safe_open(lora_file, "pt") as f:
        if "lora_adapter_metadata" in (f.metadata() or {}):
            return 1.0
    rank = config.get("lora_rank") or 0
    return flags.lora_alpha(rank, config.get("lora_alpha") or 0) / rank if rank else 1.0


class CheckpointWeights:
    """Context manager giving the transformer to sample with: the base one carrying the checkpoint's LoRA
    (removed on exit), or a full fine-tuned transformer loaded beside the base (freed on exit)."""

    def __init__(self, adapter, row: Row, dtype):
        self.adapter, self.row, self.dtype, self.full = adapter, row, dtype, None

    def __enter__(self):
        module = self.trained()
        if self.row.weights == "ema":
            load_ema(module, self.row.checkpoint)
        return module

    def trained(self):
        """The transformer with the checkpoint's trained weights."""
        base, folder = self.adapter.transformer, self.row.checkpoint
        if folder is None:
            return base
        if os.path.isdir(os.path.join(folder, "transformer")):
            self.full = type(base).from_pretrained(os.path.join(folder, "transformer"), torch_dtype=self.dtype)
            return self.full.to(self.adapter.device).eval().requires_grad_(False)
        if os.path.isdir(os.path.join(folder, "dcp")):  # a sharded checkpoint: its weights read into a new model
            import torch.distributed.checkpoint as dcp

            self.full = type(base).from_config(base.config)
            dcp.load({"model": self.full.state_dict()}, checkpoint_id=os.path.join(folder, "dcp"), no_dist=True)
            return self.full.to(self.adapter.device, self.dtype).eval().requires_grad_(False)
        lora_file = os.path.join(folder, "lora", "pytorch_lora_weights.safetensors")
        base.load_lora_adapter(lora_file, prefix="transformer", adapter_name="checkpoint")
        scale = lora_scale(lora_file, self.row.config)
        if scale != 1.0:
            base.set_adapters(["checkpoint"], weights=[scale])
        return base

    def __exit__(self, *exc):
        if self.row.checkpoint is not None and self.full is None:
            self.adapter.transformer.unload_lora()  # back to the base weights
        self.full = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@torch.no_grad()
def load_ema(module, folder: str):
    """Put the EMA of checkpoint `folder` in place of the trained weights of `module` (loaded from it), as train.py's
    held-out evaluation swaps it in: every weight the EMA averages (a LoRA's A and B, or every weight of a full
    fine-tune); the rest stays."""
    from lab import checkpoint

    ema = checkpoint.read_ema(folder)
    lora = os.path.isfile(os.path.join(folder, checkpoint.LORA_WEIGHTS))
    if lora:  # the adapter is loaded as "checkpoint", trained as "default"
        ema = {lora_key(k): v for k, v in ema.items()}
    params = {lora_key(n) if lora else n: p for n, p in module.named_parameters()
              if not lora or ".lora_" in n and ".checkpoint." in n}
    for name, tensor in ema.items():
        params[name].copy_(tensor)


# ---------------------------------------------------------------- sampling and scoring


@torch.no_grad()
def evaluate_row(adapter, module, settings, items, prompts, metric_fns, batch_size, on_images, bar):
    """Sample every item (prompt index, seed index) with the ODE sampler and score it: {metric: [score]}."""
    from sampler import ode_sample, sigma_schedule

    sigmas = sigma_schedule(settings["num_steps"], settings["shift"], settings["sigma_grid"])  # (N + 1,)
    size = flags.image_size(settings["resolution"], settings["height"], settings["width"])  # (H, W)
    scores = {name: [] for name in metric_fns}
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        texts = [prompts[p] for p, _ in chunk]
        cond = adapter.encode(texts)
        noise = adapter.noise([eval_noise_generator(p, s) for p, s in chunk], size)  # (b, ...)
        velocity = lambda x, sigma, idx: adapter.velocity(module, cond, x, sigma, idx, size)
        x0 = ode_sample(velocity, noise, sigmas, max_batch=batch_size)
        images = adapter.decode(x0, size)  # (b, 3, H, W) in [0, 1]
        for name, fn in metric_fns.items():
            scores[name] += fn(images, texts).cpu().tolist()
        on_images(start, images)
        bar.update(1)
    return scores


def summarise(values, scale=1.0) -> dict:
    """Mean and standard error (unbiased std / sqrt(n)) of the finite values, times `scale`."""
    finite = torch.tensor([v for v in values if math.isfinite(v)], dtype=torch.float64) * scale
    n = finite.numel()
    mean = float(finite.mean()) if n else float("nan")
    stderr = float(finite.std() / math.sqrt(n)) if n > 1 else float("nan")
    return {"mean": mean, "stderr": stderr, "n": n, "dropped": len(values) - n, "scale": scale}


def markdown_table(results: list[dict], metrics: list[str]) -> str:
    """One row per model, one column per metric: mean ± standard error in the paper's units."""
    header = [f"{m} (/100)" if PAPER_SCALE.get(m) == 0.01 else m for m in metrics]
    lines = ["| model | " + " | ".join(header) + " |", "|---|" + "---|" * len(metrics)]
    fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # no mean without a finite score, no error of one image
    for row in results:
        cells = [f"{fmt(row['metrics'][m]['mean'])} ± {fmt(row['metrics'][m]['stderr'])}" for m in metrics]
        lines.append(f"| {row['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- distributed: train.py's set-up (lab/policy.py)


def gather(obj, world):
    """Every rank's `obj`, in rank order (a list of one without a process group)."""
    import torch.distributed as dist

    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------- outputs


def save_grid(rows_images: list, names: list[str], path: str):
    """One row of images per model, the model's name on the left."""
    from PIL import Image, ImageDraw
    from torchvision.utils import make_grid

    strips = [make_grid(images, nrow=len(images), padding=2, pad_value=1.0) for images in rows_images]
    label_width = 8 + 6 * max(len(n) for n in names)
    height = sum(s.shape[1] for s in strips)
    canvas = Image.new("RGB", (label_width + max(s.shape[2] for s in strips), height), "white")
    draw, top = ImageDraw.Draw(canvas), 0
    for strip, name in zip(strips, names):
        array = (strip.permute(1, 2, 0) * 255).round().byte().numpy()  # (H, W, 3)
        canvas.paste(Image.fromarray(array), (label_width, top))
        draw.text((4, top + strip.shape[1] // 2 - 6), name, fill="black")
        top += strip.shape[1]
    canvas.save(path)


def write_outputs(args, results, metrics, items, prompt_file, grid_images):
    os.makedirs(args.output_dir, exist_ok=True)
    table = markdown_table(results, metrics)
    with open(os.path.join(args.output_dir, "table.md"), "w") as f:
        f.write(table + "\n")
    payload = {"prompt_file": prompt_file, "seeds": args.seeds, "num_images": len(items), "metrics": metrics,
               "items": items, "rows": results}
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(payload, f, indent=1, allow_nan=False, default=str)
    if grid_images:
        save_grid(grid_images, [r["name"] for r in results], os.path.join(args.output_dir, "grid.png"))
    return table


def _json_safe(value):
    return value if not isinstance(value, float) or math.isfinite(value) else None


def compare(args):
    """Sample and score every model over this rank's share of the items; rank 0 writes the table and files."""
    check_args(args)
    rows = plan_rows(args)
    if not args.output_dir:  # each run's evaluations in its own folder, so two runs' tables never mix
        first = next((r.checkpoint for r in rows if r.checkpoint), None)
        args.output_dir = (os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(first))), "eval") if first
                           else os.path.join("runs", f"eval_{rows[0].settings['model']}"))
    preset = family_defaults(rows[0].settings["model"])
    # by default the family's metrics and the held-out rewards the run trained beside (its --eval-rewards)
    held_out = next((r.config.get("eval_rewards", []) for r in rows if r.config), [])
    metrics = args.metrics or [*preset["metrics"], *(m for m in held_out if m not in preset["metrics"])]
    prompt_file = args.prompt_file or os.path.join(ROOT, preset["prompt_file"])
    prompts = read_prompts(prompt_file, "--prompt-file")[: args.num_prompts or None]
    args.seeds, args.batch_size = args.seeds or preset["seeds"], args.batch_size or preset["batch_size"]
    items = [(p, s) for s in range(args.seeds) for p in range(len(prompts))]  # seed 0 of every prompt first
    _, rank, world, device = setup_distributed(timeout_minutes=60)
    dtype = torch.bfloat16 if device.type == "cuda" and args.mixed_precision == "bf16" else torch.float32
    paths = {name: getattr(args, name) for name, _, _ in rewards.path_fields()}
    try:  # the metrics first: a missing reward file must not cost a model load
        metric_fns = {m: rewards.load_reward(m, device, dtype, args.reward_batch_size, paths,
                                             frames_every=rows[0].settings["reward_frames"]) for m in metrics}
    except rewards.RewardError as err:
        fail(str(err))
    adapter = load_base(rows[0].settings, args, device, dtype, next((r.config for r in rows if r.config), {}))
    lock = None
    if rank == 0:  # a second evaluation into this folder is refused instead of mixing its files with this one's
        from lab import checkpoint

        try:  # after the checks and the model load: an evaluation refused for bad input writes nothing
            lock = checkpoint.lock_output(args.output_dir)
        except checkpoint.LockedError as err:
            fail(str(err).replace("output folder", "evaluation folder"))
    grid_items = sorted(range(min(args.grid_prompts, len(prompts))))
    results, grid_images = score_rows(args, rows, adapter, metric_fns, prompts, items, grid_items, rank, world)
    if rank == 0:
        table = write_outputs(args, results, metrics, items, prompt_file, grid_images if grid_items else [])
        print(f"{len(prompts)} prompts x {args.seeds} seeds from {prompt_file}; mean ± standard error:")
        print(table)
        print(f"wrote {os.path.join(args.output_dir, 'results.json')}, table.md" + (", grid.png" if grid_items else ""))
    if lock is not None:
        lock.release()
    return results


def score_rows(args, rows, adapter, metric_fns, prompts, items, grid_items, rank, world):
    """Each model in turn samples and scores this rank's items (every world-th); rank 0 gathers the scores and
    the grid's images. Returns (per-model results, per-model grid images) on rank 0, ([], []) elsewhere."""
    from tqdm import tqdm

    from lab.run import frame_strips

    mine = list(range(rank, len(items), world))  # this rank's item indices
    bar = tqdm(total=len(rows) * -(-len(mine) // args.batch_size), disable=rank != 0, desc="evaluate",
               dynamic_ncols=True)
    results, grid_images = [], []
    for row in rows:
        adapter.guidance = row.settings["guidance"]
        grid = {}

        def keep(start, images, row=row, grid=grid):
            for offset, image in enumerate(frame_strips(images)):  # a video: a strip of its frames
                index = mine[start + offset]
                if index in grid_items:
                    grid[index] = (image.cpu() * 255).round().byte()  # (3, H, W) uint8: small to gather
                if args.save_images:
                    save_image(args.output_dir, row.name, items[index], image)

        with CheckpointWeights(adapter, row, adapter.dtype) as module:
            scores = evaluate_row(adapter, module, row.settings, [items[i] for i in mine], prompts, metric_fns,
                                  args.batch_size, keep, bar)
        shares = gather({"indices": mine, "scores": scores, "grid": grid}, world)
        if rank == 0:
            results.append(combine(row, shares, list(metric_fns), len(items)))
            grid_images.append([grid_of(shares)[i].float() / 255 for i in grid_items])
    bar.close()
    return results, grid_images


def grid_of(shares):
    return {i: image for share in shares for i, image in share["grid"].items()}


def combine(row: Row, shares: list, metrics: list[str], total: int) -> dict:
    """Every rank's scores back in item order, then each metric's summary in the paper's units."""
    per_item = {m: [float("nan")] * total for m in metrics}
    for share in shares:
        for m in metrics:
            for index, value in zip(share["indices"], share["scores"][m]):
                per_item[m][index] = value
    summary = {m: summarise(per_item[m], PAPER_SCALE.get(m, 1.0)) for m in metrics}
    for m, s in summary.items():
        if s["dropped"]:
            print(f"warning: {row.name}: {s['dropped']} of {total} {m} scores were not finite and are left out")
    return {"name": row.name, "checkpoint": row.checkpoint, "weights": row.weights, "settings": row.settings,
            "metrics": {m: {k: _json_safe(v) for k, v in s.items()} for m, s in summary.items()},
            "scores": {m: [_json_safe(v) for v in per_item[m]] for m in metrics}}


def save_image(output_dir, row_name, item, image):
    from torchvision.utils import save_image as write_png

    folder = os.path.join(output_dir, "images", row_name.replace("/", "_").replace(" ", "_"))
    os.makedirs(folder, exist_ok=True)
    write_png(image, os.path.join(folder, f"{item[0]:05d}_{item[1]}.png"))


def main(argv=None):
    given = sys.argv[1:] if argv is None else argv
    flags.refuse_repeats(given, Args)
    flags.refuse_bad_choices(given, Args)
    args = tyro.cli(Args, args=argv, description=__doc__.split("\n\n")[0])
    results = compare(args)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return results


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here on, KeyboardInterrupt as usual
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback, as train.py
        print("\ninterrupted; nothing more was written", file=sys.stderr)
        raise SystemExit(130)
