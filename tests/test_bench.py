"""tools/bench.py --quick runs every part and its numbers are consistent; part 3's statistics on hand-made numbers,
its rows and their iterations.

Run: python -m pytest -q tests/test_bench.py
"""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from lab import tiny
from conftest import run_train
from tools import bench


def test_bench_quick(tiny_cache, tmp_path, capsys):
    out = bench.main(bench.Args(quick=True, tiny_cache=tiny_cache, output_dir=str(tmp_path)))
    rows = {(r[0], r[1]): r for r in out["rollout_cost"]}
    ref = rows[("G2RPO reference code", "G 12, N 16, M 0..7, Lambda {1, 2}")]
    ours = rows[("G2RPO, this project", "G 12, N 16, M 0..7, Lambda {1, 2}")]
    assert (ref[2], ref[3], ours[2]) == (1792, 1792, 1504) and ours[3] < 40
    # each recipe at its peer's published settings: DanceGRPO 192 NFE and 12 x 9 training forwards, Flow-GRPO 144
    # and 24 x 5, MixGRPO 300 (one shared step, then 12 members x 24) and 12 x 4
    recipes = {r[0]: (r[2], r[4]) for r in out["rollout_cost"] if r[0].startswith("--method")}
    assert recipes["--method dancegrpo"] == (192, 108) and recipes["--method flow-grpo"] == (144, 120)
    assert recipes["--method mixgrpo"] == (300, 48)
    # BranchGRPO's tree of 16 leaves: 203 forwards and 218 edges trained; Flow-DPPO's 16 trajectories, 3 trained steps
    assert recipes["--method branchgrpo"] == (203, 218) and recipes["--method flow-dppo"] == (160, 48)
    speed = out["speed"]
    assert speed["batched"]["nfe"] < speed["reference"]["nfe"]
    assert speed["batched"]["sampling"] < speed["reference"]["sampling"]
    table = out["learning"]
    assert list(table) == [*bench.HEADLINE, *bench.CONTROLS]  # the peers' rows: under --peers
    assert all(0 <= row["success"][0] <= 1 for row in table.values())
    assert all("gap" in row for name, row in table.items() if name != bench.G2RPO_ROW)
    assert (tmp_path / "quick" / "learning_per_compute.png").exists()
    printed = capsys.readouterr().out
    assert "## 1." in printed and "## 2." in printed and "## 3." in printed and "headline half-widths" in printed
    # each row's compute beside its result, and where its values come from
    assert all(row["update_nfe"] > 0 and row["run_s"] > 0 for name, row in table.items() if name != bench.NO_LEARNING)
    assert "| G2RPO {1,2,3} | G2RPO's tiny preset |" in printed and "hours at --jobs" in printed
    # a second bench in the same folder keeps every finished run
    bench.main(bench.Args(quick=True, tiny_cache=tiny_cache, output_dir=str(tmp_path), parts=(3,)))
    assert f"{2 * (len(table) - 1)} already finished; running 0" in capsys.readouterr().out  # lr 0: no runs


def test_the_base_model_is_measured_once(tiny_cache, tmp_path):
    """The bench takes the no-learning row from the base model's evaluation, and gives every run but the first a
    12-image evaluation before training: both rest on facts checked here on real runs. lr 0 leaves every weight
    where it was, and the size of the first evaluation does not move the training (it draws its own noise)."""
    common = ["--model", "tiny", "--tiny-cache", tiny_cache, "--num-iterations", "2", "--prompts-per-iteration", "2",
              "--group-size", "4", "--eval-every", "100", "--eval-seeds", "1", "--final-eval-seeds", "2",
              "--checkpoint-every", "100"]
    final = lambda out: load_file(os.path.join(out, "checkpoints", "iter_000002", "transformer",
                                               "diffusion_pytorch_model.safetensors"))
    outs = {name: str(tmp_path / name) for name in ("frozen", "measured", "skipped")}
    for name, extra in [("frozen", ["--lr", "0", "--weight-decay", "0.1"]), ("measured", []),
                        ("skipped", ["--first-eval-seeds", "1"])]:
        run_train([*common, *extra, "--output-dir", outs[name]])
    base = load_file(os.path.join(tiny.ensure_pretrained(tiny_cache, log=lambda m: None), "transformer",
                                  "diffusion_pytorch_model.safetensors"))
    frozen, measured, skipped = final(outs["frozen"]), final(outs["measured"]), final(outs["skipped"])
    assert base.keys() == frozen.keys() and all(torch.equal(base[k], frozen[k]) for k in base)
    assert any(not torch.equal(base[k], measured[k]) for k in base)  # lr 1e-4 moved them
    assert all(torch.equal(measured[k], skipped[k]) for k in measured)
    scores = lambda out: [(r["eval/reward/shapes"], r["eval/heldout/shapes-strict"]) for r in map(
        json.loads, open(os.path.join(out, "metrics.jsonl"))) if "eval/reward/shapes" in r]  # (first, last)
    assert scores(outs["frozen"])[0] == scores(outs["frozen"])[1] == scores(outs["measured"])[0]  # 24 images each
    assert scores(outs["skipped"])[0][0] != scores(outs["measured"])[0][0]  # 12 of them


