"""What a training run will cost before you have the hardware: the device memory and compute of one iteration of
train.py, per GPU, from the project's own code run on fake tensors.

Fake tensors (torch's FakeTensorMode) carry shapes, dtypes and devices but no data, so a 12 B-parameter FLUX.1-dev
runs on a laptop: every model is built from its published configuration (tools/configs/, no weights) and driven through
the same functions train.py calls, phase by phase, for one rank:
  0. pool         for a method that chooses its prompts by the ODE images of P candidates each (its
                  `anchor_candidates`, methods/base.py): the B P candidates encoded at
                  once, one transformer call of their ODE anchors (sampler.ode_sample, B P N forwards in calls of
                  <= --max-batch, no gradients) with the pool's storage, and a reward batch of anchors;
  1. encode       adapter.encode of this rank's prompt batch (B) and of an evaluation batch;
  2. rollout      one transformer call at the rollout's largest batch (<= --max-batch), no gradients, plus the
                  rollout's own storage (the method's rollout on fake tensors at the real latent shape with a
                  velocity of zeros: the tree of latents it keeps, at the transformer call where it is largest);
  3. reward       decoding a --reward-batch-size batch and scoring it with every reward model;
  4. update       the method's own update as train.py calls it (`method.update`), on the rollout cut to its first
                  trained step, one inner epoch: forward, and backward through the checkpoints as configured, with
                  a method's own extra forwards (sub-steps: their activations held until the backward)
                  and the KL's base model where --kl-beta; the optimizer step (AdamW multi-tensor, as on CUDA, with
                  its state) and the EMA where --ema-decay; the rollout kept for it. Where one optimizer step takes
                  several trained steps (every update but G2RPO's default) the first two steps run, so the second
                  holds the first's gradients.
                  The row's FLOPs are one step's, its calls the trained steps times --inner-epochs;
  5. evaluation   lab.loop.held_out_eval's micro-batch: encode, sample (its transformer call) and decode + score;
and what stays resident throughout: the weights, the trained weights' optimizer state, the EMA, the conditioning.

How it counts:
  - memory: torch's MemTracker, the peak of live tensors by category (weights, gradients, optimizer state,
    activations and temporaries, other: rollout storage, conditioning, images, EMA);
  - compute: torch's FlopCounterMode on each distinct call shape once, times the call counts of the rollout's own
    NFE accounting; the time floor is that over --peak-tflops (100 % of the chip's dense peak: a lower bound);
  - attention: without a GPU torch would send fake tensors to the math kernel, which materialises the
    (batch, heads, tokens, tokens) score matrix. The plan sends every attention call to the kernel the run takes on
    CUDA under its --attention-backend / --rollout-attention-backend: flash in bf16 without a mask, else
    memory-efficient, or math when asked for. Their fake implementations allocate what the kernels do (the output
    and its log-sum-exp), and their backward what theirs does;
  - the accelerator is simulated as a fake CPU device: torch's autograd engine asks the CUDA driver for a context
    in every backward, which a machine without a GPU lacks. Autocast then follows torch's CPU rules for bf16, which
    keep a few more ops (norms) in bf16 than CUDA's: activations can be a little lower than on CUDA.
  - many GPUs: full fine-tunes are sharded with FSDP2 (`fully_shard`, as train.py does) over torch's fake process
    group of --gpus ranks; what one rank holds is measured, the all-gathered blocks included.

What it cannot simulate, add it yourself: the CUDA context and allocator fragmentation (typically 1-3 GiB and up
to ~10 % of the peak), NCCL and cuBLAS workspaces, torch.compile, rewards that live elsewhere (imagereward runs
inside its own package, unifiedreward on a server), and how far below the FLOP floor real kernels run.

Run:
    python -m tools.plan --model flux --lora-rank 64 --lr 1e-4                   # one GPU, LoRA (the README's command)
    python -m tools.plan --model flux --lora-rank 64 --offload-text-encoders
    python -m tools.plan --model flux --lora-rank 64 --lr 1e-4 --rollout-precision fp8   # with the FP8 rollout copy
    python -m tools.plan --model flux --gpus 8                                   # one rank of 8, full fine-tune, FSDP2
    python -m tools.plan --model sd3                                             # SD3.5 Medium, LoRA
    python -m tools.plan --model zimage                                          # Z-Image-Turbo, LoRA (1 min here)
    python -m tools.plan --model wan                                             # Wan 2.1, 832 x 480 x 81 frames
    python -m tools.plan --model wan22                                           # Wan 2.2 TI2V 5B, 1280 x 704 x 121
    python -m tools.plan --model flux2                                           # FLUX.2 [klein] 4B, LoRA
    python -m tools.plan --model qwenimage                                       # Qwen-Image, LoRA, 1328^2
    python -m tools.plan --model flux --gpus 8 --gpu-memory-gib 140 --peak-tflops 989   # another card
    python -m tools.plan --model flux --method NAME                              # any method of methods/, its FLUX preset
"""
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from lab import flags
import rewards
from lab.kernels import fp8_sharding_problem, sdpa_backends
from lab.models import ADAPTERS
from lab.checkpoint import EXPORT_SHARD_BYTES
from lab.flags import fail
from lab.loop import eval_items, generators as prompt_generators
from methods.base import UpdateContext
from lab.policy import base_velocity_fn, make_policy, make_velocity_fn
from sampler import ode_sample, sigma_schedule

ROOT = os.path.dirname(os.path.abspath(__file__))
GiB = 2**30
EXPORT_GB = EXPORT_SHARD_BYTES / 1e9
CONFIGS = {"flux": "configs/flux1-dev", "sd3": "configs/sd3.5-medium", "zimage": "configs/z-image-turbo",
           "flux2": "configs/flux2-klein-4b", "qwenimage": "configs/qwen-image", "wan": "configs/wan2.1-t2v-1.3b",
           "wan22": "configs/wan2.2-ti2v-5b"}
# reward models the plan can build from a configuration: name -> (config file, builder)
REWARD_CONFIGS = {"hps": "open_clip_ViT-H-14.json", "clip": "open_clip_ViT-H-14-quickgelu.json",
                  "pickscore": "pickscore.json", "aesthetic": "aesthetic_clip.json"}


@dataclass
class PlanArgs(flags.TrainArgs):
    gpus: int = 1
    """GPUs of the run (all nodes together); the plan is of one rank. Full fine-tunes shard with FSDP2 over them."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU in GiB (A100 / H100 80 GB: 80; H200: about 140), for the "fits" line."""
    peak_tflops: float = 989.0
    """Dense bf16 peak of one GPU in TFLOP/s (H100 / H200 SXM: 989; A100: 312), for the time floor."""
    configs: str = ""
    """Folder of the model's published configurations (default: the family's folder in tools/configs/)."""
    disk_gb_per_s: float = 1.0
    """Write and read bandwidth of the checkpoint folder per rank in GB/s, for the checkpoint's time."""
    grace_s: float = 30.0
    """Seconds between a scheduler's SIGTERM and its SIGKILL (torchrun's default: 30), for the preemption line."""


