"""tools/plan.py: the plan's accounting against a real CPU run of the same phases, and its table and closing line.

The check: `plan.plan(args, fake=True)` builds the models on fake tensors and routes attention to the kernel CUDA
would take; `plan.plan(args, fake=False)` runs the same phases on real tensors on this CPU (torch's own kernels).
Each phase's peak must agree within 2 % (measured: equal to 0.1 %), with the fused kernels and with the math kernel
(which materialises the attention scores: the fake run must count them too).

Run: python -m pytest -q tests/test_plan.py     (about 2 minutes on 2 cores)
"""
import os
import re

import pytest

from lab import flags
from tools import plan

TOLERANCE = 0.02


def small_args(*extra, sde_steps=("0", "1")):
    """The tiny preset, shortened: a small configuration whose every phase runs for real in seconds (no --sde-steps
    for a method that chooses its own steps: sde_steps ())."""
    steps = ["--sde-steps", *sde_steps] if sde_steps else []
    return flags.parse_args(["--model", "tiny", "--num-steps", "4", *steps, "--group-size", "4",
                             "--prompts-per-iteration", "2", *extra], plan.PlanArgs)


def plans(*extra):
    """The plan of a small configuration on fake tensors, and the same phases run for real on this CPU."""
    args = small_args(*extra)
    return plan.plan(args, fake=True, log=lambda m: None)[0], plan.plan(args, fake=False, log=lambda m: None)[0]


@pytest.fixture(scope="module")
def fused():
    return plans()


def assert_agree(simulated, real):
    assert [r.phase for r in simulated] == [r.phase for r in real]
    for s, r in zip(simulated, real):
        assert r.cost.peak["total"] > 0
        assert abs(s.cost.peak["total"] - r.cost.peak["total"]) <= TOLERANCE * r.cost.peak["total"], (
            s.phase, s.cost.peak, r.cost.peak)
        assert s.cost.peak["weights"] == r.cost.peak["weights"], s.phase


def test_plan_matches_a_real_cpu_run(fused):
    assert_agree(*fused)


SMALL_FAMILIES = {  # configurations small enough to run for real here (tools/configs/ holds the full sizes)
    "zimage": ([], {
        "transformer": dict(in_channels=4, dim=64, n_layers=2, n_refiner_layers=1, n_heads=4, n_kv_heads=4,
                            cap_feat_dim=32, axes_dims=[4, 6, 6], axes_lens=[64, 32, 32]),
        "text_encoder": dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64),
        "vae": dict(down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                    block_out_channels=[16, 16], layers_per_block=1, latent_channels=4, norm_num_groups=8,
                    mid_block_add_attention=False, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.1,
                    scaling_factor=0.5)}),
    "wan": (["--num-frames", "5", "--reward-frames", "2", "--width", "48"], {  # video, 32 x 48
        "transformer": dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=12, in_channels=16,
                            out_channels=16, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32),
        "text_encoder": dict(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                             relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
                             decoder_start_token_id=0),
        "vae": dict(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                    temperal_downsample=[False, True, True])}),
    "qwenimage": ([], {  # true CFG: the negative caption's mask, the joint attention mask
        "transformer": dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
                            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=[4, 6, 6]),
        "text_encoder": dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                             rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, bos_token_id=0,
                             eos_token_id=1, pad_token_id=0,
                             vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                                out_hidden_size=32, fullatt_block_indexes=[0])),
        "vae": dict(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                    temperal_downsample=[False, True, True])}),
}