def test_intervals_on_hand_made_numbers():
    # mean 2, sample std sqrt(2 / 3) over 4 values: half-width t(0.975, 3) std / sqrt(4)
    mean, half = bench.interval([1.0, 2.0, 3.0, 2.0])
    assert abs(mean - 2) < 1e-12 and abs(half - 3.182 * (2 / 3) ** 0.5 / 2) < 1e-9
    # paired on seeds: the seed-to-seed spread shared by both methods cancels
    a, b = [0.30, 0.50, 0.70, 0.40], [0.25, 0.46, 0.64, 0.36]
    gap, half = bench.gap_interval(a, b, paired=True)
    assert abs(gap - 0.0475) < 1e-12 and abs(half - 3.182 * 0.0095743 / 2) < 1e-6  # differences 0.05 0.04 0.06 0.04
    unpaired_gap, unpaired_half = bench.gap_interval(a, b, paired=False)
    assert abs(unpaired_gap - gap) < 1e-12 and unpaired_half > 10 * half
    assert bench.t975(1) == 12.706 and bench.t975(23.7) == 2.074 and bench.t975(1000) == 1.96
    # the seeds a gap needs for a half-width of 0.05: sd = h sqrt(n) / t(n - 1), then the first n with t sd / sqrt(n)
    # <= 0.05 (8 seeds at 0.111: sd 0.111 sqrt(8) / 2.365 = 0.1328; 29 seeds give 2.048 x 0.1328 / sqrt(29) = 0.0505,
    # 30 seeds 0.0496)
    assert bench.seeds_for(0.111, 8) == 30 and bench.seeds_for(0.04, 5) is None


