"""How a transformer call runs on an accelerator, kept apart from what the call computes (models.py).

A training run calls its transformer in two phases: the no-grad rollout and evaluation, and the update with
gradients. `Kernels` is the context of every call: autocast to the compute dtype, the SDPA attention kernels of the
phase (chosen apart, because a fast kernel can be right in one phase and wrong in the other), gradient
checkpointing whose recompute keeps the forward's kernels, and optional regional compilation. The gradient
self-check (`check_gradient`) compares the update's gradient with the math kernel's, once, at a run's first update:
a wrong kernel would otherwise skip or corrupt every step of a long GPU run. A method's `check_loss`
(methods/base.py) is the loss it checks.

`Float8Copy` is the transformer's FP8 twin for the rollout's forwards that only make images (--rollout-precision
fp8): torchao's dynamic float8 quantization with per-row scales on the blocks' linear layers, compiled.

Deviation 11 of the README's list: on CUDA the update never uses cuDNN attention, and the first update's gradient is
checked against the math kernel's.
"""
import contextlib
import copy
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

ATTENTION_BACKENDS = ("auto", "flash", "efficient", "math", "cudnn")


# --- attention kernels ------------------------------------------------------------------------------------------
# diffusers' FLUX and SD3 attention calls torch's F.scaled_dot_product_attention (SDPA), so torch's `sdpa_kernel`
# context picks the kernel: flash, memory-efficient, math (the plain softmax(QK^T / sqrt(d)) V, the exact one) or
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
    The no-grad rollout's "auto" is the same set, although cuDNN's forward may be the fastest (tools/gpu_check.py
    measures it as `rollout_attention_backend="cudnn"`): its forward has not been verified on that chip either, and a
    rollout kernel other than the update's moves the first update step's ratio away from 1.
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


def compile_blocks(transformer, backend: str = "inductor", mode: str | None = None):
    """Regional compilation: torch.compile each repeated block (FLUX's double- and single-stream blocks, SD3's
    joint blocks), not the whole model. The blocks of a kind share one compiled graph, so compiling takes seconds to
    a minute instead of many, for nearly the speed of compiling the whole model. Graphs are built at the first call
    of each grad mode and shape. `backend` "aot_eager" traces the same graphs without generating kernels, and
    "eager" only captures them: quick checks on a CPU, where inductor spends minutes on even the tiny model.

    Each block's graph is rebuilt for every grad mode, batch size, input layout and resolution it meets (rollout,
    update, evaluation): 8 versions in 2 iterations of the tiny model, which is torch's default limit per block, past
    which it silently runs the block eager. On an H200 a FLUX-sized block that had met two resolutions ran at eager
    speed (353 against 506 TFLOP/s), so the limit is raised to 64; an FP8 copy's blocks (`Float8Copy`) are of the
    same classes and count toward the same limit. `mode`: torch.compile's (tools/gpu_check.py measures
    "max-autotune", which adds CUDA graphs)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for block in repeated_blocks(transformer):
        block.compile(backend=backend, **({"mode": mode} if mode else {}))


class Kernels:
    """The context of one transformer's calls on `device` in `dtype`.

    attention_backend:          SDPA kernels of the update's forward and backward (one of ATTENTION_BACKENDS)
    rollout_attention_backend:  SDPA kernels of the no-grad forwards (rollout, evaluation)
    compile:                    regional compilation of the transformer's repeated blocks at the first call:
                                False, True (inductor) or a torch.compile backend name (see `compile_blocks`)
    """

    def __init__(self, transformer, device, dtype, attention_backend="auto", rollout_attention_backend="auto",
                 compile=False):
        self.transformer, self.device, self.dtype = transformer, torch.device(device), dtype
        self.attention_backend = validate_attention_backend(attention_backend)
        self.rollout_attention_backend = validate_attention_backend(rollout_attention_backend)
        self.compile, self._compiled = compile, False
        self._exact = False  # inside `exact_mode`: the math kernel in every phase, eager
        self._exact_fp32 = False  # and autocast off (fp32 weights only)
        cuda_only = sorted({attention_backend, rollout_attention_backend} & {"efficient", "cudnn"})
        if cuda_only and self.device.type != "cuda" and int(os.environ.get("RANK", 0)) == 0:  # said once
            print(f"note: attention backend {' and '.join(cuda_only)} needs CUDA; on {self.device.type} the attention "
                  f"runs on torch's own choice of kernel (flash-on-CPU or math)")

    def autocast(self):
        fp32 = self.dtype == torch.float32 or self._exact_fp32
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=not fp32)

    def __call__(self):
        """The context of one call: autocast to the compute dtype, and the SDPA kernels of the phase, the update's
        when gradients are on (forward and backward), the rollout's otherwise."""
        self._prepare()
        if self._exact:
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
        """The text features as the transformer takes them: as encoded, or fp32 in the fp32 exact mode, where no
        autocast casts the (bf16) encoders' output for the fp32 layers."""
        return tuple(t.float() for t in tensors) if self._exact_fp32 else tensors

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
        """`check_gradient` against the exact kernels: the math kernel at the run's precision, and in fp32
        too where the run computes in bf16 on fp32 weights."""
        fp32 = self.dtype != torch.float32 and self.fp32_weights()
        return check_gradient(loss_fn, params, lambda: self.exact_mode(fp32=False),
                              (lambda: self.exact_mode(fp32=True)) if fp32 else None, **tolerances)

    @contextlib.contextmanager
    def exact_mode(self, fp32: bool = True):
        """What `check_gradient` compares the run against: the math SDPA kernel in every phase, eager (no compiled
        blocks), and, with `fp32` and fp32 weights, autocast off. Where the weights are bf16 (a LoRA's frozen base) or
        FSDP2 casts them, exact mode keeps the run's precision and differs from it in the attention kernel alone."""
        saved = self._exact, self._exact_fp32
        self._exact, self._exact_fp32 = True, fp32 and self.fp32_weights()
        try:
            with torch.compiler.set_stance("force_eager"):
                yield
        finally:
            self._exact, self._exact_fp32 = saved