@pytest.mark.parametrize("family", SMALL_FAMILIES)
def test_another_familys_plan_matches_a_real_cpu_run(family, tmp_path):
    """Other families through the same accounting, each from a configuration folder of its own: Z-Image (Qwen3
    captions, unpadded lists, FLUX's VAE), Wan (video latents, the causal video VAE, rewards over frames) and
    Qwen-Image (Qwen2.5-VL captions cut at their masks, true CFG's masked joint attention)."""
    import json

    extra, configs = SMALL_FAMILIES[family]
    for name, config in configs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(config))
    root = os.path.dirname(plan.ROOT)
    args = flags.parse_args(["--model", family, "--configs", str(tmp_path), "--resolution", "32", "--num-steps", "4",
                             "--sde-steps", "0", "1", "--group-size", "4", "--prompts-per-iteration", "2",
                             "--max-sequence-length", "16" if family == "wan" else "32", "--rewards", "shapes=1.0",
                             "--mixed-precision", "no", "--no-gradient-checkpointing", "--eval-seeds", "1",
                             "--prompt-file", os.path.join(root, "prompts", "tiny_train.txt"),
                             "--eval-prompt-file", os.path.join(root, "prompts", "tiny_eval.txt"), *extra],
                            plan.PlanArgs)
    assert_agree(plan.plan(args, fake=True, log=lambda m: None)[0], plan.plan(args, fake=False, log=lambda m: None)[0])


def test_a_transformer_without_blocks_is_one_line(tmp_path, capsys):
    """A --configs transformer with num_layers 0 has nothing for LoRA to adapt: one line, not peft's error."""
    import json

    for name, config in SMALL_FAMILIES["zimage"][1].items():
        (tmp_path / f"{name}.json").write_text(json.dumps(dict(config, n_layers=0, n_refiner_layers=0)
                                                          if name == "transformer" else config))
    with pytest.raises(SystemExit):
        plan.main(["--model", "zimage", "--configs", str(tmp_path), "--resolution", "32", "--lora-rank", "4"])
    assert "has none of the modules LoRA adapts" in capsys.readouterr().err


def test_the_noise_of_a_huge_group_is_fake():
    """Noise drawn from a prompt's CPU generator has no fake input: the plan draws it fake, so --group-size 100000
    costs no host memory (it allocated 3.3 GB on the tiny preset)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    import torch
    from sampler import prompt_noise

    with plan.NoValues(FakeTensorMode(allow_non_fake_inputs=True)):
        noise = prompt_noise([torch.Generator().manual_seed(0)] * 2, (100_000, 64, 16), "cpu")
    assert isinstance(noise, FakeTensor) and noise.shape == (2, 100_000, 64, 16)


def test_an_fp8_run_holds_its_copy_in_every_phase(fused):
    """--rollout-precision fp8 adds the copy's bytes to every phase's weights: one a quantized weight (the blocks'
    attention and feed-forward layers, kernels.fp8_layers), four a row for its scales, and (the tiny preset is a full
    fine-tune) two a row for its bf16 bias."""
    from lab import tiny
    from lab.kernels import fp8_layers

    with_copy, notes, _ = plan.plan(small_args("--rollout-precision", "fp8"), log=lambda m: None)
    plain = fused[0]
    layers = [linear for _, linear in fp8_layers(tiny.build_pipeline(seed=0).transformer)]
    extra = sum(linear.weight.numel() + 4 * linear.out_features + 2 * linear.out_features * (linear.bias is not None)
                for linear in layers)
    assert extra > 0 and [r.phase for r in with_copy] == [r.phase for r in plain]
    for a, b in zip(with_copy, plain):
        assert a.cost.peak["weights"] - b.cost.peak["weights"] == extra, a.phase
    assert any(note.startswith(f"FP8 rollout copy: {len(layers)} linear layers") for note in notes)


def test_plan_counts_the_math_kernels_scores(fused):
    """The math kernel holds the attention scores: the fake run must count them as the real one allocates them."""
    simulated, real = plans("--attention-backend", "math", "--rollout-attention-backend", "math")
    assert_agree(simulated, real)
    assert simulated[2].cost.peak["activations"] > 1.2 * fused[0][2].cost.peak["activations"]  # the rollout call


def test_the_rollouts_storage_is_fake_too():
    """The rollout's tree of latents is built on fake tensors: at 4096^2 with --max-batch 64 real storage took
    23.7 GB of host memory (measured at 2048^2: a 7.6 GB peak before, 1.4 GB now, the same rollout row)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from lab.loop import generators
    from sampler import sigma_schedule

    args = small_args()
    gens = generators(args.seed, 0, range(2))
    noise = torch.randn(2, 16, 8)  # (B, L, C): any latent shape; the velocity is zeros
    sigmas = sigma_schedule(args.num_steps, args.shift)
    method = flags.method_of(args)
    storage, calls = plan.rollout_storage(method, noise, sigmas, gens, method.trained_steps(0),
                                          FakeTensorMode(allow_non_fake_inputs=True))
    rollout = storage["rollout"]
    assert all(isinstance(t, FakeTensor) for t in (rollout.start_latents, rollout.next_latents,
                                                   rollout.final_latents))
    assert calls and max(held for _, held in calls) > 0  # the tracker still counts what the rollout holds


