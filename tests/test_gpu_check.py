"""The GPU-correctness levers on CPU: the attention-kernel choice per phase, the gradient self-check (passing on a
right gradient, failing on a simulated broken kernel), the recompute of gradient checkpointing under the forward's
kernels, regional compilation, LoRA setup, and gpu_check.py's small config end to end.

The broken kernel is a real fault inside the model, not a mock: an attention processor whose backward sends the
gradient to the wrong features whenever a kernel other than math may run, as cuDNN attention's backward did on an
H200, and is right when the math kernel is forced (the reference's path).

Run: python -m pytest -q tests/test_gpu_check.py
"""
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from torch.nn.attention import SDPBackend

from lab import kernels
from lab import models
from lab import tiny
from sampler import sde_step, sigma_schedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESOLUTION = 32


def make_adapter(dtype=torch.float32, lora=True, **options):
    """A random tiny FLUX pipeline behind a FluxAdapter, with LoRA on the trainer's targets."""
    torch.manual_seed(0)
    adapter = models.FluxAdapter(tiny.build_pipeline(seed=0), "cpu", dtype, max_sequence_length=16, **options)
    if lora:
        models.add_lora(adapter.transformer, rank=4, alpha=4, feed_forward=True)
    return adapter


def update_loss(adapter):
    """The update's loss on one sample, as a closure: -A log pi(x' | x) at ratio 1 (the clipped loss's gradient)."""
    cond = adapter.encode(["a red circle on the left"])
    latents = adapter.noise([torch.Generator().manual_seed(1)], RESOLUTION)  # (1, L, 4C)
    sigmas, index = sigma_schedule(4, 3.0), torch.zeros(1, dtype=torch.long)
    velocity = lambda: adapter.velocity(adapter.transformer, cond, latents, sigmas[1:2], index, RESOLUTION)
    with torch.no_grad():
        noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(2))
        next_latents, _ = sde_step(latents, velocity(), sigmas, 1, 0.7, noise=noise)
    return lambda: -(1.3 * sde_step(latents, velocity(), sigmas, 1, 0.7, next_latents=next_latents)[1]).mean()


class WrongBackward(torch.autograd.Function):
    """Identity forward; a backward that sends the gradient to the wrong features, as a faulty kernel's would."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.flip(-1)


class BrokenKernelProcessor(FluxAttnProcessor):
    """FLUX attention whose backward is wrong unless the math kernel is forced."""

    def __call__(self, *args, **kwargs):
        out = super().__call__(*args, **kwargs)
        if kernels.enabled_sdpa_backends() == [SDPBackend.MATH]:
            return out
        return tuple(map(WrongBackward.apply, out)) if isinstance(out, tuple) else WrongBackward.apply(out)


class RecordingProcessor(FluxAttnProcessor):
    """FLUX attention that records (grad enabled, kernels allowed) at every call, recomputes included."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def __call__(self, *args, **kwargs):
        self.log.append((torch.is_grad_enabled(), kernels.enabled_sdpa_backends()))
        return super().__call__(*args, **kwargs)


def test_kernel_choice():
    cuda = lambda name: kernels.sdpa_backends(name, "cuda")
    assert cuda("auto") == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    assert SDPBackend.CUDNN_ATTENTION not in cuda("auto")
    assert cuda("cudnn") == [SDPBackend.CUDNN_ATTENTION] and cuda("math") == [SDPBackend.MATH]
    assert kernels.sdpa_backends("math", "cpu") == [SDPBackend.MATH]
    assert all(kernels.sdpa_backends(name, "cpu") is None for name in ("auto", "flash", "efficient", "cudnn"))
    with pytest.raises(ValueError, match="choose one of auto, flash"):
        kernels.validate_attention_backend("xformers")


def test_cuda_only_kernel_falls_back_on_cpu_with_one_note(capsys):
    adapter = make_adapter(attention_backend="cudnn", rollout_attention_backend="efficient")
    assert capsys.readouterr().out.count("note: attention backend cudnn and efficient needs CUDA") == 1
    assert torch.isfinite(update_loss(adapter)())


