"""The built-in tiny model: its pre-training cache, its prompt split, and G2RPO (and the full-SDE control) raising
the held-out reward and success rate in short runs over two seeds.

Run: python -m pytest -q tests/test_tiny.py
"""
import json
import os

import pytest

import tiny
from conftest import run_train


def test_cache_reused_and_corruption_rebuilt(tmp_path):
    logs = []
    first = tiny.ensure_pretrained(str(tmp_path / "a"), seed=3, vae_steps=2, flow_steps=2, log=logs.append)
    digest = tiny._digest(first)
    again = tiny.ensure_pretrained(str(tmp_path / "a"), seed=3, vae_steps=2, flow_steps=2, log=logs.append)
    assert again == first and "using the pre-trained model cached" in logs[-1] and tiny._digest(again) == digest
    # the same seed gives the same model in another folder
    other = tiny.ensure_pretrained(str(tmp_path / "b"), seed=3, vae_steps=2, flow_steps=2, log=logs.append)
    assert tiny._digest(other) == digest
    # a corrupted weight file is detected and rebuilt, not loaded
    weights = os.path.join(first, "transformer", "diffusion_pytorch_model.safetensors")
    with open(weights, "r+b") as f:
        f.seek(-16, os.SEEK_END)
        f.write(b"\x00" * 16)
    rebuilt = tiny.ensure_pretrained(str(tmp_path / "a"), seed=3, vae_steps=2, flow_steps=2, log=logs.append)
    assert any("fails its checksum" in line for line in logs)
    assert tiny._digest(rebuilt) == digest
    # a damaged checksum file is rebuilt as well, not a JSON traceback
    with open(os.path.join(rebuilt, "checksum.json"), "w") as f:
        f.write('{"sha256": ')
    logs.clear()
    assert tiny._digest(tiny.ensure_pretrained(str(tmp_path / "a"), seed=3, vae_steps=2, flow_steps=2,
                                               log=logs.append)) == digest
    assert any("fails its checksum" in line for line in logs)


def test_an_unwritable_cache_is_refused_before_pre_training(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(SystemExit) as exit_info:
        tiny.ensure_pretrained(str(blocker / "cache"), log=lambda m: pytest.fail(f"it started: {m}"))
    assert exit_info.value.code == 2 and "--tiny-cache" in capsys.readouterr().err


def test_prompt_sets_are_disjoint_and_shipped():
    train, held = tiny.prompt_split()
    assert len(train) == 36 and len(held) == 12 and not set(train) & set(held)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert open(os.path.join(root, "prompts", "tiny_train.txt")).read().split("\n")[:-1] == train
    assert open(os.path.join(root, "prompts", "tiny_eval.txt")).read().split("\n")[:-1] == held
    # every pair of attributes of a held-out prompt is trained (a Latin square), so it is new only as a triple: its
    # colour and shape in 3 halves, its shape and half with 3 colours, its colour and half with the 2 other shapes
    trained = lambda pair: sum(set(pair) <= set(tiny.parse(p)) for p in train)
    for c, s, h in map(tiny.parse, held):
        assert (trained((c, s)), trained((s, h)), trained((c, h))) == (3, 3, 2), (c, s, h)
    count = lambda names, k: sorted(sum(tiny.parse(p)[k] == n for p in held) for n in names)
    assert count(tiny.COLOURS, 0) == [3] * 4 and count(tiny.SHAPES, 1) == [4] * 3
    assert count(tiny.POSITIONS, 2) == [3] * 4


def test_the_summary_line_places_a_run_against_every_measured_range():
    # the quick start's ranges on two machines (0.516-0.640 and 0.573-0.708): within means inside their span
    line = tiny.quick_start_standing(0.6, [])
    assert line.startswith("this run ended at 0.600;") and "0.516-0.640 and 0.573-0.708" in line
    assert line.endswith("within those ranges")
    assert tiny.quick_start_standing(0.70, []).endswith("within those ranges")  # inside the second machine's alone
    assert tiny.quick_start_standing(0.40, []).endswith("below those ranges")
    assert tiny.quick_start_standing(0.75, []).endswith("above those ranges")
    assert "for reference only" in tiny.quick_start_standing(0.6, ["--lr"])


SHORT = ["--num-iterations", "12", "--eval-every", "12", "--prompts-per-iteration", "8", "--checkpoint-every", "1000",
         "--final-eval-seeds", "8"]


@pytest.mark.parametrize("sampling", ["g2rpo", "full"])
def test_short_runs_improve_held_out_reward_and_success(sampling, tiny_cache, tmp_path):
    gains, rises = [], []
    for seed in range(2 if sampling == "g2rpo" else 1):  # the control on one seed (the bench compares it on eight)
        out = str(tmp_path / f"s{seed}")
        run_train(["--model", "tiny", "--tiny-cache", tiny_cache, "--sampling", sampling, "--seed", str(seed),
                   "--output-dir", out, *SHORT])
        rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
        evals = [r["eval/reward/shapes"] for r in rows if "eval/reward/shapes" in r]
        gains.append(evals[-1] - evals[0])
        success = [r["eval/success/shapes"] for r in rows if "eval/success/shapes" in r]  # the strict pass rate
        assert len(success) == len(evals) and all(0 <= s <= 1 for s in success)
        rises.append(success[-1] - success[0])
    # measured on 2 cores, seeds 0, 1 (the held-out reward starts at 0.537, the success rate at 0.281 of 96 images,
    # standard error 0.05): g2rpo reward +0.066 +0.048, success +0.104 +0.094; full SDE (seed 0) +0.042, +0.156
    floor, mean = {"g2rpo": (0.03, 0.04), "full": (0.01, 0.02)}[sampling]
    assert min(gains) > floor, gains  # every seed improves, by a margin
    assert sum(gains) / len(gains) > mean, gains
    assert min(rises) > 0.04 and sum(rises) / len(rises) > 0.08, rises  # and passes more held-out images
