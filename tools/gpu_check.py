"""A GPU check anyone can run: does training on this accelerator compute the right thing, and how fast is it?

Every part goes through the trainer's own code: `lab.models.FluxAdapter.velocity` (the one place a transformer is
called, with its attention kernels and compilation), `lab.models.add_lora` (the trainer's LoRA targets),
`sampler.rollout_g2rpo`, `g2rpo.G2RPO.update` and `lab.kernels.check_gradient` with `G2RPO.check_loss`.
  1. tiny:      `train.py --model tiny --num-iterations 20` on the accelerator, under torchrun on one rank (the
                many-GPU path: a process group with NCCL and gloo, FSDP2): no skipped optimizer step, and the
                train and held-out rewards rise.
  2. gradient:  a FLUX.1-dev-sized transformer (published config, random weights), bf16, LoRA r64, gradient
                checkpointing, 720^2: the update's gradient is finite and matches the math attention kernel's
                (`lab.kernels.check_gradient`), and one `G2RPO.update` step is taken, not skipped.
  3. iteration: one full G2RPO iteration at 720^2, G 12, M 0..7, Lambda {1, 2}: seconds for the rollout, decode +
                reward and the update; peak memory; the rollout's TFLOP/s and its share of the chip's dense bf16
                peak; and how far the first update's ratios are from 1 (lr 0, so every step sees the rollout's
                policy).
  4. levers:    per speed lever (the rollout's attention kernel, regional compilation, with CUDA graphs too,
                FlashAttention-3 through diffusers' attention backends, max batch), at 512^2 and 720^2: timed
                rollout forwards and update steps, their TFLOP/s and share of peak, and the seconds per phase of one
                iteration projected from them.
  5. fp8:       the FP8 copy of --rollout-precision fp8 (`kernels.Float8Copy`, compiled) against the compiled bf16
                transformer at 512^2 and 720^2: s/image and TF/s against the FP8 dense peak, the LoRA merged into the
                quantized base (no adapter branch) as the other LoRA design, the seconds to quantize every block
                (a full fine-tune pays them after each update), the images' PSNR against bf16 from the same noise;
                then one full iteration at 720^2, G 12, M 0..7, Lambda {1, 2, 3} with the copy, and the tiny
                model's learning on the GPU with --rollout-precision fp8 beside part 1's bf16 run.
FLOPs come from torch.utils.flop_counter on one forward (rollout) and one update step (forward, checkpoint
recompute and backward, as executed). On CUDA each case runs in a subprocess of its own (a CUDA error poisons the
process that meets it); results are appended to `results.jsonl` (a failed case's stderr to `failures.log`) and printed
as markdown tables as they come. A case that would start past `--budget-s` is skipped and says so.

What stands in for what at FLUX size: random prompt embeddings of T5-XXL's and CLIP's shapes (no text encoders);
a random-weight VAE of FLUX.1's config for the decode; the tiny world's pixel rule as the reward (an HPS ViT-H
forward is not timed).

Run:
    python -m tools.gpu_check                  # one GPU, FLUX-sized: parts 1-4 took 463 s on an H200 (--budget-s 520;
                                               # with part 5 before the levers, the budget now skips some levers)
    python -m tools.gpu_check --parts tiny gradient fp8   # the FP8 part alone after the checks (not yet run on a GPU)
    python -m tools.gpu_check --config small   # CPU, about a minute: the same code on a tiny transformer
Part 5 needs torchao on the GPU (requirements-fp8.txt); on the CPU it runs with `kernels.round_to_fp8_rows`, the
weight-rounding stand-in, compiled with dynamo's "eager" backend, so the small config checks its plumbing, not its
speed.
"""
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
import tyro

from lab import flags
from methods.base import UpdateContext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
BF16_PEAK = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "A100": 312e12, "L40S": 362e12}  # dense, FLOP/s
FP8_PEAK = {"H100": 1979e12, "H200": 1979e12, "B200": 4500e12, "L40S": 733e12}  # dense, FLOP/s


def published_config(name: str) -> dict:
    """FLUX.1-dev's published config of one model (transformer, vae), as tools/configs keeps it for tools/plan.py."""
    with open(os.path.join(ROOT, "tools", "configs", "flux1-dev", name + ".json")) as f:
        return json.load(f)


FLUX_DEV, FLUX_VAE = published_config("transformer"), published_config("vae")
SMALL = dict(FLUX_DEV, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
             num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=[4, 6, 6])
SMALL_VAE = dict(FLUX_VAE, latent_channels=4, block_out_channels=[16, 16], layers_per_block=1, norm_num_groups=8,
                 down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                 mid_block_add_attention=False)


@dataclass
class Scale:
    """Everything that differs between the FLUX-sized check and the small CPU one."""

    transformer: dict
    vae: dict
    text_tokens: int  # T5 tokens of the random prompt embeddings
    resolution: int  # of the gradient check and the full iteration
    lever_resolutions: tuple
    num_steps: int  # N
    group_size: int  # G
    sde_steps: tuple  # M
    granularities: tuple  # Lambda
    max_batch: int
    batches: tuple  # the max-batch lever
    lora_rank: int
    compile: str  # the compile lever's backend (on a CPU, dynamo's graph capture; a test checks AOT tracing's numbers)
    fp8_compile: str  # part 5's backend for both models (on a CPU, dynamo's graph capture without AOT tracing)
    fp8_granularities: tuple  # Lambda of part 5's full iteration
    tiny_args: list  # train.py's arguments for part 1 (a pipeline folder is appended for the small config)
    timeouts: dict = field(default_factory=dict)  # seconds per case kind