def test_fsdp_shards_what_one_rank_holds(fused):
    """Two ranks of FSDP2 on the fake process group: each holds half the optimizer state of one, and less weight."""
    two, notes, _ = plan.plan(small_args("--gpus", "2"), log=lambda m: None)
    # under torchrun a stop cuts the update at its next optimizer step: one of the 2 (one per trained step)
    assert "at the next optimizer step of the update (" in next(n for n in notes if n.startswith("preemption"))
    update_one, update_two = fused[0][4].cost.peak, two[4].cost.peak
    assert update_two["optimizer"] == pytest.approx(update_one["optimizer"] / 2, rel=0.05)
    assert update_two["weights"] < update_one["weights"]  # its shard, plus the blocks gathered for a forward
    assert two[2].cost.peak["other"] > 0  # the rollout's storage, net of the shards it does not hold anew


def test_report_says_whether_it_fits(capsys):
    plan.main(["--model", "tiny", "--num-steps", "4", "--sde-steps", "0", "1", "--gpu-memory-gib", "0.001"])
    out = capsys.readouterr().out
    assert "| phase | peak GiB |" in out and "| update:" in out and "| evaluation:" in out
    assert out.strip().splitlines()[-1].startswith("no: phase ")
    assert "of the rollouts'" in out
    assert re.search(r"preemption: a SIGTERM stops .* within a grace of 30 s", out), out