# ---------------------------------------------------------------------------------------------------------------
# The simulated device: fake tensors, their Python scalars, and the attention kernel the run would take
# ---------------------------------------------------------------------------------------------------------------
class NoValues(TorchDispatchMode):
    """Python numbers read from fake tensors (a loss logged with float(), AdamW's step count) are 1: they have no
    values. Nothing the plan measures depends on them; the rollout's structure depends on shapes and on the sigma
    schedule, which stays real.
    A mask applied to a fake tensor (Z-Image's pipeline keeps each caption's tokens so) keeps every element: captions
    are counted at their full --max-sequence-length, an upper bound.
    Noise drawn from a CPU generator (a prompt's own, as train.py seeds it) has no tensor input to make it fake: under
    `fake_mode` it is drawn as a fake tensor, so a group of 100,000 members costs no host memory."""

    def __init__(self, fake_mode=None):
        super().__init__()
        self.fake_mode = fake_mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.fake_mode is not None and func is torch.ops.aten.randn.generator:
            with self.fake_mode:
                return torch.ops.aten.randn.default(*args, **{k: v for k, v in (kwargs or {}).items()
                                                              if k != "generator"})
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            return 1.0 if args[0].dtype.is_floating_point else 1
        if (func is torch.ops.aten.index.Tensor and isinstance(args[0], FakeTensor) and len(args[1]) == 1
                and args[1][0] is not None and args[1][0].dtype == torch.bool):  # x[mask]: every element kept
            return args[0].reshape(-1, *args[0].shape[args[1][0].dim():]).clone()
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def cuda_attention(update_backend: str, rollout_backend: str):
    """Every F.scaled_dot_product_attention call on fake tensors runs the kernel CUDA would choose for the phase's
    backend (kernels.sdpa_backends): flash for fp16 / bf16 without a mask, memory-efficient otherwise, math when that
    is all the backend allows. Real tensors (the real-CPU check) keep torch's own choice."""
    original = F.scaled_dot_product_attention

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        kernels = sdpa_backends(update_backend if torch.is_grad_enabled() else rollout_backend, "cuda")
        names = {k.name for k in kernels}
        if isinstance(query, FakeTensor) and not enable_gqa:
            if attn_mask is not None and not isinstance(attn_mask, FakeTensor):  # (Qwen-Image's, made of real ones)
                attn_mask = query.fake_mode.from_tensor(attn_mask)
            half = query.dtype in (torch.float16, torch.bfloat16)
            if half and attn_mask is None and names & {"FLASH_ATTENTION", "CUDNN_ATTENTION"}:
                return torch.ops.aten._scaled_dot_product_flash_attention(
                    query, key, value, dropout_p, is_causal, scale=scale)[0]
            if "EFFICIENT_ATTENTION" in names:
                # a boolean mask becomes an additive bias at its own (broadcast) shape, as torch converts it, and
                # is expanded to the scores' shape as a view: (B, 1, 1, L) masks cost no (B, heads, L, L) tensor
                bias = None
                if attn_mask is not None:
                    bias = (torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
                            if attn_mask.dtype == torch.bool else attn_mask.to(query.dtype))
                    bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
                return torch.ops.aten._scaled_dot_product_efficient_attention(
                    query, key, value, bias, torch.is_grad_enabled(), dropout_p, is_causal, scale=scale)[0]
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def building(dtype, fake_mode):
    """Modules built inside are created in `dtype`, as fake tensors when `fake_mode` (no memory, no init cost)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with fake_mode or contextlib.nullcontext(), NoValues(fake_mode) if fake_mode else contextlib.nullcontext():
            yield
    finally:
        torch.set_default_dtype(previous)


@dataclass
class Cost:
    peak: dict  # category -> bytes at the peak: weights, grads, optimizer, activations, other, total
    flops: int

    def gib(self, category="total"):
        return self.peak.get(category, 0) / GiB


class _NoHook:
    def remove(self):
        pass


class _FrozenModules:
    """torch's memory trackers put a gradient hook on every parameter of a module they see run, which torch refuses
    for a parameter without gradients (a frozen encoder): those get a hook that does nothing."""

    def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
        for p in module.parameters():
            if not p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _pre_fw_hook(self, module, inputs):
        """A module called again at the top level (SD3 encodes its prompts and the empty negative prompt with the
        same text encoder) starts afresh: torch's tracker would take it for a second training iteration."""
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            if set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)} == {"Global"}:
                del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state):
        """The device's peak only: torch's also updates a peak per module for every op, which makes a backward
        through FLUX's thousands of modules (LoRA's included) take many minutes."""
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot["Total"]:
                self._peak_mem[device] = snapshot["Total"]
                self._peak_mem_snap[device] = dict(snapshot)


class Tracker(_FrozenModules, MemTracker):
    pass


class FSDPTracker(_FrozenModules, FSDPMemTracker):
    """The FSDP2 variant: it tells one rank's shards from the blocks all-gathered for a forward or backward. It
    tracks the FSDP2 module alone; the other modules and tensors are tracked as MemTracker does."""

    def _fsdp_state_pre_forward(self, fsdp_mod, orig_fsdp_state_pre_fw):
        """An FSDP2 module called again at the top level before or after a backward (a method's extra forwards, a second
        trained step that accumulates gradients) starts afresh, as `_FrozenModules._pre_fw_hook` does for the
        others: torch's tracker would take it for a second training iteration, and refuse it."""
        pre_forward = super()._fsdp_state_pre_forward(fsdp_mod, orig_fsdp_state_pre_fw)

        def again(*args, **kwargs):
            if fsdp_mod in self.memory_tracking and not self._mod_tracker.is_bw:
                if self._mod_tracker.parents - {self._mod_tracker.get_known_fqn(fsdp_mod)} == {"Global"}:
                    del self.memory_tracking[fsdp_mod]
            return pre_forward(*args, **kwargs)
        return again

    def track_external(self, *external):
        from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

        for item in external:  # its categories have no plain "Parameter": a frozen module's weights count as buffers
            if isinstance(item, torch.nn.Module):
                for t in [*item.parameters(), *item.buffers()]:
                    self._update_and_maybe_create_winfos(t, _FSDPRefType.BUFFER)
            elif isinstance(item, torch.Tensor):
                self._update_and_maybe_create_winfos(item, _FSDPRefType.INP)