SCALES = {
    "flux": Scale(transformer=FLUX_DEV, vae=FLUX_VAE, text_tokens=512, resolution=720, lever_resolutions=(512, 720),
                  num_steps=16, group_size=12, sde_steps=tuple(range(8)), granularities=(1, 2), max_batch=24,
                  batches=(12, 24, 48), lora_rank=64, compile="inductor", fp8_compile="inductor",
                  fp8_granularities=(1, 2, 3),
                  tiny_args=["--model", "tiny", "--num-iterations", "20"],
                  timeouts=dict(tiny=300, gradient=150, iteration=330, lever=150, fp8=330, fp8_iteration=330)),
    "small": Scale(transformer=SMALL, vae=SMALL_VAE, text_tokens=16, resolution=32, lever_resolutions=(32,),
                   num_steps=4, group_size=3, sde_steps=(0, 1), granularities=(1, 2), max_batch=8, batches=(4, 8),
                   lora_rank=4, compile="eager", fp8_compile="eager", fp8_granularities=(1, 2, 3),
                   tiny_args=["--model", "flux", "--num-iterations", "1", "--resolution", "32", "--num-steps", "4",
                    "--group-size", "3", "--sde-steps", "0", "1", "--granularities", "1", "2",
                    "--prompts-per-iteration", "2", "--rewards", "shapes=1.0", "--max-sequence-length", "16",
                    "--prompt-file", "prompts/tiny_train.txt", "--eval-prompt-file", "prompts/tiny_eval.txt",
                    "--eval-seeds", "1", "--eval-every", "1", "--lr", "1e-3", "--mixed-precision", "no",
                    "--no-gradient-checkpointing", "--eval-rewards"],  # (none: the flux preset's need hub weights)
                   timeouts=dict(tiny=120, gradient=60, iteration=60, lever=60, fp8=60, fp8_iteration=60)),
}


@dataclass
class Args:
    config: Literal["flux", "small"] = "flux"
    """flux: the FLUX.1-dev-sized checks on one GPU; small: the same code with a tiny transformer (runs on a CPU)."""
    parts: tuple[Literal["tiny", "gradient", "iteration", "levers", "fp8"], ...] = (
        "tiny", "gradient", "iteration", "levers", "fp8")
    """Which parts to run (see the module docstring)."""
    output_dir: str = "runs/gpu_check"
    """Where results.jsonl (one JSON object per case, appended) and the tiny run go."""
    budget_s: float = 520.0
    """Wall-clock budget of the whole check: a case that would start past it is skipped, one running past it stopped."""
    isolate: bool | None = None
    """Run each case in a subprocess of its own; default: on CUDA, where an error poisons the process that meets
    it, and not on a CPU, where importing torch and diffusers again for every case would take most of the time."""
    case: str = ""
    """Internal: one case as JSON, run in this process and appended to results.jsonl (what each subprocess runs)."""


# ---------------------------------------------------------------------------------------------------------------
# building blocks of the cases
# ---------------------------------------------------------------------------------------------------------------
def device_and_dtype():
    return ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)


@contextlib.contextmanager
def created_as(device, dtype):
    """Modules built inside are created directly on `device` in `dtype` (no fp32 copy of 12 B parameters)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def build(scale: Scale, options: dict):
    """A FluxPipeline with a random transformer and VAE (no text encoders) behind the project's FluxAdapter, LoRA on
    the trainer's targets, gradient checkpointing, random prompt embeddings. Returns (adapter, cond, params)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    from lab import models
    from lab import tiny

    device, dtype = device_and_dtype()
    torch.manual_seed(0)
    with created_as(device, dtype):
        transformer, vae = FluxTransformer2DModel(**scale.transformer), AutoencoderKL(**scale.vae)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=tiny.build_tokenizers()[1], transformer=transformer)
    adapter = models.FluxAdapter(pipe, device, dtype, guidance=3.5, **options)
    models.add_lora(transformer, rank=scale.lora_rank, alpha=scale.lora_rank, feed_forward=False)
    transformer.enable_gradient_checkpointing()
    config = scale.transformer
    T, D, D_pooled = scale.text_tokens, config["joint_attention_dim"], config["pooled_projection_dim"]
    cond = {"prompt_embeds": torch.randn(1, T, D, device=device, dtype=dtype),  # (1, T, D)
            "pooled": torch.randn(1, D_pooled, device=device, dtype=dtype),  # (1, D')
            "text_ids": torch.zeros(T, 3, device=device)}  # (T, 3)
    return adapter, cond, [p for p in transformer.parameters() if p.requires_grad]


def velocity_at(adapter, cond, resolution, module=None):
    """The velocity function the rollout and the update call, as the trainer builds it: v(x, sigma | prompt), of the
    adapter's transformer or of `module` (the FP8 copy's)."""
    module = adapter.transformer if module is None else module
    return lambda x, sigma, index: adapter.velocity(module, cond, x, sigma, index, resolution)


