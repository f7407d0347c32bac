"""Model adapters: what the method files need from a diffusers text-to-image flow model, and nothing more.

An adapter loads a diffusers pipeline with `from_pretrained`, encodes prompts, draws initial noise in the model's
latent layout, gives the velocity v(x, sigma | prompt) of the transformer being trained, and decodes latents to
images in [0, 1]. `velocity` is the one place that calls a transformer. The method files (sampler.py, g2rpo.py)
see only latents, sigmas and prompt indices, so they do not know which model they drive.

  FLUX.1 (`FluxAdapter`): latents packed into 2x2 patches (B, L, 4C) with diffusers' own helpers; the guidance
      value enters as an embedding (FLUX.1-dev, reference 3.5), no CFG. The built-in tiny model is a FLUX pipeline.
  SD3 / SD3.5 (`SD3Adapter`): latents (B, C, h, w); classifier-free guidance inside the velocity, so the
      rollout and the update see the same guided velocity. One velocity evaluation costs 2 image-forwards.

Shapes: n samples in a call, B prompts, L packed image tokens, T text tokens, D text width.

Deviations from the reference code (numbers of the README's list): 3 (sigma goes to the transformer exactly;
diffusers' FLUX scales it by 1000 inside, SD3 takes t = 1000 sigma), 4 (VAE scaling from its config), 11 (the
attention kernel chosen per phase, cuDNN attention excluded from the update on CUDA, and `check_gradient`).
Optional, off by default: `compile=True` compiles the transformer's repeated blocks (regional compilation).
"""
import contextlib
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

LORA_ATTENTION = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
LORA_FEED_FORWARD = ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp"]
ATTENTION_BACKENDS = ("auto", "flash", "efficient", "math", "cudnn")


class ModelLoadError(Exception):
    """The weights could not be loaded; the message names the path tried and how to get the weights."""


def missing_weights_message(path: str, err: Exception) -> str:
    where = "a local folder" if os.path.isdir(path) else "a hub id"
    return (f"could not load a diffusers pipeline from '{path}' ({where}): {type(err).__name__}: {str(err)[:200]}. "
            f"Pass --model-path to a folder holding model_index.json and its subfolders, or log in "
            f"(`hf auth login`) and accept the model's license on its hub page, then retry")


def add_lora(transformer, rank: int, alpha: float, feed_forward: bool):
    """LoRA (peft) of rank `rank` on the attention projections, and on the feed-forward ones if `feed_forward`.

    The frozen base stays in the dtype it was loaded in (bf16 on a GPU: it is only read); the LoRA weights, the only
    trained ones, are fp32, because autocast computes in bf16 anyway and AdamW's small steps vanish in bf16 weights.
    `alpha` 0 means alpha = rank. The LoRA initialisation draws from torch's global generator: seed it first.
    """
    from peft import LoraConfig

    transformer.requires_grad_(False)
    targets = LORA_ATTENTION + (LORA_FEED_FORWARD if feed_forward else [])
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=alpha or rank, init_lora_weights="gaussian",
                                       target_modules=targets))
    for p in transformer.parameters():
        if p.requires_grad:
            p.data = p.data.float()


# --- attention kernels ------------------------------------------------------------------------------------------
# diffusers' FLUX and SD3 attention calls torch's F.scaled_dot_product_attention (SDPA), so torch's `sdpa_kernel`
# context picks the kernel: flash, memory-efficient, math (the plain softmax(QK^T / sqrt(d)) V, the reference) or
# cuDNN.
_KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH, "cudnn": SDPBackend.CUDNN_ATTENTION}