def test_each_phase_runs_under_its_kernels_and_the_recompute_keeps_them():
    adapter = make_adapter(rollout_attention_backend="math")
    log = []
    adapter.transformer.set_attn_processor(RecordingProcessor(log))
    loss_fn = update_loss(adapter)  # one no-grad forward (the stored sample)
    assert log and all(kernels == [SDPBackend.MATH] for grad, kernels in log if not grad)
    log.clear()
    loss_fn().backward()
    assert log and all(grad and SDPBackend.FLASH_ATTENTION in kernels for grad, kernels in log)
    # gradient checkpointing: the backward recomputes each block, under the forward's kernels (math here)
    adapter.transformer.enable_gradient_checkpointing()
    log.clear()
    with adapter.kernels.exact_mode():
        loss_fn().backward()
    blocks = len(adapter.transformer.transformer_blocks) + len(adapter.transformer.single_transformer_blocks)
    assert len(log) == 2 * blocks and all(kernels == [SDPBackend.MATH] for _, kernels in log)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_check_passes_on_the_right_gradient(dtype):
    adapter = make_adapter(dtype)
    params = [p for p in adapter.transformer.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    result = adapter.kernels.check_gradient(update_loss(adapter), params)
    assert result.ok, result.message
    assert result.cosine > 0.9999 and result.relative_error < 1e-2 and result.norm > 0
    assert (result.fp32_cosine > 0.9) if dtype == torch.bfloat16 else result.fp32_cosine != result.fp32_cosine
    assert all(p.grad is None for p in params) and all(torch.equal(p, b) for p, b in zip(params, before))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_gradient_check_fails_on_a_broken_kernel(checkpointing):
    adapter = make_adapter()
    adapter.transformer.set_attn_processor(BrokenKernelProcessor())
    if checkpointing:  # exact mode stays exact only if the recompute keeps the math kernel
        adapter.transformer.enable_gradient_checkpointing()
    params = [p for p in adapter.transformer.parameters() if p.requires_grad]
    result = adapter.kernels.check_gradient(update_loss(adapter), params)
    assert not result.ok and result.cosine < 0.9
    assert "cause: the attention kernel" in result.message and "fix: --attention-backend math" in result.message
    assert all(p.grad is None for p in params)


def test_gradient_check_names_precision_when_only_fp32_disagrees():
    """A bf16 run on fp32 weights whose gradient is far from fp32's (a tolerance no bf16 run can meet)."""
    adapter = make_adapter(torch.bfloat16)
    params = [p for p in adapter.transformer.parameters() if p.requires_grad]
    result = adapter.kernels.check_gradient(update_loss(adapter), params, min_fp32_cosine=0.9999)
    assert not result.ok and result.cosine > 0.99
    assert "cause: bf16 precision" in result.message and "fix: --mixed-precision no" in result.message


def test_gradient_check_bounds_the_parameters_it_copies():
    adapter = make_adapter()
    params = [p for p in adapter.transformer.parameters() if p.requires_grad]
    bound = params[0].numel() + params[1].numel()  # a LoRA's A and B (A's gradient is 0 while B is 0)
    result = kernels.check_gradient(update_loss(adapter), params, adapter.kernels.exact_mode, max_numel=bound)
    assert result.ok and f"over {bound:,} gradient elements" in result.message


def test_regional_compilation_gives_the_same_velocity_and_gradient():
    """aot_eager traces the same block graphs as inductor without generating kernels (inductor takes minutes here)."""
    eager, compiled = make_adapter(), make_adapter(compile="aot_eager")
    for adapter in (eager, compiled):
        adapter.transformer.enable_gradient_checkpointing()
    grads = []
    for adapter in (eager, compiled):
        loss_fn = update_loss(adapter)
        loss_fn().backward()
        grads.append(torch.cat([p.grad.flatten() for p in adapter.transformer.parameters() if p.grad is not None]))
    assert compiled.transformer.transformer_blocks[0]._compiled_call_impl is not None
    assert eager.transformer.transformer_blocks[0]._compiled_call_impl is None
    cond = eager.encode(["a blue bar on the top"])
    latents = eager.noise([torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)], RESOLUTION)
    sigma, index = torch.tensor([0.9, 0.4]), torch.zeros(2, dtype=torch.long)
    with torch.no_grad():
        v = [a.velocity(a.transformer, cond, latents, sigma, index, RESOLUTION) for a in (eager, compiled)]
    torch.testing.assert_close(v[1], v[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-4)


def test_compiled_blocks_stay_compiled_past_many_versions():
    """Each grad mode, batch size, input layout and resolution that a block meets is a new version of its graph;
    past torch's default limit of 8 versions the block would run eager without a word (as a FLUX block did on an
    H200). Here hitting the limit is an error, and each batch size a version of its own (static shapes): 12 versions
    of a one-layer block (the limit is the graph capture's, whatever the block; the "eager" backend)."""
    transformer = torch.nn.Module()
    transformer.transformer_blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
    kernels.compile_blocks(transformer, "eager")
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, automatic_dynamic_shapes=False):
        for batch in range(1, 13):
            transformer.transformer_blocks[0](torch.randn(batch, 4))