def timed(fn):
    """(fn(), seconds), the accelerator's queue drained before and after."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - start


def count_flops(fn) -> int:
    """FLOPs of fn() as executed, eager (a compiled block would hide its matmuls from the counter)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.compiler.set_stance("force_eager"), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def one_step_rollout(velocity_fn, noise, sigmas, group_size, eta):
    """Step 3 of the rollout for k = 0 alone: G SDE samples from x_T and their log-probs, in a `Rollout` (what the
    update reads), for the checks that need an update but not a whole rollout."""
    from sampler import Rollout, sde_step

    G, index = group_size, torch.zeros(1, dtype=torch.long, device=noise.device)
    with torch.no_grad():
        velocity = velocity_fn(noise, sigmas[:1].to(noise.device), index)  # (1, ...)
        member_noise = torch.randn((G, *noise.shape[1:]), generator=torch.Generator().manual_seed(1)).to(noise.device)
        next_latents, log_probs = sde_step(noise.expand(G, *noise.shape[1:]), velocity.expand(G, *noise.shape[1:]),
                                           sigmas, 0, eta, noise=member_noise)  # (G, ...), (G,)
    return Rollout(start_latents=noise[:, None, None], next_latents=next_latents[None, None],
                   old_log_probs=log_probs[None, None], final_latents=None, anchor_final=None, sde_steps=[0],
                   granularities=[], nfe=1, calls=1)  # (1, 1, 1, ...), (1, 1, G, ...), (1, 1, G)


def peak_gib():
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def share_of_peak(flops_per_s, peaks=BF16_PEAK):
    """The fraction of the chip's dense bf16 (or FP8) peak, or None for a chip not in the table (and the CPU)."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    peak = next((v for k, v in peaks.items() if k in name), None)
    return flops_per_s / peak if peak else None


# ---------------------------------------------------------------------------------------------------------------
# the cases (on CUDA each runs in a subprocess of its own)
# ---------------------------------------------------------------------------------------------------------------
ETA, CLIP_RANGE, SHIFT = (flags.preset("flux")[name] for name in ("eta", "clip_range", "shift"))  # as the flux preset


def g2rpo_method(scale: Scale, granularities=None):
    """G2RPO at the scale's sizes and the flux preset's eta and clip range, whose update the cases time."""
    from g2rpo import G2RPO

    return G2RPO(sde_steps=list(scale.sde_steps), group_size=scale.group_size, eta=ETA, clip_range=CLIP_RANGE,
                 adv_clip_max=5.0, max_grad_norm=1.0, max_batch=scale.max_batch, inner_epochs=1, kl_beta=0.0,
                 granularities=list(granularities or scale.granularities))


def decode_and_reward(adapter, final_latents, resolution, chunk=8):
    """Every final latent (B, J, K, G, ...) decoded by the VAE, scored by the tiny world's pixel rule: (B, J, K, G)."""
    from lab import tiny

    flat = final_latents.flatten(0, 3)  # (B*J*K*G, L, 4C)
    scores = [tiny.shape_reward(adapter.decode(part, resolution), ["a red circle on the left"] * len(part))
              for part in flat.split(chunk)]
    return torch.cat(scores).view(final_latents.shape[:4])


def iteration_nfe(scale: Scale) -> int:
    """Image-forwards of one rollout at the scale's settings, counted with a zero velocity (no model needed)."""
    from sampler import rollout_g2rpo, sigma_schedule

    rollout = rollout_g2rpo(lambda x, sigma, index: torch.zeros_like(x), torch.zeros(1, 4),
                            sigma_schedule(scale.num_steps, SHIFT), [torch.Generator()], group_size=scale.group_size,
                            sde_steps=list(scale.sde_steps), granularities=list(scale.granularities), eta=ETA,
                            max_batch=scale.max_batch)
    return rollout.nfe


def case_gradient(scale: Scale, case: dict) -> dict:
    """Part 2: the update's gradient under the run's kernels against the math kernel's; then one real update step."""
    from sampler import sigma_schedule

    adapter, cond, params = build(scale, {})
    velocity_fn = velocity_at(adapter, cond, case["resolution"])
    sigmas = sigma_schedule(scale.num_steps, SHIFT)
    rollout = one_step_rollout(velocity_fn, adapter.noise([torch.Generator().manual_seed(0)], case["resolution"]),
                               sigmas, scale.group_size, ETA)
    advantages = torch.randn(1, 1, scale.group_size, generator=torch.Generator().manual_seed(2))  # (B, K, G)
    advantages = advantages.to(adapter.device)
    loss_fn = g2rpo_method(scale).check_loss(velocity_fn, rollout, sigmas)
    check, seconds = timed(lambda: adapter.kernels.check_gradient(loss_fn, params))
    stats = g2rpo_method(scale).update(rollout, advantages, UpdateContext(velocity_fn, params,
                                                                          torch.optim.AdamW(params, lr=1e-5), sigmas))
    return dict(ok=check.ok and stats["skipped_steps"] == 0, message=check.message, cosine=check.cosine,
                relative_error=check.relative_error, norm=check.norm, exact_norm=check.exact_norm,
                check_s=seconds, update_grad_norm=stats["grad_norm"], skipped_steps=stats["skipped_steps"],
                peak_gib=peak_gib())