def validate_attention_backend(name: str) -> str:
    """`name` if it is one of ATTENTION_BACKENDS; else a ValueError whose message lists them."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend '{name}'; choose one of {', '.join(ATTENTION_BACKENDS)}")
    return name


def sdpa_backends(name: str, device_type: str):
    """The SDPA kernels allowed for attention backend `name` on `device_type`, or None (no restriction).

    CUDA, "auto": flash, memory-efficient, math, in that order of preference, and not cuDNN attention: on an H200
    (torch 2.11, CUDA 13) its backward gave gradient norms of 2894 or non-finite where every other kernel and the
    CPU gave 0.0477, so the update never learned. An explicit name allows that kernel alone (torch raises if it
    cannot run the inputs, e.g. flash in fp32). Other devices have flash-on-CPU and math only: "math" is math,
    anything else is torch's own choice.
    The no-grad rollout's "auto" is the same set, although cuDNN's forward may be the fastest (gpu_check.py measures
    it as `rollout_attention_backend="cudnn"`): its forward has not been verified on that chip either, and a rollout
    kernel other than the update's moves the first update step's ratio away from 1.
    """
    validate_attention_backend(name)
    if device_type != "cuda":
        return [SDPBackend.MATH] if name == "math" else None
    if name == "auto":
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return [_KERNELS[name]]


def enabled_sdpa_backends():
    """The SDPA kernels the current context allows (torch's global flags, which `sdpa_kernel` sets)."""
    flags = {SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled(),
             SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled(),
             SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled(),
             SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled()}
    return [kernel for kernel, on in flags.items() if on]


def checkpoint_keeping_kernels(module, *args):
    """diffusers' gradient checkpointing of one block, with the backward's recompute under the same SDPA kernels as
    the forward: torch's checkpoint restores autocast and the RNG state for the recompute, not the kernel flags, so
    without this the backward would recompute (and differentiate) under torch's default kernels, cuDNN included."""
    kernels = enabled_sdpa_backends()
    return torch.utils.checkpoint.checkpoint(
        module.__call__, *args, use_reentrant=False,
        context_fn=lambda: (contextlib.nullcontext(), sdpa_kernel(kernels)))


def compile_blocks(transformer, backend: str = "inductor"):
    """Regional compilation: torch.compile each repeated block (FLUX's double- and single-stream blocks, SD3's
    joint blocks), not the whole model. The blocks of a kind share one compiled graph, so compiling takes seconds to
    a minute instead of many, for nearly the speed of compiling the whole model. Graphs are built at the first call
    of each grad mode and shape. `backend` "aot_eager" traces the same graphs without generating kernels: a quick
    check of the plumbing on a CPU, where inductor spends minutes on even the tiny model."""
    if getattr(transformer, "_repeated_blocks", None):
        transformer.compile_repeated_blocks(backend=backend)
    else:
        for block in transformer.transformer_blocks:
            block.compile(backend=backend)


class Adapter:
    """Common plumbing; subclasses define `pipeline_class`, `encode_prompts`, `noise` and `velocity`.

    attention_backend:          SDPA kernels of the update's forward and backward (one of ATTENTION_BACKENDS)
    rollout_attention_backend:  SDPA kernels of the no-grad forwards (rollout, evaluation)
    compile:                    regional compilation of the transformer's repeated blocks at the first call:
                                False, True (inductor) or a torch.compile backend name (see `compile_blocks`)
    """

    pipeline_class = None

    def __init__(self, pipe, device, dtype, offload_text_encoders=False, place_transformer=True, *,
                 attention_backend="auto", rollout_attention_backend="auto", compile=False):
        self.pipe, self.device, self.dtype = pipe, torch.device(device), dtype
        self.transformer = pipe.transformer
        self.offload = offload_text_encoders
        self.attention_backend = validate_attention_backend(attention_backend)
        self.rollout_attention_backend = validate_attention_backend(rollout_attention_backend)
        self.compile, self._compiled = compile, False
        self._reference = None  # inside `reference_mode`: whether the reference computes in fp32
        cuda_only = sorted({attention_backend, rollout_attention_backend} & {"efficient", "cudnn"})
        if cuda_only and self.device.type != "cuda":
            print(f"note: attention backend {' and '.join(cuda_only)} needs CUDA; on {self.device.type} the attention "
                  f"runs on torch's own choice of kernel (flash-on-CPU or math)")
        # frozen parts: eval mode, no gradients, the compute dtype; text encoders wait on the CPU if offloading
        for module in self.frozen_modules():
            home = "cpu" if self.offload and module is not pipe.vae else self.device
            module.requires_grad_(False).eval().to(home)
            if module.dtype != dtype:
                module.to(dtype)
        if place_transformer:  # FSDP2 shards the transformer on the CPU first, then moves only the shards
            self.transformer.to(self.device)

    @torch.no_grad()
    def encode(self, prompts):
        """Prompt conditioning on the device: a dict of tensors indexed by prompt (see `encode_prompts`)."""
        if not self.offload:
            return self.encode_prompts(prompts)
        encoders = [m for m in self.frozen_modules() if m is not self.pipe.vae]
        for module in encoders:  # T5-XXL alone is ~9.5 GB in bf16: on the accelerator only while encoding
            module.to(self.device)
        try:
            return self.encode_prompts(prompts)
        finally:
            for module in encoders:
                module.to("cpu")

    @classmethod
    def load(cls, path: str, device, dtype, transformer_dtype=torch.float32, **kwargs):
        try:
            pipe = cls.pipeline_class.from_pretrained(path, dtype=dtype)
        except (OSError, ValueError, EnvironmentError) as err:
            raise ModelLoadError(missing_weights_message(path, err)) from None
        pipe.set_progress_bar_config(disable=True)
        if pipe.transformer.dtype != transformer_dtype:
            pipe.transformer.to(transformer_dtype)  # the trained weights: fp32 master copy by default
        return cls(pipe, device, dtype, **kwargs)

    def frozen_modules(self):
        return [m for m in (getattr(self.pipe, name, None) for name in
                            ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")) if m is not None]


    def autocast(self):
        fp32 = self.dtype == torch.float32 or self._reference
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=not fp32)

    def compute(self):
        """The context of every transformer call: autocast to the compute dtype, and the SDPA kernels of the phase,
        the update's when gradients are on (forward and backward), the rollout's otherwise."""
        self._prepare()
        if self._reference is not None:
            kernels = [SDPBackend.MATH]
        else:
            name = self.attention_backend if torch.is_grad_enabled() else self.rollout_attention_backend
            kernels = sdpa_backends(name, self.device.type)
        stack = contextlib.ExitStack()
        stack.enter_context(self.autocast())
        if kernels:
            stack.enter_context(sdpa_kernel(kernels, set_priority=True))
        return stack

    def text_inputs(self, *tensors):
        """The text features as the transformer takes them: as encoded, or fp32 in the fp32 reference, where no
        autocast casts the (bf16) encoders' output for the fp32 layers."""
        return tuple(t.float() for t in tensors) if self._reference else tensors

    def _prepare(self):
        """At the first call, after LoRA, DDP or FSDP2 have wrapped the transformer: compile its repeated blocks if
        asked; and whenever gradient checkpointing is on, make its recompute keep the forward's kernels."""
        t = self.transformer
        checkpointing = getattr(t, "gradient_checkpointing", False)
        if checkpointing and t._gradient_checkpointing_func is not checkpoint_keeping_kernels:
            t.enable_gradient_checkpointing(checkpoint_keeping_kernels)
        if self.compile and not self._compiled:
            compile_blocks(t, "inductor" if self.compile is True else self.compile)
            self._compiled = True

    def fp32_weights(self) -> bool:
        """Whether the transformer can compute in fp32: every weight is fp32 and no FSDP2 policy casts them."""
        from torch.distributed.fsdp import FSDPModule

        return not isinstance(self.transformer, FSDPModule) and all(
            p.dtype == torch.float32 for p in self.transformer.parameters())

    def check_gradient(self, loss_fn, params, **tolerances) -> "GradientCheck":
        """`check_gradient` against this adapter's references: the math kernel at the run's precision, and fp32
        too where the run computes in bf16 on fp32 weights."""
        fp32 = self.dtype != torch.float32 and self.fp32_weights()
        return check_gradient(loss_fn, params, lambda: self.reference_mode(fp32=False),
                              (lambda: self.reference_mode(fp32=True)) if fp32 else None, **tolerances)

    @contextlib.contextmanager
    def reference_mode(self, fp32: bool = True):
        """`check_gradient`'s reference: the math SDPA kernel in every phase, eager (no compiled blocks), and, with
        `fp32` and fp32 weights, autocast off. Where the weights are bf16 (a LoRA's frozen base) or FSDP2 casts them,
        the reference keeps the run's precision and differs from it in the attention kernel alone."""
        saved = self._reference
        self._reference = fp32 and self.fp32_weights()
        try:
            with torch.compiler.set_stance("force_eager"):
                yield
        finally:
            self._reference = saved

    @torch.no_grad()
    def decode(self, latents, resolution):
        """latents (M, ...) -> images (M, 3, H, W) in [0, 1], float32."""
        vae = self.pipe.vae
        x = self.unpack(latents, resolution).to(self.device, vae.dtype)  # (M, C, h, w)
        # the VAE's latent normalisation: z = (x - shift) * scale, so x = z / scale + shift
        x = x / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        images = vae.decode(x, return_dict=False)[0]  # (M, 3, H, W) in [-1, 1]
        return ((images.float() + 1) / 2).clamp(0, 1)

    def unpack(self, latents, resolution):
        return latents


class FluxAdapter(Adapter):
    from diffusers import FluxPipeline as pipeline_class

    def __init__(self, pipe, device, dtype, guidance: float = 3.5, max_sequence_length: int = 512,
                 offload_text_encoders: bool = False, place_transformer: bool = True, **options):
        super().__init__(pipe, device, dtype, offload_text_encoders, place_transformer, **options)
        self.guidance = guidance
        self.max_sequence_length = min(max_sequence_length, pipe.tokenizer_2.model_max_length)

    def encode_prompts(self, prompts):
        prompt_embeds, pooled, text_ids = self.pipe.encode_prompt(
            prompts, prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": prompt_embeds, "pooled": pooled, "text_ids": text_ids}  # (B, T, D), (B, D'), (T, 3)

    def latent_channels(self):
        return self.transformer.config.in_channels // 4

    def noise(self, generators, resolution):
        """One standard normal latent per generator: (B, L, 4C), drawn on the CPU for reproducibility."""
        h = w = 2 * (resolution // (self.pipe.vae_scale_factor * 2))
        shape = (self.latent_channels(), h, w)
        latents = torch.stack([torch.randn(shape, generator=g) for g in generators])  # (B, C, h, w)
        return self.pipe._pack_latents(latents, len(generators), shape[0], h, w).to(self.device)  # (B, L, 4C)

    def unpack(self, latents, resolution):
        return self.pipe._unpack_latents(latents, resolution, resolution, self.pipe.vae_scale_factor)

    def velocity(self, transformer, cond, latents, sigma, prompt_index, resolution):
        """v(x, sigma | prompt): latents (M, L, 4C), sigma (M,), prompt_index (M,) -> (M, L, 4C) float32."""
        M = latents.shape[0]
        h = w = resolution // self.pipe.vae_scale_factor
        image_ids = self.pipe._prepare_latent_image_ids(M, h // 2, w // 2, self.device, latents.dtype)  # (L, 3)
        guidance = (torch.full((M,), self.guidance, device=self.device)
                    if self.transformer.config.guidance_embeds else None)
        embeds, pooled = self.text_inputs(cond["prompt_embeds"][prompt_index], cond["pooled"][prompt_index])
        with self.compute():
            out = transformer(
                hidden_states=latents, timestep=sigma.to(self.device), guidance=guidance,  # scaled by 1000 inside
                pooled_projections=pooled, encoder_hidden_states=embeds,
                txt_ids=cond["text_ids"], img_ids=image_ids, return_dict=False)[0]
        return out.float()


class SD3Adapter(Adapter):
    from diffusers import StableDiffusion3Pipeline as pipeline_class

    def __init__(self, pipe, device, dtype, guidance: float = 4.5, max_sequence_length: int = 256,
                 offload_text_encoders: bool = False, place_transformer: bool = True, **options):
        super().__init__(pipe, device, dtype, offload_text_encoders, place_transformer, **options)
        self.guidance = guidance
        tok3 = getattr(pipe, "tokenizer_3", None)
        self.max_sequence_length = min(max_sequence_length, tok3.model_max_length) if tok3 else max_sequence_length

    def encode_prompts(self, prompts):
        embeds, negative, pooled, negative_pooled = self.pipe.encode_prompt(
            prompts, None, None, device=self.device, do_classifier_free_guidance=True,
            max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": embeds, "negative_embeds": negative, "pooled": pooled,
                "negative_pooled": negative_pooled}

    def noise(self, generators, resolution):
        h = w = resolution // self.pipe.vae_scale_factor
        shape = (self.transformer.config.in_channels, h, w)
        return torch.stack([torch.randn(shape, generator=g) for g in generators]).to(self.device)  # (B, C, h, w)

    def velocity(self, transformer, cond, latents, sigma, prompt_index, resolution):
        """Guided velocity v_u + w (v_c - v_u): latents (M, C, h, w) -> (M, C, h, w) float32."""
        embeds = torch.cat([cond["negative_embeds"][prompt_index], cond["prompt_embeds"][prompt_index]])
        pooled = torch.cat([cond["negative_pooled"][prompt_index], cond["pooled"][prompt_index]])
        embeds, pooled = self.text_inputs(embeds, pooled)
        with self.compute():
            out = transformer(hidden_states=torch.cat([latents, latents]),
                              timestep=torch.cat([sigma, sigma]).to(self.device) * 1000,  # SD3 takes t = 1000 sigma
                              encoder_hidden_states=embeds, pooled_projections=pooled, return_dict=False)[0]
        uncond, text = out.float().chunk(2)
        return uncond + self.guidance * (text - uncond)


# --- the gradient self-check -------------------------------------------------------------------------------------
@dataclass
class GradientCheck:
    """The run's gradient g against the reference g_ref: the math SDPA kernel at the run's precision, eager."""

    cosine: float  # <g, g_ref> / (|g| |g_ref|)
    relative_error: float  # |g - g_ref| / |g_ref|
    norm: float  # |g|
    reference_norm: float  # |g_ref|
    fp32_cosine: float  # cosine of g against the math kernel in fp32; nan where not computed
    ok: bool
    message: str  # one line: the figures, and when not ok the cause and the fix


def _local(tensor):
    """An FSDP2 parameter or gradient is a DTensor sharded over the ranks: this rank's shard."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _gradients(loss_fn, params):
    """Backward of `loss_fn()`; returns fp32 copies of the (local) gradients and clears `.grad`."""
    for p in params:
        p.grad = None
    loss_fn().backward()
    grads = [_local(p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().clone() for p in params]
    for p in params:
        p.grad = None
    return grads


def _compare(grads, reference, sharded):
    """(cosine, relative error, |g|, |g_ref|), summed over ranks where the gradients are FSDP2 shards (DDP's are
    already the same on every rank)."""
    sums = torch.stack([sum((g.double() * r.double()).sum() for g, r in zip(grads, reference)),
                        sum(g.double().square().sum() for g in grads),
                        sum(r.double().square().sum() for r in reference),
                        sum((g.double() - r.double()).square().sum() for g, r in zip(grads, reference))])
    if sharded:
        dist.all_reduce(sums)
    dot, norm2, ref2, diff2 = sums.tolist()
    cosine = dot / math.sqrt(norm2 * ref2) if norm2 > 0 and ref2 > 0 else float("nan")
    return cosine, math.sqrt(diff2 / ref2) if ref2 > 0 else float("nan"), math.sqrt(norm2), math.sqrt(ref2)


def check_gradient(loss_fn, params, reference, fp32_reference=None, *, min_cosine: float = 0.99,
                   max_relative_error: float = 0.1, min_fp32_cosine: float = 0.8,
                   max_numel: int = 2**28) -> GradientCheck:
    """Whether the run computes the right gradient: `loss_fn`'s gradient under the run's kernels and precision
    against the same gradient under `reference`, and (if given) under `fp32_reference`.

    loss_fn:         () -> a scalar loss through the run's own code path (the update's loss on one rollout sample);
                     it must draw no random numbers, as it is called two or three times.
    reference:       () -> context manager: the math SDPA kernel at the run's precision, eager
                     (`Adapter.reference_mode(fp32=False)`). This is the gate: only the kernel differs, so the
                     gradients agree to rounding (measured on CPU in bf16: cosine 0.99999, relative error 4e-3).
    fp32_reference:  () -> the math kernel in fp32 (`Adapter.reference_mode()`), where the weights allow it.
                     Loosely gated: bf16 rounding of the velocity alone moves the log-prob's gradient (it is
                     driven by x' - mean(v), a small difference of large numbers) to a cosine near 0.96.
    max_numel:       parameters are taken in order until this many (local) elements: the copies stay under 1 GiB.

    The wrong cuDNN backward gave norms 60,000 times too large or non-finite, far outside these bounds. The
    parameters are untouched; `.grad` is left cleared (None).
    """
    chosen, total = [], 0
    for p in params:
        if chosen and total + _local(p).numel() > max_numel:
            break
        chosen.append(p)
        total += _local(p).numel()
    sharded = dist.is_initialized() and any(hasattr(p, "to_local") for p in chosen)
    grads = _gradients(loss_fn, chosen)
    with reference():
        reference_grads = _gradients(loss_fn, chosen)
    cosine, relative_error, norm, reference_norm = _compare(grads, reference_grads, sharded)
    fp32_cosine, fp32_norm = float("nan"), float("nan")
    if fp32_reference is not None:
        with fp32_reference():
            fp32_cosine, _, _, fp32_norm = _compare(grads, _gradients(loss_fn, chosen), sharded)
    kernel_ok = math.isfinite(norm) and cosine >= min_cosine and relative_error <= max_relative_error
    fp32_ok = fp32_reference is None or fp32_cosine >= min_fp32_cosine
    figures = (f"cosine {cosine:.5f}, relative error {relative_error:.3g}, |g| {norm:.4g} against the math attention "
               f"kernel's {reference_norm:.4g}" + (f", cosine {fp32_cosine:.3f} against fp32" if fp32_reference else "")
               + f", over {total:,} gradient elements")
    if kernel_ok and fp32_ok:
        return GradientCheck(cosine, relative_error, norm, reference_norm, fp32_cosine, True,
                             f"gradient check passed: {figures}")
    if not (math.isfinite(reference_norm) and reference_norm > 0):
        cause, fix = (("bf16 precision (the math kernel in bf16 is not finite, in fp32 it is)", "--mixed-precision no")
                      if math.isfinite(fp32_norm) and fp32_norm > 0 else
                      ("the loss or its inputs (the reference gradient is zero or not finite too)",
                       "check the first iteration's rewards and advantages"))
    elif not kernel_ok:
        cause, fix = "the attention kernel (the math kernel gives another gradient)", "--attention-backend math"
    else:
        cause, fix = "bf16 precision (the gradient is far from fp32's)", "--mixed-precision no"
    return GradientCheck(cosine, relative_error, norm, reference_norm, fp32_cosine, False,
                         f"gradient check failed: {figures}; cause: {cause}; fix: {fix}")


ADAPTERS = {"flux": FluxAdapter, "tiny": FluxAdapter, "sd3": SD3Adapter}
# image sides must be multiples of the VAE factor times the transformer's 2x2 patch (the tiny VAE downsamples by 2)
RESOLUTION_MULTIPLE = {"flux": 16, "sd3": 16, "tiny": 4}