def test_training_evaluation_costs_at_most_5_percent_of_the_rollouts():
    """The flux preset's in-training evaluation: 48 prompts spread over HPDv2's 400 (100 per style), 2 seeds, and
    its forwards over the run at most 5 % of the rollouts' (counted by the rollout's own NFE accounting)."""
    import torch

    from lab.loop import eval_items
    from sampler import sigma_schedule

    args = flags.parse_args(["--model", "flux"])
    items = eval_items(400, args.eval_prompts, args.eval_seeds)
    chosen = sorted({p for p, _ in items})
    assert len(items) == 96 and len(chosen) == 48 and [p // 100 for p in chosen].count(3) == 12
    assert items[:48] == [(p, 0) for p in chosen]  # seed-major, as the grids expect
    zero = lambda x, sigma, index: torch.zeros_like(x)
    rollout = flags.method_of(args).rollout(
        zero, torch.zeros(1, 4), sigma_schedule(args.num_steps, args.shift), [torch.Generator()], args.sde_steps)
    evaluations = len({0, args.num_iterations, *range(args.eval_every, args.num_iterations, args.eval_every)})
    share = evaluations * len(items) * args.num_steps / (args.num_iterations * rollout.nfe)
    assert rollout.nfe == 1708 and share <= 0.05, share


def test_a_broken_configuration_is_one_line(tmp_path, capsys):
    """--configs with a missing file, a cut-short one or a negative count: one error line each, no traceback."""
    import json
    import shutil

    folder = tmp_path / "configs"
    shutil.copytree(os.path.join(plan.ROOT, "configs", "flux1-dev"), folder)
    (folder / "vae.json").unlink()
    with pytest.raises(SystemExit):
        plan.main(["--model", "flux", "--configs", str(folder)])
    assert "holds no vae.json" in capsys.readouterr().err
    (folder / "transformer.json").write_text('{"num_layers": 19, "num_single')
    with pytest.raises(SystemExit):
        plan._json(str(folder), "transformer.json")
    assert "is not readable JSON" in capsys.readouterr().err
    (folder / "transformer.json").write_text(json.dumps({"num_layers": -3}))
    with pytest.raises(SystemExit):
        plan._json(str(folder), "transformer.json")
    assert "num_layers -3 is negative" in capsys.readouterr().err


def test_inner_epochs_count_in_the_update_and_its_preemption(fused):
    """--inner-epochs passes over the rollout: the update's calls, its time floor and the preemption line scale."""
    rows8, notes8, _ = plan.plan(small_args("--inner-epochs", "8", "--peak-tflops", "1e-6"), log=lambda m: None)
    one, eight = (next(r for r in table if r.phase.startswith("update")) for table in (fused[0], rows8))
    assert eight.calls == 8 * one.calls and "x 8 inner epochs" in eight.phase
    preemption = next(n for n in notes8 if n.startswith("preemption"))
    seconds = float(re.search(r"after the update \(([\d.]+) s\)", preemption).group(1))
    assert seconds == pytest.approx(one.cost.flops * 8 * one.calls / 1e6, rel=0.01) and "beyond a grace" in preemption


# --- the series' updates and AdaGRPO's curriculum pool (methods/pavegrpo.py, methods/adagrpo.py) -----------------
SERIES = ("--eval-prompts", "2", "--eval-seeds", "1", "--peak-tflops", "1e-6")  # a small evaluation; s = FLOPs / 1e6


def update_row(rows):
    return next(r for r in rows if r.phase.startswith("update"))


@pytest.fixture(scope="module")
def pave():
    """Pave-GRPO at its default sub-steps {2, 3}, one trained step: the plan, its notes, and its phases run for real."""
    args = small_args("--method", "pavegrpo", *SERIES, sde_steps=("0",))
    simulated, notes, _ = plan.plan(args, log=lambda m: None)
    return simulated, notes, plan.plan(args, fake=False, log=lambda m: None)[0]


def test_pave_grpos_update_holds_its_sub_steps(pave, fused):
    """The plan runs the method's own update, as train.py calls it: Pave-GRPO's 1 + (2 - 1) + (3 - 1) = 4 forwards
    with gradients per start latent and trained step, whose activations are held until the backward. The real CPU
    run agrees, a step costs 4 times G2RPO's at the same flags, its peak is higher, and the preemption line's update
    (one process: the whole update) is that longer update."""
    simulated, notes, real = pave
    assert_agree(simulated, real)
    update, g2rpo = update_row(simulated), update_row(fused[0])
    assert "4 forwards each," in update.phase
    assert update.cost.flops == pytest.approx(4 * g2rpo.cost.flops, rel=0.01)
    assert update.cost.peak["activations"] > 2 * g2rpo.cost.peak["activations"]
    assert update.cost.peak["total"] > g2rpo.cost.peak["total"]
    preemption = next(n for n in notes if n.startswith("preemption"))
    seconds = float(re.search(r"after the update \(([\d.]+) s\)", preemption).group(1))
    assert seconds == pytest.approx(update.cost.flops * update.calls / 1e6, rel=0.01)


def test_pave_grpo_is_cut_at_its_one_optimizer_step_under_torchrun():
    """Two ranks of FSDP2: Pave-GRPO takes one optimizer step an update (`optimizer_steps`), so a stop waits for the
    whole update; the sub-steps' several top-level forwards before one backward are tracked too."""
    rows, notes, _ = plan.plan(small_args("--method", "pavegrpo", "--sub-steps", "2", "--gpus", "2", *SERIES,
                                          sde_steps=("0",)), log=lambda m: None)
    update = update_row(rows)
    assert "2 forwards each" in update.phase
    preemption = next(n for n in notes if n.startswith("preemption"))
    match = re.search(r"at the next optimizer step of the update \(([\d.]+) s, one of (\d+)\)", preemption)
    assert match and match.group(2) == "1", preemption
    assert float(match.group(1)) == pytest.approx(update.cost.flops * update.calls / 1e6, rel=0.01)


def test_the_curriculum_pool_is_a_phase_of_its_own(fused):
    """AdaGRPO's curriculum on G2RPO (--adagrpo-base g2rpo --curriculum-pool P, the method's `anchor_candidates`): P
    candidates per prompt encoded at once, their ODE anchors (B P N forwards, no gradients) and their scoring are
    rows of their own, which the real CPU run agrees with; they count in the iteration's time, the preemption line
    and the rollouts' forwards, and leave the iteration's own phases as they were."""
    args = small_args("--method", "adagrpo", "--adagrpo-base", "g2rpo", "--curriculum-pool", "3", *SERIES)
    simulated, notes, _ = plan.plan(args, log=lambda m: None)
    assert_agree(simulated, plan.plan(args, fake=False, log=lambda m: None)[0])
    pool = [r for r in simulated if r.phase.startswith("prompt pool")]
    assert [r.phase.split(",")[0] for r in pool] == ["prompt pool: encode 6 candidates (3 a prompt)",
                                                     "prompt pool: ODE anchors", "prompt pool: decode + reward"]
    assert "4 calls, 24 NFE (largest call 6)" in pool[1].phase and pool[1].calls == 4  # B P N = 2 x 3 x 4
    rollout = next(r for r in fused[0] if r.phase.startswith("rollout"))
    per_forward = rollout.cost.flops * rollout.calls / 48  # the rollout's 48 NFE
    assert pool[1].cost.flops * pool[1].calls == pytest.approx(24 * per_forward, rel=0.01)
    assert pool[2].calls == 1 and "batch 6" in pool[2].phase
    assert [r.phase for r in simulated if r not in pool][:5] == [r.phase for r in fused[0]][:5]
    assert any(n.endswith("(the prompt pools' included)") for n in notes)
    assert "next rollout or prompt pool call" in next(n for n in notes if n.startswith("preemption"))


def test_adagrpo_plans_its_pool_and_holds_gradients_over_its_steps(fused):
    """--method adagrpo: its recipe's pool of 10 (B P N = 2 x 10 x 4 = 80 forwards), and the series' update without
    sub-steps: one forward a start latent, as G2RPO's, but one optimizer step over the trained steps, so the second
    step runs with the first's gradients held."""
    rows = plan.plan(small_args("--method", "adagrpo", *SERIES), log=lambda m: None)[0]
    assert any(r.phase.startswith("prompt pool: ODE anchors, 4 calls, 80 NFE") for r in rows)
    update, g2rpo = update_row(rows), update_row(fused[0])
    assert "gradients accumulate across steps" in update.phase
    assert update.cost.flops == pytest.approx(g2rpo.cost.flops, rel=0.01)
    assert update.cost.peak["grads"] > g2rpo.cost.peak["grads"]
    assert update.cost.peak["total"] > g2rpo.cost.peak["total"]


def test_diffusionnfts_old_policy_is_resident_and_its_update_counts_both_forwards(fused):
    """A method whose state is a copy of the trained weights (DiffusionNFT's old policy): the plan starts it as
    train.py does, so the copy is resident in every phase (here a full fine-tune: a second transformer's weights,
    and a third, the frozen base that the authors' 1e-4 KL reads), and its update runs the method's own forwards an
    image and step, which the real CPU run agrees with."""
    args = small_args("--method", "diffusionnft", *SERIES, sde_steps=())
    simulated = plan.plan(args, log=lambda m: None)[0]
    assert_agree(simulated, plan.plan(args, fake=False, log=lambda m: None)[0])
    from lab import tiny

    trained = sum(p.numel() * 4 for p in tiny.build_pipeline(seed=0).transformer.parameters())  # fp32 bytes
    resident, g2rpo = simulated[0].cost.peak, fused[0][0].cost.peak
    assert resident["total"] - g2rpo["total"] == pytest.approx(2 * trained, rel=0.05)  # old policy and base, bytes
    assert "2 forwards each" in update_row(simulated).phase
    # its rollout swaps the copy in and out in place: it holds what AWM's rollout (the same ODE, no copy) holds
    awm = plan.plan(small_args("--method", "awm", *SERIES, sde_steps=()), log=lambda m: None)[0]
    held = [next(r for r in rows if r.phase.startswith("rollout")).cost.peak["total"] - rows[0].cost.peak["total"]
            for rows in (simulated, awm)]
    assert held[0] == pytest.approx(held[1], rel=0.01)