def test_the_budget_counts_the_runs_own_flags():
    # each row's iterations follow its rollout NFE under the run's own flags, --extra included: G2RPO (N 8, M 0..3,
    # Lambda {1, 2, 3}) costs the anchor's 8 forwards a prompt plus 27 a member, full SDE G N a prompt
    tiny = ["--model", "tiny", "--prompts-per-iteration", "2"]
    assert bench._nfe_per_iteration([*tiny, "--group-size", "4"]) == 2 * (8 + 4 * 27)
    assert bench._nfe_per_iteration([*tiny, "--group-size", "4", "--method", "full-sde"]) == 2 * 4 * 8
    # MixGRPO's window (up to 2 SDE steps, never the last step) starts at step f = 0..5, f + G (N - f) forwards a
    # prompt, then one iteration without a window (N): the mean over that cycle. Flow-GRPO-Fast's random window costs
    # G N a prompt at every draw (as part 1 counts at its published sizes, 24 x 6)
    cycle = [2 * (f + 4 * (8 - f)) for f in range(6)] + [2 * 8]
    assert bench._nfe_per_iteration([*tiny, "--group-size", "4", "--method", "mixgrpo"]) == sum(cycle) // len(cycle)
    assert bench._nfe_per_iteration([*tiny, "--group-size", "4", "--method", "flow-grpo-fast"]) == 2 * 4 * 8
    args = bench.Args(budget_nfe=3000, seeds=1, prompts_per_iteration=2, extra=("--group-size", "4"),
                      methods=("full SDE, same M",))
    iterations = {name: int(argv[argv.index("--num-iterations") + 1]) for name, _, argv, _ in bench.bench_runs(args)}
    assert iterations == {"G2RPO {1,2,3}": 3000 // 232, "full SDE, same M": 3000 // 64}


def test_the_series_rows_count_their_extra_forwards():
    """Part 1 and the budget count AdaGRPO's pool of anchors (N forwards a candidate) and Pave-GRPO's sub-steps."""
    rows = {r[0]: r for r in bench.part1()}
    g2rpo = bench.recipe_cost("pavegrpo")  # the same rollout as AdaGRPO's at --model flux, but eta
    assert rows["--method adagrpo"][2] == g2rpo[2] + 10 * 16 and rows["--method pavegrpo"][4] == 4 * (1 + 1 + 2)
    tiny = ["--model", "tiny", "--prompts-per-iteration", "4"]
    assert bench._nfe_per_iteration([*tiny, "--method", "adagrpo"]) == bench._nfe_per_iteration(tiny) + 10 * 8 * 4
    assert {"Pave-GRPO", "AdaGRPO"} <= set(bench.PEERS)


def test_the_default_rows_and_the_peers():
    # the paper's two claims and the controls; the peers' recipes under --peers, or named in --methods
    assert bench.chosen_rows(bench.Args()) == [*bench.HEADLINE, *bench.CONTROLS]
    assert bench.chosen_rows(bench.Args(peers=True)) == list(bench.METHODS)
    assert bench.chosen_rows(bench.Args(methods=("DanceGRPO",))) == [bench.G2RPO_ROW, "DanceGRPO"]
    assert bench.chosen_rows(bench.Args(methods=(bench.NO_LEARNING,), peers=True)) == [
        bench.G2RPO_ROW, *bench.PEERS, bench.NO_LEARNING]
    # every row: every registered method's among them, each row saying where its values come from
    assert bench.chosen_rows(bench.Args(methods=("all",))) == list(bench.METHODS)
    method_of = lambda argv: bench.flags.parse_args(["--model", "tiny", *argv]).method
    assert {method_of(argv) for argv in bench.METHODS.values()} == set(bench.METHOD_CLASSES)
    assert bench.values_from("DanceGRPO").startswith("its authors' (eta 0.3") and bench.values_from(
        bench.NO_LEARNING) == "G2RPO's tiny preset; --lr 0"
    assert bench.values_from("full SDE, same M").startswith("the paper's ablation")  # G2RPO's own, not a peer's


def test_a_stopped_run_is_never_reported(tmp_path):
    """train.py exits 0 from a graceful stop: the bench counts a run only if its metrics reach its last iteration,
    and a damaged marker or a cut line means it runs again."""
    argv = ["--model", "tiny", "--num-iterations", "4", "--output-dir", str(tmp_path)]
    (tmp_path / "bench_run.json").write_text(json.dumps({"argv": argv}))
    rows = [{"iteration": i} for i in range(3)]  # stopped after iteration 2 of 4
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert not bench._finished(argv, str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + [{"iteration": 4}]))
    assert bench._finished(argv, str(tmp_path))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 5, "perf/n')  # cut short
    assert not bench._finished(argv, str(tmp_path))
    (tmp_path / "bench_run.json").write_text("{not json")
    assert not bench._finished(argv, str(tmp_path))


def test_the_bench_checks_its_own_flags(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("")
    for args, words in [(bench.Args(parts=(4,)), "--parts"), (bench.Args(seeds=0), "--seeds 0"),
                        (bench.Args(jobs=-1), "--jobs -1"), (bench.Args(budget_nfe=1), "--budget-nfe 1"),
                        (bench.Args(output_dir=str(a_file)), "is a file")]:
        with pytest.raises(SystemExit) as exit_info:
            bench.main(args)
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and words in err and "\n" not in err, err
    parsed = bench.parse(["--extra", "--max-batch", "64", "--seeds", "2"])  # as --help shows it
    assert parsed.extra == ("--max-batch", "64") and parsed.seeds == 2
    parsed = bench.parse(["--extra", "--lr", "0", "--seeds", "2", "--extra=--max-batch", "64"])  # repeated: joined
    assert parsed.extra == ("--lr", "0", "--max-batch", "64") and parsed.seeds == 2