# --- FP8 rollouts ---------------------------------------------------------------------------------------------
ROLLOUT_PRECISIONS = ("bf16", "fp8")
TORCHAO_HINT = "pip install -r requirements-fp8.txt (torchao 0.18.0)"
MODULATION = ("norm", "mod")  # names of the blocks' modulation layers (AdaLN's linear, Qwen's img_mod, Z-Image's adaLN)


def fp8_problem(world: int, full: bool, mixed_precision: str) -> str | None:
    """Why this machine or run cannot take --rollout-precision fp8, in one line, or None. Checked before loading."""
    if not torch.cuda.is_available():
        return ("--rollout-precision fp8 needs a CUDA GPU with FP8 matrix multiplies (Ada, Hopper or newer); this "
                "machine has none: drop the flag (bf16 is the default)")
    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        return (f"--rollout-precision fp8 needs FP8 matrix multiplies (compute capability 8.9 or above: Ada, Hopper "
                f"or newer); {torch.cuda.get_device_name()} is {capability[0]}.{capability[1]}: drop the flag")
    if mixed_precision != "bf16":
        return ("--rollout-precision fp8 quantizes bf16 weights for a bf16 run, and this one computes in fp32 "
                "(--mixed-precision no, which the tiny preset sets): add --mixed-precision bf16, or drop the flag")
    sharded = fp8_sharding_problem(world, full)
    if sharded:
        return sharded
    try:
        import torchao.quantization  # noqa: F401
    except ImportError:
        return f"--rollout-precision fp8 needs torchao, which is not installed: {TORCHAO_HINT}"
    return None


def fp8_sharding_problem(world: int, full: bool) -> str | None:
    """The one refusal of --rollout-precision fp8 that follows from the flags alone (tools/plan.py makes it too):
    a full fine-tune on many ranks, whose weights FSDP2 shards."""
    if world > 1 and full:
        return (f"--rollout-precision fp8 does not support a full fine-tune on {world} ranks yet (FSDP2 shards the "
                f"weights the FP8 copy would quantize); use one GPU, or LoRA (--lora-rank) on many")
    return None


def _twin(module):
    """A copy of a module tree that holds the same parameter and buffer tensors (no memory): replacing a parameter
    of the twin, adding a hook to it or switching its LoRA adapters leaves the original as it was (every dict, list
    and set of a module is the twin's own). What stays shared: the tensors, and so their requires_grad (peft's
    disable_adapters on the twin turns the trained adapters' off until enable_adapters). Compiled calls are not
    carried over (they are bound to the original)."""
    twin = copy.copy(module)
    for name, value in vars(module).items():  # _parameters, _buffers, the hook dicts, peft's adapter lists, ...
        if isinstance(value, (dict, list, set)):
            twin.__dict__[name] = copy.copy(value)
    twin.__dict__["_modules"] = {name: None if child is None else _twin(child)
                                 for name, child in module._modules.items()}
    twin.__dict__["_compiled_call_impl"] = None
    return twin