def probe(adapter, velocity_fn, params, scale: Scale, resolution: int, batches) -> dict:
    """Timed rollout forwards at each max batch and timed update steps (after one untimed call each, which compiles
    when compiling), their TFLOP/s and share of peak, and the seconds per phase of one iteration projected from them."""
    from sampler import sigma_schedule

    sigmas, device = sigma_schedule(scale.num_steps, SHIFT), adapter.device
    noise = adapter.noise([torch.Generator().manual_seed(0)], resolution)  # (1, L, 4C)
    rollout = one_step_rollout(velocity_fn, noise, sigmas, scale.group_size, ETA)
    advantages = torch.randn(1, 1, scale.group_size, generator=torch.Generator().manual_seed(2)).to(device)
    optimizer = torch.optim.AdamW(params, lr=0.0)  # lr 0: the ratio compares the update's forward with the rollout's
    update = lambda: g2rpo_method(scale).update(rollout, advantages, UpdateContext(velocity_fn, params, optimizer,
                                                                                   sigmas))
    loss_fn = g2rpo_method(scale).check_loss(velocity_fn, rollout, sigmas)
    update_flops = count_flops(lambda: loss_fn().backward())
    optimizer.zero_grad(set_to_none=True)
    _, update_warmup = timed(update)
    stats, update_s = timed(update)
    index = torch.zeros(1, dtype=torch.long, device=device)
    forward_flops = count_flops(lambda: torch.no_grad()(velocity_fn)(noise, sigmas[:1].to(device), index))
    _, decode_s = timed(lambda: decode_and_reward(adapter, rollout.next_latents[:, :, None], resolution))  # G images
    nfe, K, J = iteration_nfe(scale), len(scale.sde_steps), len(scale.granularities)
    rows = []
    for batch in batches:
        x = noise.expand(batch, *noise.shape[1:]).contiguous()  # (batch, L, 4C)
        sigma, index = torch.full((batch,), 0.5, device=device), torch.zeros(batch, dtype=torch.long, device=device)
        _, warmup = timed(lambda: torch.no_grad()(velocity_fn)(x, sigma, index))
        _, seconds = timed(lambda: torch.no_grad()(velocity_fn)(x, sigma, index))
        rate = forward_flops * batch / seconds
        rows.append(dict(max_batch=batch, rollout_s_per_image=seconds / batch, rollout_tflops=rate / 1e12,
                         rollout_share=share_of_peak(rate), warmup_s=warmup,
                         projected_s=dict(rollout=nfe * seconds / batch, decode_and_reward=J * K * decode_s,
                                          update=K * update_s)))
    return dict(resolution=resolution, forward_tflop=forward_flops / 1e12, update_s_per_step=update_s,
                update_tflops=update_flops / update_s / 1e12, update_share=share_of_peak(update_flops / update_s),
                update_warmup_s=update_warmup, ratio_deviation=stats["ratio_max"] - 1,
                skipped_steps=stats["skipped_steps"], forwards=rows, peak_gib=peak_gib())


def case_iteration(scale: Scale, case: dict) -> dict:
    """Part 3: one full G2RPO iteration, phase by phase; then the probe of the max-batch lever at this resolution."""
    from advantage import granular_advantages
    from sampler import rollout_g2rpo, sigma_schedule

    resolution, (adapter, cond, params) = case["resolution"], build(scale, {})
    velocity_fn = velocity_at(adapter, cond, resolution)
    sigmas, device = sigma_schedule(scale.num_steps, SHIFT), adapter.device
    noise = adapter.noise([torch.Generator().manual_seed(0)], resolution)  # (B, L, 4C), B = 1
    index = torch.zeros(1, dtype=torch.long, device=device)
    forward_flops = count_flops(lambda: torch.no_grad()(velocity_fn)(noise, sigmas[:1].to(device), index))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    rollout, rollout_s = timed(lambda: rollout_g2rpo(
        velocity_fn, noise, sigmas, [torch.Generator().manual_seed(1)], group_size=scale.group_size,
        sde_steps=list(scale.sde_steps), granularities=list(scale.granularities), eta=ETA, max_batch=scale.max_batch))
    rewards, reward_s = timed(lambda: decode_and_reward(adapter, rollout.final_latents, resolution))  # (B, J, K, G)
    advantages = granular_advantages(rewards[..., None], adv_clip_max=5.0)  # (B, K, G)
    optimizer = torch.optim.AdamW(params, lr=0.0)  # lr 0: every step's ratio compares its forward with the rollout's
    stats, update_s = timed(lambda: g2rpo_method(scale).update(rollout, advantages,
                                                               UpdateContext(velocity_fn, params, optimizer, sigmas)))
    rate = forward_flops * rollout.nfe / rollout_s
    result = dict(resolution=resolution, seconds=dict(rollout=rollout_s, decode_and_reward=reward_s, update=update_s),
                  nfe=rollout.nfe, calls=rollout.calls, peak_gib=peak_gib(), forward_tflop=forward_flops / 1e12,
                  rollout_tflops=rate / 1e12, rollout_share=share_of_peak(rate),
                  ratio_deviation=stats["ratio_max"] - 1, skipped_steps=stats["skipped_steps"])
    result["probe"] = probe(adapter, velocity_fn, params, scale, resolution, scale.batches)
    return result


def case_lever(scale: Scale, case: dict) -> dict:
    """Part 4: one lever (adapter options) probed at each resolution, one model for all of them."""
    from lab.kernels import compile_blocks

    options = dict(rollout_attention_backend=case.get("rollout_attention_backend", "auto"),
                   compile=scale.compile if case.get("compile") and not case.get("compile_mode") else False)
    adapter, cond, params = build(scale, options)
    if case.get("attention"):  # a diffusers attention backend (FlashAttention-3: "_flash_3"), in every phase
        adapter.transformer.set_attention_backend(case["attention"])
    if case.get("compile_mode"):
        compile_blocks(adapter.transformer, scale.compile, mode=case["compile_mode"])
    batches = case.get("batches", (scale.max_batch,))
    return dict(probes=[probe(adapter, velocity_at(adapter, cond, resolution), params, scale, resolution, batches)
                        for resolution in case["resolutions"]])


