"""train.py end to end on tiny real FLUX and SD3 pipelines (random weights, built offline): full fine-tune and
LoRA, the saved weights loading into stock diffusers, torchrun with DDP and FSDP2 on CPU, and resume.

Run: python -m pytest -q tests/test_train.py
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import QUICK, QUICK_ANY, ROOT, run_train


def read_metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def transformer_weights(out, iteration):
    folder = os.path.join(out, "checkpoints", f"iter_{iteration:06d}")
    if os.path.isdir(os.path.join(folder, "lora")):
        return load_file(os.path.join(folder, "lora", "pytorch_lora_weights.safetensors"))
    return load_file(os.path.join(folder, "transformer", "diffusion_pytorch_model.safetensors"))


@pytest.mark.parametrize("model", ["flux", "sd3"])
@pytest.mark.parametrize("lora", [0, 4])
def test_two_iterations(model, lora, flux_path, sd3_path, tmp_path):
    out = str(tmp_path / "run")
    path = flux_path if model == "flux" else sd3_path
    proc = run_train(["--model", model, "--model-path", path, "--output-dir", out, "--num-iterations", "2",
                      "--lora-rank", str(lora), "--lr", "1e-2", "--eval-every", "1", "--checkpoint-every", "1", *QUICK,
                      *(["--offload-text-encoders"] if lora else [])])
    rows = read_metrics(out)
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert "eval/reward/shapes" in rows[0] and "losses/loss" in rows[1] and "train/reward/shapes/g2" in rows[2]
    assert rows[1]["perf/nfe"] > 0 and rows[1]["faults/skipped_steps"] == 0
    assert os.path.exists(os.path.join(out, "samples", "before_after.png"))
    assert "trained reward on the held-out prompts" in proc.stdout
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["model"] == model and config["code_version"]
    sub = "lora" if lora else "transformer"
    assert os.path.isdir(os.path.join(out, "checkpoints", "iter_000002", sub))
    assert not any(d.endswith(".tmp") for d in os.listdir(os.path.join(out, "checkpoints")))


def test_saved_weights_load_into_stock_diffusers(flux_path, tmp_path):
    from diffusers import FluxPipeline, FluxTransformer2DModel

    lora_out, full_out = str(tmp_path / "lora"), str(tmp_path / "full")
    common = ["--model", "flux", "--model-path", flux_path, "--num-iterations", "1", "--lr", "5e-2", *QUICK]
    run_train([*common, "--output-dir", lora_out, "--lora-rank", "4", "--lora-alpha", "8"])
    run_train([*common, "--output-dir", full_out])

    pipe = FluxPipeline.from_pretrained(flux_path)
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(prompt="a red circle on the left", height=32, width=32, num_inference_steps=3,
                  max_sequence_length=16, output_type="pt")
    base = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    pipe.load_lora_weights(os.path.join(lora_out, "checkpoints", "iter_000001", "lora"))
    config = next(iter(pipe.transformer.peft_config.values()))
    assert (config.r, config.lora_alpha) == (4, 8)  # the trained scale travels in the file's metadata
    tuned = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    assert not torch.allclose(base, tuned, atol=1e-4)

    trained = FluxTransformer2DModel.from_pretrained(os.path.join(full_out, "checkpoints", "iter_000001", "transformer"))
    original = FluxTransformer2DModel.from_pretrained(flux_path, subfolder="transformer")
    changed = [n for (n, p), q in zip(trained.named_parameters(), original.parameters()) if not torch.equal(p, q)]
    assert changed


def extra_state(out, iteration, name="ema"):
    return load_file(os.path.join(out, "checkpoints", f"iter_{iteration:06d}", f"{name}.safetensors"))


@pytest.mark.parametrize("extra", [[], ["--lora-rank", "4", "--ema-decay", "0.5", "--kl-beta", "0.1"]],
                         ids=["full", "lora-ema-kl"])
def test_resume_equals_uninterrupted(extra, flux_path, tmp_path):
    full, parts = str(tmp_path / "full"), str(tmp_path / "parts")
    common = ["--model", "flux", "--model-path", flux_path, "--lr", "1e-2", "--checkpoint-every", "2",
              "--eval-every", "100", *QUICK, *extra]
    run_train([*common, "--output-dir", full, "--num-iterations", "4"])
    run_train([*common, "--output-dir", parts, "--num-iterations", "2"])
    proc = run_train([*common, "--output-dir", parts, "--num-iterations", "4", "--resume"])
    assert "resumed from" in proc.stdout
    a, b = transformer_weights(full, 4), transformer_weights(parts, 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows_a, rows_b = read_metrics(full), read_metrics(parts)
    assert [r["train/reward/shapes"] for r in rows_a[1:]] == [r["train/reward/shapes"] for r in rows_b[1:]]
    if extra:  # the EMA resumes exactly, and the KL term is on
        ema_a, ema_b = extra_state(full, 4), extra_state(parts, 4)
        assert len(ema_a) == len(a)  # one average per trained (LoRA) weight
        assert all(torch.equal(ema_a[k], ema_b[k]) for k in ema_a)
        assert rows_a[-1]["losses/kl"] > 0


def test_ema_is_the_hand_computed_average():
    from lab.run import EMA

    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    ema = EMA([("w", w)], decay=0.5, every=2)
    history = [torch.tensor([3.0, 2.0]), torch.tensor([5.0, 0.0]), torch.tensor([1.0, 4.0]), torch.tensor([7.0, 8.0])]
    expected = w.detach().clone()
    for it, value in enumerate(history, start=1):
        w.data.copy_(value)
        ema.update(it)
        if it % 2 == 0:  # every second iteration: ema <- 0.5 ema + 0.5 w
            expected = 0.5 * expected + 0.5 * value
    torch.testing.assert_close(ema.state_dict()["w"], expected)
    ema.swap()
    torch.testing.assert_close(w.detach(), expected)
    ema.swap()
    torch.testing.assert_close(w.detach(), history[-1])


@pytest.mark.parametrize("lora", [4, 0], ids=["ddp", "fsdp2"])
def test_torchrun_two_ranks_match_one(lora, flux_path, tmp_path):
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    # DDP runs a peer whose collectives are its own: each member's random trained steps leave the ranks different
    # numbers of rows to forward (DanceGRPO)
    peer = ["--method", "dancegrpo", "--timestep-fraction", "0.5", "--member-chunks", "2"]
    common = ["--model", "flux", "--model-path", flux_path, "--num-iterations", "2", "--lora-rank", str(lora),
              "--lr", "1e-3", "--eval-every", "100", "--ema-decay", "0.5", "--kl-beta", "0.1",
              *(QUICK + ["--checkpoint-every", "1"] if not lora else QUICK_ANY + peer)]
    run_train([*common, "--output-dir", one])
    proc = run_train([*common, "--output-dir", two], torchrun=2)
    assert "ranks agree on the parameters" in proc.stdout
    a, b = transformer_weights(one, 2), transformer_weights(two, 2)
    assert a.keys() == b.keys()
    ema_a, ema_b = extra_state(one, 2), extra_state(two, 2)  # the EMA, gathered from DDP copies or FSDP2 shards
    assert ema_a.keys() == ema_b.keys() and len(ema_a) > 0
    for x, y in [(a, b), (ema_a, ema_b)]:  # equal up to the order of the gradient all-reduce (Adam magnifies it)
        for k in x:
            torch.testing.assert_close(x[k], y[k], rtol=1e-3, atol=2e-5)
    if lora:  # and the runs did learn: LoRA's B matrices start at zero
        assert any(v.abs().max() > 1e-4 for k, v in a.items() if "lora_B" in k)
    else:
        initial = load_file(os.path.join(flux_path, "transformer", "diffusion_pytorch_model.safetensors"))
        assert max(float((a[k] - initial[k]).abs().max()) for k in a) > 1e-3

    if not lora:
        check_sharded_checkpoints(common, one, two, tmp_path)


def close(x, y):
    assert x.keys() == y.keys()
    for k in x:  # equal up to the order of the gradient reduction
        torch.testing.assert_close(x[k], y[k], rtol=1e-4, atol=1e-6)


def kill_torchrun_after(args, out, iteration):
    """Start train.py under torchrun on 2 ranks and SIGKILL every process at a random moment within 0.5 s after
    `iteration` is logged: possibly while the ranks write their shards, or while rank 0 seals the folder."""
    import random
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             os.path.join(ROOT, "train.py"), *args, "--output-dir", out], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    metrics, deadline = os.path.join(out, "metrics.jsonl"), time.time() + 300
    def logged():
        try:
            return any(json.loads(line).get("iteration", -1) >= iteration for line in open(metrics) if line.strip())
        except (OSError, ValueError):  # not written yet, or a line caught while it is being written
            return False

    while proc.poll() is None and time.time() < deadline and not logged():
        time.sleep(0.1)
    time.sleep(random.uniform(0.0, 0.5))
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def check_sharded_checkpoints(common, one, two, tmp_path):
    """FSDP2's checkpoints are DCP folders with one file of shards per rank and no gathered copy; the last is also
    exported as transformer/ (and ema.safetensors). A 2-rank run killed at any point resumes on 2 ranks bit for bit;
    a checkpoint saved on 2 ranks resumes on 1 process, one saved by 1 process on 2 ranks; all continue as the
    uninterrupted runs did (across world sizes, up to the order of the gradient reduction)."""
    import shutil

    from lab import checkpoint

    first = os.path.join(two, "checkpoints", "iter_000001")
    assert sorted(os.listdir(os.path.join(first, "dcp"))) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not os.path.exists(os.path.join(first, "transformer")) and checkpoint.verify(first) is None
    for source, target, ranks in [(two, tmp_path / "two_to_two", 2), (two, tmp_path / "two_to_one", 0),
                                  (one, tmp_path / "one_to_two", 2)]:
        if source == two and ranks == 2:  # a real 2-rank run killed at an arbitrary point, maybe mid-save
            kill_torchrun_after(common, str(target), iteration=1)
        else:  # a finished run that loses its last checkpoint, as a preempted one would
            shutil.copytree(source, target)
            shutil.rmtree(os.path.join(target, "checkpoints", "iter_000002"))
        run_train([*common, "--output-dir", str(target), "--resume"], torchrun=ranks)
        for resumed, uninterrupted in [(transformer_weights(str(target), 2), transformer_weights(source, 2)),
                                       (extra_state(str(target), 2), extra_state(source, 2))]:
            if ranks == 2 and source == two:  # the same world size: bit for bit
                assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)
            else:
                close(resumed, uninterrupted)
    checkpoint.export_command(first, log=lambda *_: None)  # `python -m lab.checkpoint export`, in this process
    assert not os.path.exists(first + ".export.lock")  # the export leaves nothing beside the checkpoint
    from diffusers import FluxPipeline, FluxTransformer2DModel

    exported = FluxTransformer2DModel.from_pretrained(os.path.join(first, "transformer"))
    final = transformer_weights(two, 2)
    assert final.keys() == exported.state_dict().keys()
    assert any(not torch.equal(exported.state_dict()[k], final[k]) for k in final)  # iteration 1's, not 2's
    many = tmp_path / "many_files"  # export in files of 64 KiB: the index that from_pretrained follows
    shutil.copytree(first, many)
    saved, checkpoint.EXPORT_SHARD_BYTES = checkpoint.EXPORT_SHARD_BYTES, 1 << 16
    try:
        checkpoint.export(str(many), log=lambda *_: None)
    finally:
        checkpoint.EXPORT_SHARD_BYTES = saved
    assert len([n for n in os.listdir(many / "transformer") if n.endswith(".safetensors")]) > 1
    from_files = FluxTransformer2DModel.from_pretrained(str(many / "transformer")).state_dict()
    assert all(torch.equal(from_files[k], v) for k, v in exported.state_dict().items())
    pipe = FluxPipeline.from_pretrained(common[common.index("--model-path") + 1], transformer=exported)
    pipe.set_progress_bar_config(disable=True)
    image = pipe("a red circle on the left", height=32, width=32, num_inference_steps=2, max_sequence_length=16,
                 output_type="pt").images
    assert image.shape == (1, 3, 32, 32) and torch.isfinite(image).all()