def repeated_blocks(transformer):
    """The transformer's repeated blocks (diffusers' `_repeated_blocks` classes, else its `transformer_blocks`):
    where nearly all of its FLOPs are, and what regional compilation compiles."""
    names = set(getattr(transformer, "_repeated_blocks", None) or [])
    if names:
        return [m for m in transformer.modules() if type(m).__name__ in names]
    return list(transformer.transformer_blocks)


def fp8_layers(transformer) -> list:
    """(name, linear layer) of what an FP8 copy quantizes: the linear layers of the repeated blocks, but the LoRA
    adapters' and the modulation's, with sides that are multiples of 16 (FP8 matrix multiplies need them)."""
    blocks = {id(b) for b in repeated_blocks(transformer)}
    return [(f"{block_name}.{path}", linear) for block_name, block in transformer.named_modules() if id(block) in blocks
            for path, linear in block.named_modules()
            if isinstance(linear, torch.nn.Linear) and "lora_" not in path
            and not any(word in path for word in MODULATION)
            and linear.in_features % 16 == 0 and linear.out_features % 16 == 0]


class Float8Copy:
    """The transformer's FP8 twin for the forwards whose velocity no log-probability reads (sampler.py's
    `image_only_fn`). The linear layers of its repeated blocks (attention and feed-forward; not the modulation,
    which maps one vector a sample and scales every activation of the block) take torchao's float8 dynamic
    activation and weight quantization with per-row scales, from bf16; everything else (embeddings, norms, the
    LoRA adapters) is the transformer's own tensors, shared, not copied. Its blocks are compiled (FP8 without
    compiling is slower than bf16: the quantization of the activations is then a separate pass).

    LoRA: the frozen base is quantized once and the adapters stay in their precision, shared with the trained
    ones, so the twin follows every optimizer step at no cost. Full fine-tune: `refresh` re-quantizes every linear
    layer from the current weights, after each update (its seconds: `refreshed_s`).
    `quantize`: the function that quantizes one linear layer in place (default torchao's; `round_to_fp8_rows` on a
    CPU). `names`: the quantized layers (`fp8_layers`).
    """

    def __init__(self, transformer, compile="inductor", quantize=None):
        self.module = _twin(transformer)
        self.quantize = quantize or _torchao_float8()
        chosen = fp8_layers(self.module)  # the twin's layers, in the order of the transformer's own
        self.pairs = list(zip((twin for _, twin in chosen), (source for _, source in fp8_layers(transformer))))
        self.names = [name for name, _ in chosen]
        self.refreshed_s = 0.0
        self.refresh()
        if compile:
            compile_blocks(self.module, compile)

    @torch.no_grad()
    def refresh(self):
        """Quantize each chosen linear layer's current weight into the twin, from bf16 (a full fine-tune's fp32
        master weights cast as autocast casts them; its bias too)."""
        start = time.perf_counter()
        for twin, source in self.pairs:
            twin.__dict__.pop("extra_repr", None)  # torchao wraps it at every quantization
            twin.weight = torch.nn.Parameter(source.weight.detach().to(torch.bfloat16), requires_grad=False)
            if source.bias is not None and source.bias.dtype != torch.bfloat16:
                twin.bias = torch.nn.Parameter(source.bias.detach().to(torch.bfloat16), requires_grad=False)
            self.quantize(twin)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.refreshed_s = time.perf_counter() - start


def round_to_fp8_rows(linear):
    """The CPU stand-in for `_torchao_float8` (FP8 matrix multiplies need a GPU): each weight row scaled to e4m3's
    largest value, 448, rounded to float8 and scaled back, in place, in fp32 (the CPU's compute dtype). It makes the
    weight error of per-row FP8, not its activation rounding, and none of its speed; the tests and
    `gpu_check.py --config small` route through it."""
    w = linear.weight.detach().float()
    scale = w.abs().amax(1, keepdim=True).clamp_min(1e-12) / 448  # (out, 1)
    linear.weight = torch.nn.Parameter((w / scale).to(torch.float8_e4m3fn).float() * scale, requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.detach().float(), requires_grad=False)