def fp8_copy(adapter, scale: Scale):
    """The trainer's FP8 copy of the transformer (`kernels.Float8Copy`), compiled with the scale's backend:
    torchao's quantization on CUDA, the weight-rounding stand-in on a CPU."""
    from lab.kernels import Float8Copy, round_to_fp8_rows

    return Float8Copy(adapter.transformer, compile=scale.fp8_compile,
                      quantize=None if torch.cuda.is_available() else round_to_fp8_rows)


def psnr(images, reference) -> list:
    """Per image, 10 log10(1 / MSE) of images in [0, 1] against the reference's (inf where equal)."""
    mse = (images.float() - reference.float()).square().flatten(1).mean(1)  # (n,)
    return [10 * math.log10(1 / m) if m > 0 else float("inf") for m in mse.tolist()]


def case_fp8(scale: Scale, case: dict) -> dict:
    """Part 5: the FP8 copy against the compiled bf16 transformer (LoRA on), one model for every resolution."""
    from sampler import ode_sample, sigma_schedule

    adapter, cond, params = build(scale, dict(compile=scale.fp8_compile))
    start = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    fp8, build_s = timed(lambda: fp8_copy(adapter, scale))
    copy_gib = (torch.cuda.memory_allocated() - start) / 2**30 if torch.cuda.is_available() else float("nan")
    _, refresh_s = timed(fp8.refresh)  # what a full fine-tune (or a LoRA merged into its base) pays each update
    sigmas, device, batch = sigma_schedule(scale.num_steps, SHIFT), adapter.device, scale.max_batch
    rows = []
    for resolution in case["resolutions"]:
        bf16 = velocity_at(adapter, cond, resolution)
        quantized = velocity_at(adapter, cond, resolution, fp8.module)
        noise = adapter.noise([torch.Generator().manual_seed(s) for s in range(4)], resolution)  # (4, L, 4C)
        index = torch.zeros(1, dtype=torch.long, device=device)
        flops = count_flops(lambda: torch.no_grad()(bf16)(noise[:1], sigmas[:1].to(device), index))
        x = noise[:1].expand(batch, *noise.shape[1:]).contiguous()  # (batch, L, 4C)
        sigma, index = torch.full((batch,), 0.5, device=device), torch.zeros(batch, dtype=torch.long, device=device)
        policy = f"policy ({str(adapter.dtype).removeprefix('torch.')}, compiled)"
        variants = {policy: bf16, "fp8, LoRA in the policy's dtype (the trainer's)": quantized}
        seconds = {}
        for name, fn in variants.items():
            _, warmup = timed(lambda: torch.no_grad()(fn)(x, sigma, index))
            _, seconds[name] = timed(lambda: torch.no_grad()(fn)(x, sigma, index))
            rows.append(dict(variant=name, resolution=resolution, max_batch=batch, s_per_image=seconds[name] / batch,
                             tflops=flops * batch / seconds[name] / 1e12, warmup_s=warmup))
        fp8.module.disable_adapters()  # the other LoRA design: merged into the base, quantized after every step
        try:
            _, warmup = timed(lambda: torch.no_grad()(quantized)(x, sigma, index))
            _, merged_s = timed(lambda: torch.no_grad()(quantized)(x, sigma, index))
        finally:
            fp8.module.enable_adapters()
        rows.append(dict(variant="fp8, LoRA merged (no branch)", resolution=resolution, max_batch=batch,
                         s_per_image=merged_s / batch, tflops=flops * batch / merged_s / 1e12, warmup_s=warmup))
        for row in rows[-3:]:
            rate = row["tflops"] * 1e12
            row.update(bf16_share=share_of_peak(rate), fp8_share=share_of_peak(rate, FP8_PEAK),
                       speedup=seconds[policy] / batch / row["s_per_image"])
        # the images from the same noise, every step on each model (the ODE sample an evaluation draws), one prompt
        one_prompt = lambda fn: (lambda x, sigma, index: fn(x, sigma, torch.zeros_like(index)))
        reference, images = (adapter.decode(ode_sample(one_prompt(fn), noise, sigmas, max_batch=batch), resolution)
                             for fn in (bf16, quantized))
        rows[-2]["psnr_db"] = psnr(images, reference)  # the trainer's variant
    return dict(rows=rows, quantized_layers=len(fp8.names), build_s=build_s, refresh_s=refresh_s, copy_gib=copy_gib,
                peak_gib=peak_gib())