# the trackers' categories (MemTracker's and FSDPMemTracker's) in the table's columns
CATEGORIES = {"Parameter": "weights", "Buffer": "weights", "Sharded Param": "weights", "Unsharded Param": "weights",
              "All Gather": "weights", "Gradient": "grads", "Sharded Grad": "grads", "Unsharded Grad": "grads",
              "Reduce Scatter": "grads", "Optstate": "optimizer", "OptState": "optimizer",
              "Activation": "activations", "Temp": "activations", "Other": "other", "Inputs": "other"}


def measure(fn, resident=(), fsdp=None) -> Cost:
    """Peak live memory (counting `resident`: modules, optimizers, tensors) and FLOPs while `fn()` runs. `fsdp`:
    (the FSDP2 root module, its optimizer), tracked with FSDPMemTracker. The FLOPs are counted in a second run of
    `fn`, since torch's FLOP counter changes what is allocated: it keeps checkpointed blocks' activations alive (for
    its per-module counts), and it decomposes some ops into others (the VAE's nearest-neighbour upsampling into fp32
    index temporaries: 4.4 GiB more at the peak of a FLUX decode of 8 images at 720^2)."""
    tracker = FSDPTracker(*fsdp) if fsdp else Tracker()
    tracker.track_external(*[r for r in resident if not (fsdp and any(r is f for f in fsdp))])
    with tracker:
        fn()
    with FlopCounterMode(display=False) as flops:
        fn()
    snapshot = tracker.get_tracker_snapshot("peak")
    peak = {"weights": 0, "grads": 0, "optimizer": 0, "activations": 0, "other": 0, "total": 0}
    for device_peak in snapshot.values():
        for kind, size in device_peak.items():
            name = CATEGORIES.get(getattr(kind, "value", kind), "total")
            peak[name] += size
    return Cost(peak, flops.get_total_flops())


def added(cost: Cost, extra: int, category="other") -> Cost:
    peak = dict(cost.peak)
    peak[category] += extra
    peak["total"] += extra
    return Cost(peak, cost.flops)


# ---------------------------------------------------------------------------------------------------------------
# The run's models, built from their configurations
# ---------------------------------------------------------------------------------------------------------------
def _json(folder, name):
    """The keyword arguments in `folder`/`name`, or one error line: missing, not JSON, or a negative count."""
    path = os.path.join(folder, name)
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        fail(f"--configs '{folder}' holds no {name}; pass the folder of the model's configurations (tools/configs/)")
    except (OSError, ValueError) as err:
        fail(f"{path} is not readable JSON ({type(err).__name__}: {str(err).splitlines()[0]}); restore it from "
             f"tools/configs/")
    if not isinstance(config, dict):
        fail(f"{path} holds {type(config).__name__}, not the keyword arguments of a model; restore it")
    negative = [k for k, v in config.items() if isinstance(v, int) and not isinstance(v, bool) and v < 0
                and ("num" in k or "layers" in k or "dim" in k or "size" in k)]
    if negative:
        fail(f"{path}: {negative[0]} {config[negative[0]]} is negative; a count or size is >= 0")
    return config


def _built(folder, name, make):
    """`make(**config)`, the model of the configuration `folder`/`name`, or one error line when it cannot build it."""
    config = _json(folder, name)
    try:
        return make(**config)
    except Exception as err:  # the constructors raise every kind: TypeError, ValueError, AssertionError, ...
        fail(f"{os.path.join(folder, name)} does not build its model ({type(err).__name__}: "
             f"{str(err).splitlines()[0] if str(err) else ''}); restore it from tools/configs/")


def build_pipeline(args, folder: str, dtype, transformer_dtype, fake_mode):
    """The run's diffusers pipeline from the configurations in `folder` (tiny: its own builder). Text encoders and
    VAE in `dtype`, the transformer in `transformer_dtype`; tokenizers from a small vocabulary (what is measured
    does not depend on it: prompts are padded to their fixed length)."""
    from lab import tiny

    if args.model == "tiny":
        with building(dtype, fake_mode):
            pipe = tiny.build_pipeline(seed=0)
        if transformer_dtype != dtype:
            with building(transformer_dtype, fake_mode):
                pipe.transformer = tiny.build_pipeline(seed=0).transformer
        return pipe
    if args.model == "zimage":
        return _build_zimage(args, folder, dtype, transformer_dtype, fake_mode)
    if args.model in ("wan", "wan22"):
        return _build_wan(args, folder, dtype, transformer_dtype, fake_mode)
    if args.model == "flux2":
        return _build_flux2(args, folder, dtype, transformer_dtype, fake_mode)
    if args.model == "qwenimage":
        return _build_qwenimage(args, folder, dtype, transformer_dtype, fake_mode)
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel,
                           SD3Transformer2DModel, StableDiffusion3Pipeline)
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    clip_tokenizer, t5_tokenizer = tiny.build_tokenizers()
    clip_tokenizer.model_max_length, t5_tokenizer.model_max_length = 77, 512
    with building(dtype, fake_mode):
        vae = _built(folder, "vae.json", AutoencoderKL)
        t5 = _built(folder, "text_encoder_2.json" if args.model == "flux" else "text_encoder_3.json",
                    lambda **c: T5EncoderModel(T5Config(**c)))
        if args.model == "flux":
            clip = _built(folder, "text_encoder.json", lambda **c: CLIPTextModel(CLIPTextConfig(**c)))
        else:
            clip_with_projection = lambda **c: CLIPTextModelWithProjection(CLIPTextConfig(**c))
            clips = [_built(folder, f"text_encoder{s}.json", clip_with_projection) for s in ("", "_2")]
    with building(transformer_dtype, fake_mode):
        transformer = _built(folder, "transformer.json",
                             FluxTransformer2DModel if args.model == "flux" else SD3Transformer2DModel)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=args.shift)
    if args.model == "flux":
        return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tokenizer,
                            text_encoder_2=t5, tokenizer_2=t5_tokenizer, transformer=transformer)
    return StableDiffusion3Pipeline(scheduler=scheduler, vae=vae, transformer=transformer,
                                    text_encoder=clips[0], tokenizer=clip_tokenizer, text_encoder_2=clips[1],
                                    tokenizer_2=clip_tokenizer, text_encoder_3=t5, tokenizer_3=t5_tokenizer)