def _bf16_inputs(module, args):
    return tuple(a.to(torch.bfloat16) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _torchao_float8():
    """torchao's float8 dynamic activation and weight quantization with per-row scales, of one linear layer in
    place. Its linear takes over before autocast would cast the input (its output takes the input's dtype), so the
    layer casts its input to bf16 itself, as autocast does. torchao's recommended inductor settings are not applied:
    they are global, and would change how the update's compiled blocks are built too."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)

    def quantize(linear):
        quantize_(linear, config)
        if not linear._forward_pre_hooks:
            linear.register_forward_pre_hook(_bf16_inputs)
    return quantize


# --- the gradient self-check -------------------------------------------------------------------------------------
@dataclass
class GradientCheck:
    """The run's gradient g against the exact one g_ex: the math SDPA kernel at the run's precision, eager."""

    cosine: float  # <g, g_ex> / (|g| |g_ex|)
    relative_error: float  # |g - g_ex| / |g_ex|
    norm: float  # |g|
    exact_norm: float  # |g_ex|
    fp32_cosine: float  # cosine of g against the math kernel in fp32; nan where not computed
    ok: bool
    message: str  # one line: the figures, and when not ok the cause and the fix (the caller says passed / failed)


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


def _compare(grads, exact, sharded):
    """(cosine, relative error, |g|, |g_ex|), summed over ranks where the gradients are FSDP2 shards (DDP's are
    already the same on every rank)."""
    sums = torch.stack([sum((g.double() * r.double()).sum() for g, r in zip(grads, exact)),
                        sum(g.double().square().sum() for g in grads),
                        sum(r.double().square().sum() for r in exact),
                        sum((g.double() - r.double()).square().sum() for g, r in zip(grads, exact))])
    if sharded:
        dist.all_reduce(sums)
    dot, norm2, exact2, diff2 = sums.tolist()
    cosine = dot / math.sqrt(norm2 * exact2) if norm2 > 0 and exact2 > 0 else float("nan")
    return cosine, math.sqrt(diff2 / exact2) if exact2 > 0 else float("nan"), math.sqrt(norm2), math.sqrt(exact2)


def check_gradient(loss_fn, params, exact, exact_fp32=None, *, min_cosine: float = 0.99,
                   max_relative_error: float = 0.1, min_fp32_cosine: float = 0.8,
                   max_numel: int = 2**28) -> GradientCheck:
    """Whether the run computes the right gradient: `loss_fn`'s gradient under the run's kernels and precision
    against the same gradient under `exact`, and (if given) under `exact_fp32`.

    loss_fn:         () -> a scalar loss through the run's own code path (the update's loss on one rollout sample);
                     it must draw no random numbers, as it is called two or three times.
    exact:           () -> context manager: the math SDPA kernel at the run's precision, eager
                     (`Kernels.exact_mode(fp32=False)`). This is the gate: only the kernel differs, so the
                     gradients agree to rounding (measured on CPU in bf16: cosine 0.99999, relative error 4e-3).
    exact_fp32:      () -> the math kernel in fp32 (`Kernels.exact_mode()`), where the weights allow it.
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
    with exact():
        exact_grads = _gradients(loss_fn, chosen)
    cosine, relative_error, norm, exact_norm = _compare(grads, exact_grads, sharded)
    fp32_cosine, fp32_norm = float("nan"), float("nan")
    if exact_fp32 is not None:
        with exact_fp32():
            fp32_cosine, _, _, fp32_norm = _compare(grads, _gradients(loss_fn, chosen), sharded)
    kernel_ok = math.isfinite(norm) and cosine >= min_cosine and relative_error <= max_relative_error
    fp32_ok = exact_fp32 is None or fp32_cosine >= min_fp32_cosine
    figures = (f"cosine {cosine:.5f}, relative error {relative_error:.3g}, |g| {norm:.4g} against the math attention "
               f"kernel's {exact_norm:.4g}" + (f", cosine {fp32_cosine:.3f} against fp32" if exact_fp32 else "")
               + f", over {total:,} gradient elements")
    if kernel_ok and fp32_ok:
        return GradientCheck(cosine, relative_error, norm, exact_norm, fp32_cosine, True, figures)
    if not (math.isfinite(exact_norm) and exact_norm > 0):
        cause, fix = (("bf16 precision (the math kernel in bf16 is not finite, in fp32 it is)", "--mixed-precision no")
                      if math.isfinite(fp32_norm) and fp32_norm > 0 else
                      ("the loss or its inputs (the exact gradient is zero or not finite too)",
                       "check the first iteration's rewards and advantages"))
    elif not kernel_ok:
        cause, fix = "the attention kernel (the math kernel gives another gradient)", "--attention-backend math"
    else:
        cause, fix = "bf16 precision (the gradient is far from fp32's)", "--mixed-precision no"
    return GradientCheck(cosine, relative_error, norm, exact_norm, fp32_cosine, False,
                         f"{figures}; cause: {cause}; fix: {fix}")