def case_fp8_iteration(scale: Scale, case: dict) -> dict:
    """Part 5: one full G2RPO iteration with the FP8 copy making the image-only forwards (Lambda {1, 2, 3} at the
    FLUX scale), lr 0: the first step's ratios compare the update with the rollout's trained steps."""
    from advantage import granular_advantages
    from sampler import rollout_g2rpo, sigma_schedule

    resolution, (adapter, cond, params) = case["resolution"], build(scale, dict(compile=scale.fp8_compile))
    fp8 = fp8_copy(adapter, scale)
    velocity_fn = velocity_at(adapter, cond, resolution)
    image_only_fn = velocity_at(adapter, cond, resolution, fp8.module)
    sigmas = sigma_schedule(scale.num_steps, SHIFT)
    noise = adapter.noise([torch.Generator().manual_seed(0)], resolution)  # (B, L, 4C), B = 1
    options = dict(group_size=scale.group_size, sde_steps=list(scale.sde_steps),
                   granularities=list(scale.fp8_granularities), eta=ETA, max_batch=scale.max_batch)
    # warm-up: both models compiled at the rollout's two main batch sizes (the anchor's 1, the copy's max batch); a
    # whole untimed rollout first would take as long as the timed one. The rollout's odd-sized calls still compile
    # inside it: `projected_rollout_s` is its forwards at the warm speeds
    device, full = adapter.device, scale.max_batch
    at = lambda n: (noise.expand(n, *noise.shape[1:]).contiguous(), torch.full((n,), 0.5, device=device),
                    torch.zeros(n, dtype=torch.long, device=device))
    with torch.no_grad():
        _, warmup_s = timed(lambda: (velocity_fn(*at(1)), image_only_fn(*at(full))))
        _, policy_s = timed(lambda: velocity_fn(*at(1)))
        _, copy_s = timed(lambda: image_only_fn(*at(full)))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    rollout, rollout_s = timed(lambda: rollout_g2rpo(velocity_fn, noise, sigmas, [torch.Generator().manual_seed(1)],
                                                     image_only_fn=image_only_fn, **options))
    projected = (rollout.nfe - rollout.image_only_nfe) * policy_s + rollout.image_only_nfe * copy_s / full
    rewards, reward_s = timed(lambda: decode_and_reward(adapter, rollout.final_latents, resolution))  # (B, J, K, G)
    advantages = granular_advantages(rewards[..., None], adv_clip_max=5.0)  # (B, K, G)
    optimizer = torch.optim.AdamW(params, lr=0.0)
    stats, update_s = timed(lambda: g2rpo_method(scale).update(rollout, advantages,
                                                               UpdateContext(velocity_fn, params, optimizer, sigmas)))
    return dict(resolution=resolution, granularities=list(scale.fp8_granularities), nfe=rollout.nfe,
                image_only_nfe=rollout.image_only_nfe, calls=rollout.calls, warmup_s=warmup_s,
                projected_rollout_s=projected,
                seconds=dict(rollout=rollout_s, decode_and_reward=reward_s, update=update_s),
                first_ratio_error=stats["first_ratio_error"], skipped_steps=stats["skipped_steps"],
                peak_gib=peak_gib())


CASES = {"gradient": case_gradient, "iteration": case_iteration, "lever": case_lever, "fp8": case_fp8,
         "fp8_iteration": case_fp8_iteration}


# ---------------------------------------------------------------------------------------------------------------
# the driver: plans the cases, runs each in a subprocess, records and prints the results as they come
# ---------------------------------------------------------------------------------------------------------------
def plan(scale: Scale, parts) -> list:
    """The cases in order: correctness first, then the FP8 part (never yet run on a GPU, so first of the timings:
    a run that meets its budget skips the levers measured before), then the levers (the riskiest last)."""
    cases, everywhere = [], list(scale.lever_resolutions)
    if "gradient" in parts:
        cases.append(dict(kind="gradient", resolution=scale.resolution))
    if "iteration" in parts:  # its probe is the baseline of the levers at its resolution
        cases.append(dict(kind="iteration", resolution=scale.resolution))
    if "fp8" in parts:
        cases.append(dict(kind="fp8", resolutions=everywhere))
        cases.append(dict(kind="fp8_iteration", resolution=scale.resolution))
    if "levers" in parts:
        others = [r for r in everywhere if r != scale.resolution or "iteration" not in parts]
        if others:
            cases.append(dict(kind="lever", lever="baseline", resolutions=others, batches=list(scale.batches)))
        cases.append(dict(kind="lever", lever="rollout attention cudnn", rollout_attention_backend="cudnn",
                          resolutions=everywhere))
        cases.append(dict(kind="lever", lever=f"compile ({scale.compile})", compile=True, resolutions=everywhere))
    if "levers" in parts and scale.compile == "inductor":  # GPU only: CUDA graphs and FlashAttention-3
        cases.append(dict(kind="lever", lever="compile max-autotune (CUDA graphs)", compile=True,
                          compile_mode="max-autotune", resolutions=everywhere))
        cases.append(dict(kind="lever", lever="FlashAttention-3 (diffusers _flash_3)", attention="_flash_3",
                          resolutions=everywhere))
    return cases


def run_case(args: Args, case: dict, deadline: float, isolate: bool) -> dict:
    """`case` in a subprocess of this script (or in this process); its result, or why there is none."""
    timeout = min(SCALES[args.config].timeouts[case["kind"]], deadline - time.time())
    if timeout < 15:
        return {**case, "status": "skipped: over the time budget (--budget-s)"}
    if not isolate:
        start = time.time()
        return {**case, "status": "ok", **CASES[case["kind"]](SCALES[args.config], case), "wall_s": time.time() - start}
    command = [sys.executable, "-m", "tools.gpu_check", "--config", args.config, "--case", json.dumps(case)]
    start = time.time()
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**case, "status": f"stopped after {timeout:.0f} s (its time limit or the budget)"}
    lines = proc.stdout.splitlines()
    result = next((json.loads(line[7:]) for line in reversed(lines) if line.startswith("RESULT ")), None)
    if proc.returncode or result is None:
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        with open(os.path.join(args.output_dir, "failures.log"), "a") as f:  # the whole story, for the one who fixes it
            f.write(f"# {json.dumps(case)}: exit {proc.returncode}\n{proc.stderr[-20000:]}\n")
        return {**case, "status": f"failed (exit {proc.returncode}): {why[:300]}"}
    return {**result, "wall_s": time.time() - start, "notes": [line for line in lines if line.startswith("note:")]}