def _build_zimage(args, folder, dtype, transformer_dtype, fake_mode):
    """Z-Image: a Qwen3 text encoder (its last layer but one is the caption), the single-stream transformer, FLUX's
    VAE. The stand-in chat tokenizer makes captions of a few tokens: a real prompt's hundred or so add little
    beside 4,096 image tokens at 1024^2."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    from lab import tiny

    with building(dtype, fake_mode):
        vae = _built(folder, "vae.json", AutoencoderKL)
        text_encoder = _built(folder, "text_encoder.json", lambda **c: Qwen3Model(Qwen3Config(**c)))
    with building(transformer_dtype, fake_mode):
        transformer = _built(folder, "transformer.json", ZImageTransformer2DModel)
    return ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=args.shift), vae=vae,
                          text_encoder=text_encoder, tokenizer=tiny.build_chat_tokenizer(), transformer=transformer)


def _build_flux2(args, folder, dtype, transformer_dtype, fake_mode):
    """FLUX.2 [klein] 4B: Qwen3-4B (three of its layers are the caption), the double- and single-stream
    transformer, FLUX.2's VAE; the distilled model, as the preset. Captions are padded to --max-sequence-length."""
    from diffusers import (AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline,
                           Flux2Transformer2DModel)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from lab import tiny

    with building(dtype, fake_mode):
        vae = _built(folder, "vae.json", AutoencoderKLFlux2)
        text_encoder = _built(folder, "text_encoder.json", lambda **c: Qwen3ForCausalLM(Qwen3Config(**c)))
    with building(transformer_dtype, fake_mode):
        transformer = _built(folder, "transformer.json", Flux2Transformer2DModel)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential")
    return Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                              tokenizer=tiny.build_chat_tokenizer(), transformer=transformer, is_distilled=True)


def _build_qwenimage(args, folder, dtype, transformer_dtype, fake_mode):
    """Qwen-Image: Qwen2.5-VL-7B (its language model's last hidden states are the caption; the vision tower is
    loaded with it), the 20 B MMDiT transformer, its causal VAE. The pipeline keeps each caption's tokens with
    a data-dependent split (`_extract_masked_hidden`), which fake tensors cannot take: the plan keeps every token
    of the padded batch instead, as `NoValues` does for a mask. The stand-in tokenizer makes the plan's prompt a
    caption of about 16 tokens (its template's 34 dropped): a real prompt's hundred or so would add about 1 % to the
    6,889 image tokens of 1328^2, 7 % at --max-sequence-length 512."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from lab import tiny

    with building(dtype, fake_mode):
        vae = _built(folder, "vae.json", AutoencoderKLQwenImage)
        text_encoder = _built(folder, "text_encoder.json",
                              lambda **c: Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**c)))
    with building(transformer_dtype, fake_mode):
        transformer = _built(folder, "transformer.json", QwenImageTransformer2DModel)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                                base_image_seq_len=256, max_image_seq_len=8192,
                                                time_shift_type="exponential")
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                             tokenizer=tiny.build_qwen_tokenizer(), transformer=transformer)
    if fake_mode is not None:
        pipe._extract_masked_hidden = lambda hidden, mask: list(hidden.unbind(0))  # (T, D) per caption
    return pipe


def _build_wan(args, folder, dtype, transformer_dtype, fake_mode):
    """Wan 2.1 and 2.2 TI2V 5B: UMT5-XXL's encoder, the video transformer, the causal video VAE (kept in fp32, as the
    adapter does; 2.2's is the 16x one with 2x2 patches); 2.2's pipeline expands its timesteps per token."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from lab import tiny

    tokenizer = tiny.build_tokenizers()[1]
    tokenizer.model_max_length = 512
    with building(dtype, fake_mode):
        text_encoder = _built(folder, "text_encoder.json", lambda **c: UMT5EncoderModel(UMT5Config(**c)))
    with building(torch.float32, fake_mode):
        vae = _built(folder, "vae.json", AutoencoderKLWan)
    with building(transformer_dtype, fake_mode):
        transformer = _built(folder, "transformer.json", WanTransformer3DModel)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=args.shift),
                       expand_timesteps=args.model == "wan22")


def build_rewards(names, device, dtype, batch_size, fake_mode):
    """The reward functions of rewards.py around models built from configs/rewards (fake weights). Returns the
    functions, their modules, and the names it cannot simulate."""
    import rewards

    folder, fns, modules, skipped = os.path.join(ROOT, "configs", "rewards"), {}, [], []
    for name in names:
        if name in ("shapes", "shapes-strict", "colour-area"):  # the tiny world's, computed from the pixels
            fns[name] = rewards.load_reward(name, device, dtype, batch_size)
        elif name in ("hps", "clip"):
            import open_clip

            with building(dtype, fake_mode):
                model = open_clip.model.CLIP(**_json(folder, REWARD_CONFIGS[name])).eval().requires_grad_(False)
            size = model.visual.image_size
            model.visual.preprocess_cfg = {"size": size if isinstance(size, tuple) else (size, size),
                                           "mean": open_clip.OPENAI_DATASET_MEAN, "std": open_clip.OPENAI_DATASET_STD}
            tokenizer = open_clip.get_tokenizer("ViT-H-14")
            fns[name] = rewards._batched(rewards._open_clip_cosine(model, tokenizer, device, dtype), batch_size)
            modules.append(model)
        elif name in ("pickscore", "aesthetic"):
            from transformers import CLIPConfig, CLIPModel

            with building(dtype, fake_mode):
                model = CLIPModel(CLIPConfig(**_json(folder, REWARD_CONFIGS[name]))).eval().requires_grad_(False)
            fns[name] = rewards._batched(_clip_image_text_score(model, device, dtype, text=name == "pickscore"),
                                         batch_size)
            modules.append(model)
        else:
            skipped.append(name)
    return fns, modules, skipped


def _clip_image_text_score(model, device, dtype, text=True):
    """rewards.py's PickScore computation on a model built here (224 px CLIP features of image and text); without
    `text`, the aesthetic score's path: the image features alone (its MLP head is a few MB)."""
    import rewards
    from transformers import CLIPImageProcessor

    from lab import tiny

    tokenizer, ip = tiny.build_tokenizers()[0], CLIPImageProcessor()
    if text:
        tokenize = lambda prompts: tokenizer(prompts, padding="max_length", truncation=True, max_length=77,
                                             return_tensors="pt")
        return rewards.clip_logit_score(model, tokenize, ip.crop_size["height"], ip.image_mean, ip.image_std,
                                        device, dtype)
    size, mean, std = ip.crop_size["height"], ip.image_mean, ip.image_std
    return lambda images, prompts: rewards._projected(model.get_image_features(
        pixel_values=rewards.preprocess(images.to(device), size, mean, std).to(dtype)))[:, 0]


# ---------------------------------------------------------------------------------------------------------------
# One iteration, phase by phase
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Row:
    phase: str
    cost: Cost  # the peak while it runs; flops of one call
    calls: float  # per iteration (evaluation: per evaluation)
    note: str = ""


def _fake_copy(tensor, fake_mode):
    return fake_mode.from_tensor(tensor) if fake_mode is not None else tensor