def test_add_lora_keeps_the_frozen_base_and_trains_fp32_lora():
    adapter = make_adapter(lora=False)
    adapter.transformer.to(torch.bfloat16)
    models.add_lora(adapter.transformer, rank=4, alpha=8, feed_forward=False)
    trained = {n: p for n, p in adapter.transformer.named_parameters() if p.requires_grad}
    frozen = [p for p in adapter.transformer.parameters() if not p.requires_grad]
    assert trained and all("lora_" in n and p.dtype == torch.float32 for n, p in trained.items())
    assert all(p.dtype == torch.bfloat16 for p in frozen)
    assert not any("ff." in n or "proj_mlp" in n for n in trained)
    assert any("to_add_out" in n for n in trained)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's run of the small config (no FP8 tiny runs)")
def test_gpu_check_small_config_end_to_end(tmp_path):
    """tools/gpu_check.py --config small on the CPU: every part runs through the trainer's code and is recorded."""
    out = str(tmp_path / "check")
    command = [sys.executable, "-m", "tools.gpu_check", "--config", "small", "--output-dir", out]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(out, "results.jsonl")) as f:
        results = {(r["kind"], r.get("lever") or r.get("run")): r for r in map(json.loads, f)}
    assert results.pop(("tiny", "tiny_fp8"))["status"] == "skipped: --rollout-precision fp8 needs CUDA"
    assert all(r["status"] == "ok" for r in results.values()), [r["status"] for r in results.values()]
    assert set(results) == {("gradient", None), ("tiny", "tiny"), ("iteration", None), ("fp8", None),
                            ("fp8_iteration", None), ("lever", "rollout attention cudnn"),
                            ("lever", "compile (eager)")}
    assert results["gradient", None]["ok"] and results["gradient", None]["skipped_steps"] == 0
    assert results["tiny", "tiny"]["skipped_steps"] == 0 and results["tiny", "tiny"]["iterations"] == 1
    # part 5 through the CPU stand-in: the trainer's FP8 variant beside the policy, close to its images
    fp8 = results["fp8", None]
    assert [row["variant"].split(",")[0] for row in fp8["rows"]] == ["policy (float32", "fp8", "fp8"]
    assert fp8["quantized_layers"] > 0 and 30 < min(fp8["rows"][1]["psnr_db"]) < float("inf")
    fp8_iteration = results["fp8_iteration", None]
    assert fp8_iteration["first_ratio_error"] == 0 and 0 < fp8_iteration["image_only_nfe"] < fp8_iteration["nfe"]
    iteration = results["iteration", None]
    assert iteration["nfe"] > 0 and iteration["skipped_steps"] == 0 and iteration["ratio_deviation"] < 1e-5
    assert all(iteration["seconds"][phase] > 0 for phase in ("rollout", "decode_and_reward", "update"))
    assert [f["max_batch"] for f in iteration["probe"]["forwards"]] == [4, 8]
    compiled = results["lever", "compile (eager)"]["probes"][0]
    assert compiled["forwards"][0]["rollout_tflops"] > 0 and compiled["update_s_per_step"] > 0
    assert "note: attention backend cudnn needs CUDA" in proc.stdout and "| compile (eager) | 32 |" in proc.stdout


def test_gpu_check_runs_a_case_in_a_subprocess():
    """On CUDA every case runs this way: the subprocess's last line carries its result."""
    from tools import gpu_check

    args = gpu_check.Args(config="small")
    result = gpu_check.run_case(args, dict(kind="gradient", resolution=32), time.time() + 300, isolate=True)
    assert result["status"] == "ok" and result["ok"] and result["cosine"] > 0.9999 and result["wall_s"] > 0


def test_gpu_check_skips_cases_past_its_budget(tmp_path, capsys):
    from tools import gpu_check

    gpu_check.main(gpu_check.Args(config="small", parts=("gradient", "iteration"), output_dir=str(tmp_path),
                                  budget_s=5.0))
    with open(tmp_path / "results.jsonl") as f:
        statuses = [json.loads(line)["status"] for line in f]
    assert statuses == ["skipped: over the time budget (--budget-s)"] * 2
    assert "**gradient **: skipped" in capsys.readouterr().out