TINY_RUNS = {"tiny": [],  # part 1, under torchrun
             # part 5: the FP8 rollouts against the same run without them, both in bf16 (FP8 quantizes from bf16;
             # the tiny preset computes in fp32)
             "tiny_bf16": ["--mixed-precision", "bf16"],
             "tiny_fp8": ["--mixed-precision", "bf16", "--rollout-precision", "fp8"]}


def start_tiny(args: Args, scale: Scale, name="tiny"):
    """Part 1 (and part 5's two runs), in the background: train.py on the accelerator. Its timing is not reported,
    so it may overlap the gradient check; every timed case waits for it."""
    out = os.path.join(args.output_dir, name)
    argv = [*scale.tiny_args, "--output-dir", out, "--overwrite", *TINY_RUNS[name]]
    if args.config == "small":  # a random tiny pipeline: the small check has no minutes for pre-training
        from lab import tiny

        path = os.path.join(args.output_dir, "tiny_pipeline")
        tiny.build_pipeline(seed=0).save_pretrained(path)
        argv += ["--model-path", path]
    log = open(os.path.join(args.output_dir, name + ".log"), "w")
    # one torchrun rank: the process group (run.backend), the ranks' reductions and FSDP2, which one GPU can check;
    # part 5's runs in plain processes, beside it
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"] if name == "tiny" else []
    launcher = [sys.executable, *torchrun]
    proc = subprocess.Popen([*launcher, os.path.join(ROOT, "train.py"), *argv], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, text=True)
    return proc, out, log, time.time() + scale.timeouts["tiny"], time.time(), name