def plan(args, fake: bool = True, log=print):
    """The rows of the plan for one rank of `args.gpus`, and notes. With `fake=False` the same phases run on real
    tensors on this CPU (the plan's check: tests/test_plan.py compares the two)."""
    with placed_as_built() if fake else contextlib.nullcontext():
        if not (args.gpus > 1 and args.lora_rank == 0):
            return _plan(args, fake, log)
        # FSDP2 over --gpus ranks: torch's fake process group stands in for the others; this process is rank 0
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=0, world_size=args.gpus, store=FakeStore())
        try:
            return _plan(args, fake, log, mesh=init_device_mesh("cpu", (args.gpus,)))  # built outside fake mode
        finally:
            dist.destroy_process_group()


@contextlib.contextmanager
def placed_as_built():
    """nn.Module.to() leaves a module of fake tensors as it is: the plan builds every module where and in the dtype
    the run puts it, and torch cannot move fake parameters (it swaps them, which their weak references forbid).
    Offloading's moves therefore cost nothing here: an offloaded encoder counts only while it encodes."""
    original = torch.nn.Module.to

    def to(module, *args, **kwargs):
        if any(isinstance(p, FakeTensor) for p in module.parameters()):
            return module
        return original(module, *args, **kwargs)

    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = original


def _plan(args, fake, log, mesh=None):
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    device = torch.device("cpu")
    dtype = torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32
    folder = args.configs or os.path.join(ROOT, CONFIGS.get(args.model, ""))
    started = time.time()
    torch.manual_seed(args.seed)

    # --- the models, as lab.policy's build_policy and load_reward_models make them ---------------------------------
    pipe = build_pipeline(args, folder, dtype, torch.float32 if args.full else dtype, fake_mode)
    pipe.set_progress_bar_config(disable=True)
    adapter = ADAPTERS[args.model](
        pipe, device, dtype, guidance=args.guidance, max_sequence_length=args.max_sequence_length,
        offload_text_encoders=args.offload_text_encoders, attention_backend=args.attention_backend,
        rollout_attention_backend=args.rollout_attention_backend)
    with fake_mode or contextlib.nullcontext():  # LoRA weights and the KL copy as fake tensors too
        policy = make_policy(args, adapter, device, dtype, distributed=mesh is not None, foreach=True,
                                   mesh=mesh)
    fsdp = (policy.transformer, policy.optimizer) if mesh is not None else None
    reward_fns, reward_modules, skipped = build_rewards(list(rewards.parse_rewards(args.rewards)), device,
                                                        dtype, args.reward_batch_size, fake_mode)
    if args.num_frames > 1:  # a video scores the mean over its frames, as rewards.load_reward wraps them for train.py
        reward_fns = {name: rewards.over_frames(fn, args.reward_frames, rewards.REWARDS[name].strict)
                      for name, fn in reward_fns.items()}
    log(f"built the models from {os.path.relpath(folder, ROOT) if args.model != 'tiny' else 'tiny.py'} "
        f"({time.time() - started:.0f} s)")
    # AdamW's state exists from the first step on: create it (zero gradients, one step) so every phase counts it
    with NoValues():
        for p in policy.params:
            p.grad = torch.zeros_like(p)
        policy.optimizer.step()
        policy.optimizer.zero_grad(set_to_none=True)
    encoders = [m for m in adapter.frozen_modules() if m is not pipe.vae]
    on_device = [policy.transformer, pipe.vae, *reward_modules] + ([policy.kl_base] if policy.kl_base else [])
    # the method, started as train.py starts it; its state (an old policy's copy of the trained weights) is resident
    method = flags.method_of(args)
    with fake_mode or contextlib.nullcontext():
        method.start([(name, p) for name, p in policy.transformer.named_parameters() if p.requires_grad])
    state = [t for named in method.state_dict().values() for t in named.values()]
    resident = [*on_device, *([] if args.offload_text_encoders else encoders), policy.optimizer,
                *(policy.ema.shadow if policy.ema else []), *state]

    # --- the shapes of one iteration -----------------------------------------------------------------------------
    world = args.gpus
    B = args.global_batch(world) // world  # prompts per rank
    sigmas = sigma_schedule(args.num_steps, args.shift, args.sigma_grid)
    steps = method.trained_steps(0)
    prompts = ["a photograph of an astronaut riding a horse on the moon"] * B
    generators = prompt_generators(args.seed, 0, range(B))
    values = NoValues(fake_mode) if fake else contextlib.nullcontext()
    with values:  # fake in the plan, real in its CPU check
        noise = method.initial_noise(lambda gens: adapter.noise(gens, args.size), generators)  # (B, ...) or (B, G, ...)
    rows, notes = [], []
    kernels = cuda_attention(args.attention_backend, args.rollout_attention_backend)

    with kernels, values:
        rows.append(Row("resident between phases (weights, optimizer state, EMA)", measure(lambda: None, resident,
                                                                                            fsdp), 0))
        # 0. the prompts' pool (a method's `prompts` that scores the ODE images of P candidates a prompt): before the
        # iteration's own prompts, the candidates are encoded at once, their anchors sampled (no gradients), scored
        pool_nfe = 0
        if method.anchor_candidates:
            pool, pool_nfe = pool_rows(args, method.anchor_candidates, adapter, policy, reward_fns, resident, encoders,
                                       sigmas, B, fake_mode, fsdp)
            rows += pool
            log(f"prompt pool simulated ({time.time() - started:.0f} s)")
        # 1. text encoding: this rank's prompts, and an evaluation micro-batch
        cond = {}
        encode = measure(lambda: cond.update(adapter.encode(prompts)), resident + encoders, fsdp)
        rows.append(Row(f"encode {B} prompt{'s' * (B > 1)}", encode, 1))
        resident_cond = resident + list(cond.values())

        # 2. rollout: its storage on fake tensors, one transformer call at its largest batch on the device
        storage, calls = rollout_storage(method, noise, sigmas, generators, steps, fake_mode,
                                         [*policy.params, *state])
        largest = max(b for b, _ in calls)
        latent_shape = storage["rollout"].final_latents.shape[4:]  # (...) one latent: (B, J, K, G, ...) less B J K G
        latents = torch.zeros(largest, *latent_shape)  # (n, ...) a call's input
        velocity = make_velocity_fn(args, policy, policy.transformer, cond)
        index = torch.arange(largest) % B
        with torch.no_grad():
            call = measure(lambda: velocity(_fake_copy(latents, fake_mode), sigmas[0].expand(largest), index),
                           resident_cond, fsdp)
        per_sample = call.flops / largest  # FLOPs are linear in the batch: every call costs its share
        samples = sum(b for b, _ in calls)  # velocity evaluations; SD3's CFG makes each 2 image-forwards
        nfe = samples * adapter.forwards_per_velocity
        rows.append(Row(f"rollout: {len(calls)} calls, {nfe} NFE (largest call {largest})",
                        Cost(added(call, max(s for _, s in calls)).peak, per_sample * samples / len(calls)),
                        len(calls)))
        log(f"rollout simulated ({time.time() - started:.0f} s)")

        # 3. decode and score: the reward batch; every completion and the anchor are scored this way
        rollout = storage["rollout"]
        rollout_tensors = [rollout.start_latents, rollout.next_latents, rollout.old_log_probs, rollout.final_latents]
        final = rollout.final_latents.flatten(0, 3)  # (M, ...)
        n = min(args.reward_batch_size, final.shape[0])
        batch = final[:n]  # the rollout's own tensors: fake in the plan, real in its CPU check
        reward = measure(lambda: [fn(adapter.decode(batch, args.size), prompts[:1] * n)
                                  for fn in reward_fns.values()], resident_cond + rollout_tensors, fsdp)
        scored = final.shape[0] + (B if rollout.anchor_final is not None else 0)
        rows.append(Row(f"decode + reward, batch {n}", reward, math.ceil(scored / n)))
        log(f"decode and rewards simulated ({time.time() - started:.0f} s)")

        # 4. the update as train.py calls it, method.update, over the first trained step (the others are alike), or
        # the first two where one optimizer step takes several (their gradients accumulate): the second step then
        # runs with the first's gradients held, as every later step of the run does. One inner epoch (each is alike).
        K = len(steps)
        # an update whose optimizer steps grow with its trained steps steps after each (G2RPO's default); every other
        # (G2RPO's --no-step-per-sde-step, the series', the peers' over a chunk of members) accumulates over them
        accumulates = method.optimizer_steps(2) == method.optimizer_steps(1)
        span = min(K, 2 if accumulates else 1)
        first_steps = dataclasses.replace(rollout, start_latents=rollout.start_latents[:, :span],
                                  next_latents=rollout.next_latents[:, :span],
                                  old_log_probs=rollout.old_log_probs[:, :span], anchor_final=None,
                                  sde_steps=rollout.sde_steps[:span])
        # the method's update at its most work (`for_planning`: a random share of steps counted whole, an upper
        # bound), one inner epoch
        one_epoch = dataclasses.replace(method.for_planning(), inner_epochs=1)
        advantages = torch.zeros(B, span, args.group_size)  # (B, K', G): values do not change the cost
        # (ranks: None, where train.py passes torchrun's; it changes no cost)
        ctx = UpdateContext(make_velocity_fn(args, policy, policy.model, cond), policy.params, policy.optimizer,
                            sigmas, generators, base_velocity_fn(args, policy, cond))

        def update():
            one_epoch.update(first_steps, advantages, ctx)
            if policy.ema is not None:
                policy.ema.update(0)

        measured = measure(update, resident_cond + rollout_tensors, fsdp)
        update_cost = Cost(measured.peak, measured.flops / max(span, 1))  # one trained step's
        starts = rollout.start_latents.shape[2] * B  # start latents per trained step: B (G2RPO) or B * G
        chunks = math.ceil(starts / args.max_batch)
        # forwards per start latent and trained step (the method's `update_nfe`, its own extra ones included)
        forwards = one_epoch.update_nfe(rollout) // max(starts * K, 1)
        epochs = f" x {args.inner_epochs} inner epochs" if args.inner_epochs > 1 else ""
        label = [f"update: {K} steps{epochs} x {chunks} chunk{'s' * (chunks > 1)} of {min(starts, args.max_batch)}"]
        if forwards > 1:
            label.append(f"{forwards} forwards each")
        if accumulates:
            label.append("gradients accumulate across steps")
        label.append(f"fwd + bwd{' (checkpointed)' * args.gradient_checkpointing}")
        rows.append(Row(", ".join(label), update_cost, K * args.inner_epochs))
        log(f"update simulated ({time.time() - started:.0f} s)")

        # 5. evaluation, one micro-batch of lab.loop.held_out_eval: encode, sample, decode + score
        items = eval_items(args_eval_prompt_count(args), args.eval_prompts, args.eval_seeds)
        per_rank = -(-len(items) // world)
        eval_batch = min(args.max_batch, per_rank)
        eval_cond = {}
        eval_encode = measure(lambda: eval_cond.update(adapter.encode(prompts[:1] * eval_batch)), resident + encoders,
                              fsdp)
        if eval_batch == largest:
            eval_call = call
        else:
            eval_velocity = make_velocity_fn(args, policy, policy.transformer, eval_cond)
            eval_latents = torch.zeros(eval_batch, *latents.shape[1:])  # (n, ...) one image each
            with torch.no_grad():
                eval_call = measure(lambda: eval_velocity(_fake_copy(eval_latents, fake_mode),
                                                          sigmas[0].expand(eval_batch), torch.arange(eval_batch)),
                                    resident + list(eval_cond.values()), fsdp)
        eval_peak = max((eval_encode, eval_call, reward), key=lambda c: c.peak["total"])
        eval_flops = eval_encode.flops + eval_call.flops * args.num_steps + reward.flops * eval_batch / n
        evaluations = len({0, args.num_iterations, *range(args.eval_every, args.num_iterations, args.eval_every)})
        rows.append(Row(f"evaluation: {per_rank} images, micro-batches of {eval_batch} (per evaluation)",
                        Cost(eval_peak.peak, eval_flops), math.ceil(per_rank / eval_batch),
                        note=f"{evaluations} evaluations per run"))
        log(f"evaluation simulated ({time.time() - started:.0f} s)")

    if args.rollout_precision == "fp8":
        rows, note = with_fp8_copy(rows, policy.transformer, args.full)
        notes.append(note)
    lora_grads = (sum(p.numel() * 4 for p in policy.params) if args.lora_rank and world > 1 else 0)
    notes.append(checkpoint_cost(args, policy, world))
    notes.append(preemption_cost(args, rows, policy, method.optimizer_steps(len(steps))))
    eval_nfe = evaluations * len(items) * args.num_steps * adapter.forwards_per_velocity
    rollout_nfe = args.num_iterations * (nfe + pool_nfe) * world
    notes.append(f"evaluation: {evaluations} x {len(items)} held-out images x {args.num_steps} steps = "
                 f"{eval_nfe:,} forwards over the run, {100 * eval_nfe / rollout_nfe:.1f} % of the rollouts' "
                 f"{rollout_nfe:,}" + (" (the prompt pools' included)" if pool_nfe else ""))
    notes.append("not simulated, add them: the CUDA context, allocator fragmentation and NCCL / cuBLAS workspaces "
                 "(a few GiB), torch.compile, the kernels' distance from the FLOP floor"
                 + (f"; DDP's bucket copy of the LoRA gradients ({lora_grads / GiB:.2f} GiB)" if lora_grads else ""))
    if skipped:
        notes.append(f"not simulated (their models live outside this process's device code): {', '.join(skipped)}")
    return rows, notes, evaluations


def with_fp8_copy(rows, transformer, full: bool):
    """--rollout-precision fp8: the copy's tensors (kernels.Float8Copy), resident from the start, added to every
    phase as weights: one byte a quantized weight, its fp32 per-row scales, and a full fine-tune's bf16 biases. Its
    forwards' activations are counted as the bf16 call's (the FP8 activations are smaller, their scales negligible).
    The plan counts the bytes whatever the run's precision; train.py refuses FP8 in an fp32 run. Returns (rows, the
    note that says so)."""
    from lab.kernels import fp8_layers

    layers = [linear for _, linear in fp8_layers(transformer)]
    extra = sum(linear.weight.numel() + 4 * linear.out_features
                + (2 * linear.out_features if full and linear.bias is not None else 0) for linear in layers)
    rows = [Row(row.phase, added(row.cost, extra, "weights"), row.calls, row.note) for row in rows]
    return rows, (f"FP8 rollout copy: {len(layers)} linear layers, {extra / GiB:.2f} GiB, in every phase's weights "
                  f"(its forwards' activations counted as the bf16 call's)")


def checkpoint_bytes(policy):
    """(bytes one rank writes, its largest tensor, its share of the trained weights): the trained weights, AdamW's two
    moments and the EMA, all fp32."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in policy.params]
    per_copy = sum(p.numel() * 4 for p in local)  # this rank's fp32 share of the trained weights
    copies = 3 + (policy.ema is not None)  # weights, exp_avg, exp_avg_sq (+ EMA)
    return per_copy * copies, max(p.numel() * 4 for p in local), per_copy


def checkpoint_cost(args, policy, world) -> str:
    """What one checkpoint writes. A sharded full fine-tune (FSDP2) writes it with torch.distributed.checkpoint, each
    rank its own shards, in parallel, staging one tensor at a time; LoRA and one process write the whole from rank
    0, gathered in its host memory."""
    written, largest, per_copy = checkpoint_bytes(policy)
    seconds = written / (args.disk_gb_per_s * 1e9)
    if args.lora_rank == 0 and world > 1:
        return (f"checkpoint: {world} ranks write {written / 1e9:.1f} GB each ({world * written / 1e9:.0f} GB in all) "
                f"in parallel, {seconds:.0f} s at {args.disk_gb_per_s:g} GB/s per rank; host memory per rank: one "
                f"tensor at a time (at most {largest / 2**20:.0f} MiB); resume reads the same; the last checkpoint "
                f"also exports transformer/ ({per_copy * world / 1e9:.1f} GB, read {EXPORT_GB:.1f} GB at a time)")
    return (f"checkpoint: rank 0 writes {written / 1e9:.2f} GB ({seconds:.0f} s at {args.disk_gb_per_s:g} GB/s), "
            f"gathered in its host memory; every rank reads it on resume")


def preemption_cost(args, rows, policy, optimizer_steps: int) -> str:
    """How long a SIGTERM's stop takes (run.Run.check_stop): the transformer call (the rollout's, or the prompt
    pool's) or the reward batch in flight; in the update, under torchrun (--gpus > 1) the optimizer step in flight
    (Run.stop_between_steps: `optimizer_steps`, the method's count, divide the update), in one process the whole
    update, which runs to its end (its --inner-epochs counted); then one checkpoint's write. Nothing is staged in host
    memory for it, and no disk is used for it between preemptions."""
    floor = lambda row, calls: row.cost.flops * calls / (args.peak_tflops * 1e12)
    longest = lambda *names: max(floor(r, 1) for r in rows if r.phase.startswith(names))
    update = next(r for r in rows if r.phase.startswith("update"))
    call = longest("rollout", "prompt pool: ODE anchors")
    batch = longest("decode", "prompt pool: decode")
    whole_update = floor(update, update.calls)
    cut = args.gpus > 1
    in_update = whole_update / max(optimizer_steps, 1) if cut else whole_update
    worst = max(call, batch, in_update)
    write = checkpoint_bytes(policy)[0] / (args.disk_gb_per_s * 1e9)
    verdict = "within" if worst + write <= args.grace_s else "beyond"
    where = (f"at the next optimizer step of the update ({in_update:.1f} s, one of {optimizer_steps})" if cut else
             f"at worst after the update ({whole_update:.1f} s)")
    pool = any(r.phase.startswith("prompt pool") for r in rows)
    return (f"preemption: a SIGTERM stops at the next rollout{' or prompt pool' * pool} call ({call:.1f} s at "
            f"the time floor) or reward batch "
            f"({batch:.1f} s), or {where}, then writes one checkpoint ({write:.0f} s): {worst + write:.0f} s at "
            f"worst, {verdict} a grace of {args.grace_s:g} s (--grace-s; real kernels run slower than the floor); no "
            f"host memory or disk is used for it until then")


def args_eval_prompt_count(args):
    """Held-out prompts in --eval-prompt-file (HPDv2's test set has 400 when the file is not written yet)."""
    if os.path.isfile(args.eval_prompt_file):
        with open(args.eval_prompt_file, encoding="utf-8") as f:
            return sum(1 for line in f if line.strip())
    return 400


def rollout_storage(method, noise, sigmas, generators, steps, fake_mode=None, resident=()):
    """Run the method's rollout with a velocity of zeros from `noise` made fake under `fake_mode` (else for real on
    the CPU): the rollout keeps what it keeps in a real run (anchor, branches, completions), at the real latent
    shape, and every tensor that follows from the noise is fake too, so its storage costs no host memory (the sigma
    schedule stays real: the sampler reads its values). `resident`: the tensors held before it (the trained weights,
    a method's copy of them, which a rollout from an old policy swaps in place). Returns {"rollout": the Rollout}
    and, per transformer call, (batch, bytes the rollout holds at that call)."""
    rollout, calls = sampled_storage(lambda velocity_fn, x: method.rollout(velocity_fn, x, sigmas, generators, steps),
                                     noise, fake_mode, resident)
    return {"rollout": rollout}, calls


@torch.no_grad()
def sampled_storage(sample, noise, fake_mode=None, resident=()):
    """`sample(velocity_fn, noise)` (a rollout, a prompt pool's ODE anchors) with a velocity of zeros, from
    `noise` made fake under `fake_mode`. Returns what it returns and, per transformer call, (batch, bytes held
    beyond the `resident` tensors, which it may touch but does not hold anew)."""
    tracker, calls = Tracker(), []
    # counted in the resident row; a DTensor's storage is the whole tensor's, the tracker counts this rank's shard
    already = sum((t.to_local() if hasattr(t, "to_local") else t).untyped_storage().nbytes() for t in resident)

    def zero_velocity(x, sigma, prompt_index):
        held = sum(device["Total"] for device in tracker.get_tracker_snapshot().values()) - already
        calls.append((x.shape[0], held))
        return torch.zeros_like(x, dtype=torch.float32)

    noise = _fake_copy(noise, fake_mode)
    tracker.track_external(noise, *resident)
    with tracker:
        result = sample(zero_velocity, noise)
    return result, calls


def pool_rows(args, P, adapter, policy, reward_fns, resident, encoders, sigmas, B, fake_mode, fsdp):
    """The rows of a prompt pool of P candidates a prompt as lab.loop.Harness.ode_images serves a method's
    `prompts` (its choice of prompts): the B P candidates encoded in one call, their anchors sampled by
    `sampler.ode_sample` (N steps in calls of at most --max-batch, no gradients) and scored in reward batches; the
    pool's conditioning, noise and anchors are held throughout. The iteration's own tensors do not exist yet (the
    pool chooses its prompts). Returns the rows and the pool's NFE (train.py counts it in perf/nfe)."""
    candidates = ["a photograph of an astronaut riding a horse on the moon"] * (B * P)
    pool_cond = {}
    encode = measure(lambda: pool_cond.update(adapter.encode(candidates)), resident + encoders, fsdp)
    noise = adapter.noise(prompt_generators(args.seed, 0, range(B * P)), args.size)  # (B * P, ...)
    anchors, calls = sampled_storage(lambda velocity_fn, x: ode_sample(velocity_fn, x, sigmas,
                                                                      max_batch=args.max_batch), noise, fake_mode)
    largest = max(b for b, _ in calls)
    velocity = make_velocity_fn(args, policy, policy.transformer, pool_cond)
    latents = torch.zeros(largest, *noise.shape[1:])  # (n, ...) a call's input
    held = resident + list(pool_cond.values())
    with torch.no_grad():
        call = measure(lambda: velocity(_fake_copy(latents, fake_mode), sigmas[0].expand(largest),
                                        torch.arange(largest)), held, fsdp)
    samples = sum(b for b, _ in calls)
    nfe = samples * adapter.forwards_per_velocity  # the method's Batch.nfe: B P N
    n = min(args.reward_batch_size, anchors.shape[0])
    batch = anchors[:n]
    reward = measure(lambda: [fn(adapter.decode(batch, args.size), candidates[:n]) for fn in reward_fns.values()],
                     held + [noise, anchors], fsdp)
    return [Row(f"prompt pool: encode {B * P} candidates ({P} a prompt)", encode, 1),
            Row(f"prompt pool: ODE anchors, {len(calls)} calls, {nfe} NFE (largest call {largest})",
                Cost(added(call, max(s for _, s in calls)).peak, call.flops / largest * samples / len(calls)),
                len(calls)),
            Row(f"prompt pool: decode + reward, batch {n}", reward, math.ceil(anchors.shape[0] / n))], nfe



# ---------------------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------------------
def report(args, rows, notes, evaluations) -> str:
    """One markdown table, the notes, and the closing line."""
    iteration_flops = sum(r.cost.flops * r.calls for r in rows[:-1]) + rows[-1].cost.flops * rows[-1].calls * (
        evaluations / args.num_iterations)
    mode = ("LoRA rank %d" % args.lora_rank if args.lora_rank else "full fine-tune") + (
        ", FSDP2 over %d GPUs" % args.gpus if args.gpus > 1 and not args.lora_rank else
        ", DDP over %d GPUs" % args.gpus if args.gpus > 1 else ", 1 GPU")
    lines = [f"plan: --model {args.model}, {mode}, {args.size[0]}x{args.size[1]}, G {args.group_size}, "
             f"N {args.num_steps}, {args.mixed_precision}, per rank; simulated on fake tensors, not measured on "
             f"hardware", "",
             "| phase | peak GiB | weights | grads | optimizer | activations | other | TFLOP per call | calls | "
             "time floor s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        p = {k: v / GiB for k, v in row.cost.peak.items()}
        floor = row.cost.flops * row.calls / (args.peak_tflops * 1e12)
        lines.append(f"| {row.phase} | {p['total']:.2f} | {p['weights']:.2f} | {p['grads']:.2f} | "
                     f"{p['optimizer']:.2f} | {p['activations']:.2f} | {p['other']:.2f} | "
                     f"{row.cost.flops / 1e12:.2f} | {row.calls:g}{' (' + row.note + ')' if row.note else ''} | "
                     f"{floor:.2f} |")
    floor_s = iteration_flops / (args.peak_tflops * 1e12)
    lines += ["", f"one iteration: {iteration_flops / 1e12:,.0f} TFLOP per rank (evaluation amortised), time floor "
                  f"{floor_s:.1f} s at {args.peak_tflops:g} TFLOP/s; "
                  f"{args.num_iterations} iterations: {args.num_iterations * floor_s / 3600:.1f} h"]
    lines += notes
    worst = max(rows, key=lambda r: r.cost.peak["total"])
    need = worst.cost.peak["total"] / GiB
    lines.append(f"fits in {args.gpu_memory_gib:g} GiB: yes (largest phase: {worst.phase.split(':')[0]}, "
                 f"{need:.1f} GiB)" if need <= args.gpu_memory_gib else
                 f"no: phase {worst.phase.split(':')[0]} needs {need:.1f} GiB")
    return "\n".join(lines)


def main(argv=None):
    import warnings

    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    args = flags.parse_args(argv, PlanArgs)
    diffusers_logging.set_verbosity_error()  # prompt truncation notes of the stand-in tokenizers
    transformers_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # diffusers' blocks return views, as in training
    if args.gpus < 1:
        fail(f"--gpus {args.gpus}: must be >= 1")
    if not all(math.isfinite(v) and v > 0 for v in (args.gpu_memory_gib, args.peak_tflops, args.disk_gb_per_s,
                                                     args.grace_s)):
        fail("--gpu-memory-gib, --peak-tflops, --disk-gb-per-s and --grace-s must be finite numbers > 0")
    flags.check_flags(args, args.gpus, log=print)
    sharded = fp8_sharding_problem(args.gpus, args.full) if args.rollout_precision == "fp8" else None
    if sharded:  # as train.py refuses it
        fail(sharded)
    if args.model not in (*CONFIGS, "tiny"):
        fail(f"plan.py builds {', '.join(CONFIGS)} and tiny so far; --model {args.model} is not planned yet")
    folder = args.configs or os.path.join(ROOT, CONFIGS.get(args.model, ""))
    if args.model != "tiny" and not os.path.isfile(os.path.join(folder, "transformer.json")):
        fail(f"--configs '{folder}' holds no transformer.json; pass the folder of the model's configurations")
    rows, notes, evaluations = plan(args, log=lambda m: print(m, file=sys.stderr))
    print(report(args, rows, notes, evaluations))


if __name__ == "__main__":
    main()
