"""The reward-hacking watch (lab/watch.py): its statistics on hand-made images and its verdict on hand-made metric
series.

Run: python -m pytest -q tests/test_watch.py     (a few seconds)
"""
import torch
import torch.nn.functional as F

from lab.watch import Limits, check, diversity, grid_energy, saturation


def smooth(n=2, size=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return F.interpolate(torch.rand(n, 3, 4, 4, generator=g) * 0.6 + 0.2, size=size, mode="bilinear",
                         align_corners=False)


def test_a_checkerboard_at_the_patch_period_is_all_grid_energy():
    y = torch.arange(64)
    board = ((y[:, None] // 8 + y[None, :] // 8) % 2).float().expand(1, 3, 64, 64)  # a 16-pixel period
    assert float(grid_energy(board, 16)) == 1.0
    # a smooth image keeps a few percent of its power there, and one with the board faintly added far more
    base = smooth()
    assert float(grid_energy(base, 16).max()) < 0.05
    assert float(grid_energy(base + 0.1 * board, 16).min()) > 0.15
    assert float(grid_energy(board, 48).max()) == 0.0  # a period that does not divide the image: no verdict


def test_saturation_counts_clipped_values():
    assert saturation(smooth()).tolist() == [0.0, 0.0]
    blown = smooth().clone()
    blown[0, :, :32] = 1.0  # the top half white
    blown[1, 0] = 0.0  # one channel black
    torch.testing.assert_close(saturation(blown), torch.tensor([0.5, 1 / 3]))


def test_identical_seeds_have_no_diversity():
    images = torch.cat([smooth(1, seed=0)] * 3 + [smooth(1, seed=1), smooth(1, seed=2)])
    prompt_of = torch.tensor([0, 0, 0, 1, 1])
    got = diversity(images, prompt_of)
    assert got[0] == 0.0 and got[1] > 0.01
    expected = (images[3] - images[4]).pow(2).mean().sqrt()
    torch.testing.assert_close(got[1], expected)


def evaluation(trained, held_out, stats=None, se=0.01):
    """The eval metrics of one evaluation: a trained reward, a held-out one, statistics; every standard error `se`."""
    m = {"eval/reward/area": trained, "eval/reward_se/area": se, "eval/heldout/shapes": held_out,
         "eval/heldout_se/shapes": se}
    for name, value in (stats or {}).items():
        m[f"eval/stats/{name}"], m[f"eval/stats_se/{name}"] = value, 0.001
    return m


def test_the_watch_fires_on_a_rise_with_a_fall_and_not_otherwise():
    limits = Limits()
    first = evaluation(0.40, 0.55, {"saturation": 0.01, "grid": 0.03, "diversity": 0.20})
    # the trained reward up 10 SE, the held-out one down 7: it fires, naming both
    reasons, metrics = check(first, evaluation(0.54, 0.45, {"saturation": 0.01, "grid": 0.03, "diversity": 0.2}),
                             limits)
    assert len(reasons) == 1 and "area rose 0.4000 -> 0.5400" in reasons[0] and "shapes fell" in reasons[0]
    assert metrics["watch/fired"] == 1.0 and round(metrics["watch/trained_z/area"], 1) == 9.9
    # both up (honest learning), or the trained one within noise: silent
    for now in (evaluation(0.54, 0.60), evaluation(0.42, 0.45)):
        assert check(first, now, limits)[0] == []
    # a statistic past its limit while the trained reward rises: fires; within its limit: silent
    for stats, fires in (({"saturation": 0.10}, True), ({"grid": 0.07}, True), ({"diversity": 0.05}, True),
                         ({"saturation": 0.05, "grid": 0.05, "diversity": 0.15}, False)):
        reasons, _ = check(first, evaluation(0.54, 0.56, {"saturation": 0.01, "grid": 0.03, "diversity": 0.2,
                                                          **stats}), limits)
        assert bool(reasons) == fires, stats


def test_held_out_rewards_are_checked_with_the_flags(capsys):
    import pytest

    from lab import flags

    for argv, words in [(["--eval-rewards", "shapes"], "is trained on"),
                        (["--eval-rewards", "nope"], "--eval-rewards: unknown reward"),
                        (["--eval-rewards", "colour-area=2"], "names without weights"),
                        (["--watch-diversity", "1.5"], "in (0, 1)")]:
        with pytest.raises(SystemExit):
            flags.check_flags(flags.parse_args(["--model", "tiny", *argv]), world=1)
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1, (argv, err)
    assert flags.preset("flux")["eval_rewards"] == ["clip", "pickscore"]  # the paper's other columns
    # the paper's HPS + CLIP run: the preset's held-out rewards leave out the trained clip
    assert flags.parse_args(["--model", "flux", "--rewards", "hps=1.0", "clip=1.0"]).eval_rewards == ["pickscore"]
    # the tiny world's strict pass is held out; so is its smooth reward when a run trains on another
    assert flags.parse_args(["--model", "tiny"]).eval_rewards == ["shapes-strict"]
    assert flags.parse_args(["--model", "tiny", "--rewards", "colour-area=1.0"]).eval_rewards == ["shapes",
                                                                                                   "shapes-strict"]


def test_a_run_logs_its_held_out_rewards_and_statistics_and_evaluate_shows_them(tiny_cache, tmp_path):
    """A tiny run trained on shapes and watched with the hackable colour-area: eval/heldout/colour-area and the
    statistics in metrics.jsonl, and evaluate.py's table has the held-out column beside the trained one."""
    import json
    import os

    from conftest import run_train
    from test_baselines import SMALL
    from test_evaluate import run_main

    out = str(tmp_path / "run")
    run_train([*SMALL, "--tiny-cache", tiny_cache, "--eval-rewards", "colour-area", "shapes-strict",
               "--output-dir", out, "--num-iterations", "1", "--eval-seeds", "2", "--final-eval-seeds", "2",
               "--eval-prompts", "3"])
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    for row in rows:  # the first evaluation and the last
        assert {"eval/reward/shapes", "eval/heldout/colour-area", "eval/heldout_se/colour-area",
                "eval/heldout/shapes-strict", "eval/stats/saturation", "eval/stats/grid",
                "eval/stats/diversity"} <= set(row)
        assert 0 <= row["eval/stats/saturation"] <= 1 and row["eval/stats/diversity"] > 0
    assert "watch/fired" in rows[-1] and "watch/trained_z/shapes" in rows[-1]
    code, stdout, stderr = run_main(["--checkpoint", out, "--num-prompts", "2", "--seeds", "1",
                                     "--output-dir", str(tmp_path / "eval")])
    assert code in (0, None), stderr
    header = next(line for line in stdout.splitlines() if line.startswith("|"))
    assert header == "| model | shapes | shapes-strict | colour-area |", header


def test_a_held_out_reward_without_its_weights_is_one_line(tiny_cache, tmp_path):
    from conftest import run_train
    from test_baselines import SMALL

    proc = run_train([*SMALL, "--tiny-cache", tiny_cache, "--eval-rewards", "hps", "--hps-checkpoint",
                      str(tmp_path / "missing.pt"), "--output-dir", str(tmp_path / "run"), "--num-iterations", "1"],
                     check=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and err[-1].startswith("error: --eval-rewards: the HPS-v2.1 checkpoint not found"), err