def finish_tiny(started, deadline: float) -> dict:
    """Waits for part 1 and reads its metrics.jsonl: skipped optimizer steps, and the rewards at the start and end."""
    proc, out, log, own_deadline, start, name = started
    try:
        proc.wait(timeout=max(1.0, min(deadline, own_deadline) - time.time()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return dict(kind="tiny", run=name, status="stopped: over its time limit or the budget")
    finally:
        log.close()
    if proc.returncode:
        with open(log.name) as f:
            why = (f.read().strip().splitlines() or ["no output"])[-1]
        return dict(kind="tiny", run=name, status=f"failed (exit {proc.returncode}): {why[:300]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    train = [r["train/reward/shapes"] for r in rows if "train/reward/shapes" in r]
    held_out = [r["eval/reward/shapes"] for r in rows if "eval/reward/shapes" in r]
    n = max(1, len(train) // 4)  # the first and last quarter of the iterations
    skipped = sum(r.get("faults/skipped_steps", 0) for r in rows)
    return dict(kind="tiny", run=name, status="ok", wall_s=time.time() - start, iterations=len(train),
                skipped_steps=skipped,
                train_reward=[sum(train[:n]) / n, sum(train[-n:]) / n], eval_reward=[held_out[0], held_out[-1]],
                ok=skipped == 0 and held_out[-1] > held_out[0])


def _num(value, digits=3):
    if value is None or value != value:
        return "n/a"
    return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:,.0f}"


def _share(value):
    return "n/a" if value is None else f"{100 * value:.0f} %"


def lever_rows(name: str, probe_result: dict) -> list:
    """Markdown rows of one probe: one per max batch."""
    p = probe_result
    return [f"| {name} | {p['resolution']} | {f['max_batch']} | {_num(f['rollout_s_per_image'])} | "
            f"{_num(f['rollout_tflops'])} | {_share(f['rollout_share'])} | {_num(p['update_s_per_step'])} | "
            f"{_num(p['update_tflops'])} | {_share(p['update_share'])} | "
            f"{' / '.join(_num(s, 3) for s in f['projected_s'].values())} | "
            f"{_num(f['warmup_s'])} / {_num(p['update_warmup_s'])} | {_num(p['ratio_deviation'])} |"
            for f in p["forwards"]]


LEVER_HEADER = ("| lever | resolution | max batch | rollout s/image | TFLOP/s | of peak | update s/step | TFLOP/s | "
                "of peak | one iteration, projected: rollout / decode + reward / update s | warm-up s: forward / "
                "update | first-step ratio - 1 |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def report(result: dict):
    """The result as a markdown table, printed as it comes."""
    kind, status = result["kind"], result["status"]
    print()
    if status != "ok":
        print(f"**{kind} {result.get('lever', result.get('run', ''))}**: {status}")
        return
    elif kind == "tiny":
        print("| tiny model on the accelerator | skipped steps | train reward first → last quarter | held-out reward "
              "first → last | ok |\n|---|---|---|---|---|")
        label = {"tiny": "", "tiny_bf16": ", bf16", "tiny_fp8": ", bf16, fp8 rollouts"}[result["run"]]
        print(f"| {result['iterations']} iterations{label} | "
              f"{result['skipped_steps']} | "
              f"{' → '.join(map(_num, result['train_reward']))} | {' → '.join(map(_num, result['eval_reward']))} | "
              f"{result['ok']} |")
    elif kind == "gradient":
        print(f"| gradient at {result['resolution']}² | cosine | relative error | norm | math kernel's norm | "
              f"update skipped steps | peak GiB | ok |\n|---|---|---|---|---|---|---|---|")
        print(f"| LoRA {result['resolution']}² | {result['cosine']:.5f} | {_num(result['relative_error'])} | "
              f"{_num(result['norm'])} | {_num(result['exact_norm'])} | {result['skipped_steps']} | "
              f"{_num(result['peak_gib'])} | {result['ok']} |\n\n"
              f"gradient check {'passed' if result['ok'] else 'failed'}: {result['message']}")
    elif kind == "iteration":
        s = result["seconds"]
        print("| one iteration | NFE | rollout s | decode + reward s | update s | peak GiB | rollout TFLOP/s | "
              "of peak | first-step ratio - 1 | skipped steps |\n|---|---|---|---|---|---|---|---|---|---|")
        print(f"| {result['resolution']}² | {result['nfe']} | {_num(s['rollout'])} | {_num(s['decode_and_reward'])} | "
              f"{_num(s['update'])} | {_num(result['peak_gib'])} | {_num(result['rollout_tflops'])} | "
              f"{_share(result['rollout_share'])} | {_num(result['ratio_deviation'])} | {result['skipped_steps']} |")
        print(f"\n{LEVER_HEADER}\n" + "\n".join(lever_rows("baseline", result["probe"])))
    elif kind == "fp8":
        print(f"FP8 copy: {result['quantized_layers']} linear layers quantized, {_num(result['copy_gib'])} GiB, "
              f"built in {_num(result['build_s'])} s; re-quantizing them all (a full fine-tune, after each update) "
              f"{_num(result['refresh_s'])} s\n")
        print("| rollout forward | resolution | max batch | s/image | TFLOP/s | of bf16 peak | of FP8 peak | "
              "speed-up over the policy | warm-up s | PSNR against the policy, dB (min / mean) |\n"
              "|---|---|---|---|---|---|---|---|---|---|")
        for row in result["rows"]:
            db = row.get("psnr_db")
            print(f"| {row['variant']} | {row['resolution']} | {row['max_batch']} | {_num(row['s_per_image'])} | "
                  f"{_num(row['tflops'])} | {_share(row['bf16_share'])} | {_share(row['fp8_share'])} | "
                  f"{_num(row['speedup'])} | {_num(row['warmup_s'])} | "
                  f"{f'{min(db):.1f} / {sum(db) / len(db):.1f}' if db else ''} |")
    elif kind == "fp8_iteration":
        s = result["seconds"]
        print("| one iteration, FP8 copy | Λ | NFE (on the copy) | rollout s (at warm speed) | decode + reward s | "
              "update s | warm-up s | peak GiB | first-step ratio error | skipped steps |\n"
              "|---|---|---|---|---|---|---|---|---|---|")
        print(f"| {result['resolution']}² | {result['granularities']} | {result['nfe']} "
              f"({result['image_only_nfe']}) | {_num(s['rollout'])} ({_num(result['projected_rollout_s'])}) | "
              f"{_num(s['decode_and_reward'])} | "
              f"{_num(s['update'])} | {_num(result['warmup_s'])} | {_num(result['peak_gib'])} | "
              f"{_num(result['first_ratio_error'])} | {result['skipped_steps']} |")
    else:
        print(LEVER_HEADER)
        print("\n".join(row for p in result["probes"] for row in lever_rows(result["lever"], p)))
    for note in result.get("notes", []):
        print(note)
    print(f"({_num(result['wall_s'])} s wall)")
    sys.stdout.flush()


def clean(value):
    """NaN and infinity become null: results.jsonl stays strict JSON."""
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def main(args: Args):
    scale = SCALES[args.config]
    if args.case:  # a subprocess: one case, its result on the last line
        case = json.loads(args.case)
        result = {**case, "status": "ok", **CASES[case["kind"]](scale, case)}
        print("RESULT " + json.dumps(clean(result), allow_nan=False))
        return
    os.makedirs(args.output_dir, exist_ok=True)
    deadline, results = time.time() + args.budget_s, os.path.join(args.output_dir, "results.jsonl")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(f"# gpu_check.py --config {args.config}: {device}, torch {torch.__version__}, CUDA {torch.version.cuda}")

    def record(outcome):
        with open(results, "a") as f:
            f.write(json.dumps(clean({**outcome, "config": args.config, "device": device}), allow_nan=False) + "\n")
        report(outcome)

    isolate = torch.cuda.is_available() if args.isolate is None else args.isolate
    tiny_runs = [start_tiny(args, scale)] if "tiny" in args.parts else []
    if "tiny" in args.parts and "fp8" in args.parts:
        if torch.cuda.is_available():
            tiny_runs += [start_tiny(args, scale, name) for name in ("tiny_bf16", "tiny_fp8")]
        else:
            record(dict(kind="tiny", run="tiny_fp8", status="skipped: --rollout-precision fp8 needs CUDA"))
    for case in plan(scale, args.parts):
        if case["kind"] != "gradient":  # the timed cases run alone on the accelerator
            for started in tiny_runs:
                record(finish_tiny(started, deadline))
            tiny_runs = []
        record(run_case(args, case, deadline, isolate))
    for started in tiny_runs:
        record(finish_tiny(started, deadline))
    print(f"\nresults: {results}")


if __name__ == "__main__":
    main(tyro.cli(Args))
