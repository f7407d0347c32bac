"""tools/bench.py --quick runs every part and its numbers are consistent; part 3's statistics on hand-made numbers,
its rows and their iterations at either budget, its refusals, its stop on a signal; the figures tools/plot.py draws
from a bench folder, and the colours of its run curves.

Run: python -m pytest -q tests/test_bench.py
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from lab import tiny
from conftest import ROOT, run_train
from test_evaluate import run_main
from tools import bench, plot


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
    # a damaged line in the middle, the last one whole: unfinished too (it ran again), never a JSONDecodeError
    lines = [json.dumps(r) for r in rows] + ["{damaged", json.dumps({"iteration": 4})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert not bench._finished(argv, str(tmp_path)) and bench._read_curve(str(tmp_path)) == []
    (tmp_path / "bench_run.json").write_text("{not json")
    assert not bench._finished(argv, str(tmp_path))


def test_the_bench_checks_its_own_flags(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("")
    for args, words in [(bench.Args(parts=(4,)), "--parts"), (bench.Args(seeds=0), "--seeds 0"),
                        (bench.Args(jobs=-1), "--jobs -1"), (bench.Args(budget_nfe=1), "--budget-nfe 1"),
                        (bench.Args(budget="flops"), "--budget flops"),
                        (bench.Args(budget_forwards=9000), "add --budget total-forwards"),
                        (bench.Args(output_dir=str(a_file)), "is a file")]:
        with pytest.raises(SystemExit) as exit_info:
            bench.main(args)
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and words in err and "\n" not in err, err
    parsed = bench.parse(["--extra", "--max-batch", "64", "--seeds", "2"])  # as --help shows it
    assert parsed.extra == ("--max-batch", "64") and parsed.seeds == 2
    parsed = bench.parse(["--extra", "--lr", "0", "--seeds", "2", "--extra=--max-batch", "64"])  # repeated: joined
    assert parsed.extra == ("--lr", "0", "--max-batch", "64") and parsed.seeds == 2


@pytest.mark.parametrize("argv, words", [
    (["--methods", "G2RPO {1,2,3}", "--extra", "--method", "awm"], "--extra --method: the bench sets it on every run; "
                                                                    "choose the rows with the bench's --methods"),
    (["--extra", "--seed", "7", "--num-iterations", "50"], "--extra --seed: the bench sets it on every run; use the "
                                                            "bench's --seeds"),
    (["--extra", "--num_iterations=50"], "the bench's --budget-nfe"),
    (["--extra", "--eval-every", "3"], "--extra --eval-every: the bench sets it"),
    (["--extra", "--no-overwrite"], "--extra --no-overwrite: the bench sets it"),
    (["--methods", "G2RPO {1}", "--extra", "--granularities", "2"], "the row 'G2RPO {1}' sets it itself"),
    (["--extra", "--step-credit", "mean"], "the row 'control: step credit destroyed' sets it itself"),
    (["--methods", "bogus"], "--methods 'bogus': no such row"),
    (["--extra", "--bogus", "1"], "unknown flag --bogus"),  # train.py's own refusal, before anything runs
])
def test_the_bench_refuses_what_it_sets_itself(argv, words, tmp_path, capsys):
    """An --extra flag the bench sets on its runs (a row's own among them) and an unknown row are refused in one line
    before anything runs or any folder is made: they were overridden, ran another method, or stopped the bench
    after parts 1 and 2."""
    out = tmp_path / "bench"
    with pytest.raises(SystemExit) as exit_info:
        bench.main(bench.parse([*argv, "--output-dir", str(out)]))
    printed = capsys.readouterr()
    assert exit_info.value.code == 2 and words in printed.err and printed.err.count("\n") == 1, printed.err
    assert printed.out == "" and not out.exists()


def test_the_bench_takes_the_extra_flags_it_does_not_set():
    # lr: no running row sets it (no learning's row never runs: the base model's evaluation stands for it)
    bench.check(bench.parse(["--extra", "--lr", "3e-4", "--max-batch", "64"]))
    bench.check(bench.parse(["--methods", "G2RPO {1,2,3}", "--extra", "--granularities", "1", "2"]))


def test_a_killed_run_is_reported_by_its_signal(tmp_path, monkeypatch):
    """A run the OOM killer ends (SIGKILL) is reported by its signal, not by its last progress bars."""
    monkeypatch.setattr(bench, "_train_command", lambda argv: [
        sys.executable, "-c", "import os, signal, sys; sys.stderr.write('50%|#####  | 4/8'); "
                              "os.kill(os.getpid(), signal.SIGKILL)"])
    run = ("G2RPO {1,2,3}", 0, ["--model", "tiny", "--num-iterations", "2", "--output-dir", str(tmp_path)],
           str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        bench._run_all([run], jobs=1)
    message = str(exit_info.value.code)
    assert message.startswith("error: G2RPO {1,2,3} seed 0 was killed by signal 9 (SIGKILL: out of memory?)")
    assert "\n" not in message and "4/8" not in message


def test_a_signal_stops_the_bench(tiny_cache, tmp_path):
    """Ctrl-C (SIGINT to the bench's process group, as a terminal sends it) with a run in flight and one queued: the
    run in flight stops on its own signal, the queued one never starts, one line says what is kept and how to go
    on, and the bench exits 130 (no KeyboardInterrupt traceback)."""
    cmd = [sys.executable, "-m", "tools.bench", "--parts", "3", "--jobs", "1", "--seeds", "2", "--budget-nfe", "4096",
           "--eval-seeds", "1", "--final-eval-seeds", "1", "--prompts-per-iteration", "2", "--methods", bench.G2RPO_ROW,
           "--tiny-cache", tiny_cache, "--output-dir", str(tmp_path), "--extra", "--group-size", "4",
           "--eval-prompts", "4"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    first = tmp_path / "G2RPO__1_2_3_s0"
    started = time.time()
    while not (first / "metrics.jsonl").exists() and proc.poll() is None and time.time() - started < 300:
        time.sleep(0.1)  # the first run is training (its signals are its own from here)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr
    assert stderr.startswith("stopped by SIGINT: 0 of 2 runs are finished") and stderr.count("\n") == 1, stderr
    assert "1 stopped in flight, 1 not started); rerun the same command" in stderr
    assert sorted(os.listdir(tmp_path)) == [first.name]  # the queued run never started


def test_what_quick_sets_and_what_the_runs_spend():
    """--quick says which flags it replaces, and the header says what the runs spend: every row at its floor of 2
    iterations, G2RPO's 2 x 232 NFE, above the 128 of the budget."""
    args = bench.Args(quick=True, seeds=5, jobs=8)
    said = bench.apply_quick(args)
    assert "--seeds 2" in said and "--jobs 0" in said and "--budget-nfe 128" in said and args.seeds == 2
    header = bench.part3_header(args, bench.row_plan(args))
    assert "128 rollout NFE each; the runs spend 128 to 464" in header


def test_the_total_forwards_budget():
    """--budget total-forwards gives every row the iterations of the same rollout NFE + 3 x update forwards; by
    default G2RPO's total at --budget-nfe (so G2RPO's runs train as at the rollout budget), in folders of their own."""
    small = dict(budget_nfe=3000, seeds=1, prompts_per_iteration=2, extra=("--group-size", "4"),
                 methods=("full SDE, same M",))
    rows, budget = bench.row_plan(bench.Args(budget="total-forwards", **small))
    # G2RPO: 232 rollout NFE and 8 update forwards an iteration (a start latent a prompt and trained step), 12
    # iterations at 3,000 NFE; full SDE: 64 and 32 (a start latent a member), 160 in all
    assert budget == 12 * (232 + 3 * 8) and rows == {bench.G2RPO_ROW: (12, 232, 8), "full SDE, same M": (19, 64, 32)}
    runs = bench.bench_runs(bench.Args(budget="total-forwards", **small))
    same = bench.bench_runs(bench.Args(**small))
    assert [os.path.basename(out) for *_, out in runs] == ["forwards_G2RPO__1_2_3_s0", "forwards_full_SDE__same_M_s0"]
    assert runs[0][2][:-1] == same[0][2][:-1]  # G2RPO: the same run at either budget, but its folder
    given = bench.row_plan(bench.Args(budget="total-forwards", budget_forwards=10_000, **small))
    assert given[1] == 10_000 and given[0]["full SDE, same M"][0] == 10_000 // 160
    # at the tiny defaults, 80,000 rollout NFE: update forwards differ by two orders of magnitude between methods
    rows, budget = bench.row_plan(bench.Args(budget="total-forwards", methods=("DiffusionNFT", "AWM")))
    assert budget == 89 * (896 + 3 * 16) == 84_016
    spent = {name: (iters, iters * update) for name, (iters, nfe, update) in
             bench.row_plan(bench.Args(methods=("DiffusionNFT", "AWM")))[0].items()}
    assert spent == {bench.G2RPO_ROW: (89, 1424), "DiffusionNFT": (312, 209_664), "AWM": (312, 179_712)}
    assert {name: iters for name, (iters, _, _) in rows.items()} == {
        bench.G2RPO_ROW: 89, "DiffusionNFT": 84_016 // (256 + 3 * 672), "AWM": 84_016 // (256 + 3 * 576)}


def _hand_made_curves(seeds=2):
    """Part 3's curves for the default rows, as part3 builds them: each run's (NFE, wall s, success, reward, s.e.,
    update forwards) at its evaluations, from the base model's."""
    base = (0, 0.0, 0.40, 0.55, 0.02, 0)
    curves = {}
    for k, name in enumerate(bench.chosen_rows(bench.Args())):
        curves[name] = [[base, *[(nfe, nfe / 100, 0.40 + 0.02 * step * (k + seed + 1), 0.55 + 0.005 * step * (k - seed),
                                  0.02, 16 * step) for step, nfe in enumerate((896, 1792, 2688), 1)]]
                        for seed in range(seeds)]
    curves[bench.NO_LEARNING] = [[base]] * seeds
    return curves


def test_one_seed_judges_no_control(capsys):
    """At --seeds 1 no gap has an interval: the controls are said to be unjudged, never failed."""
    bench.report(_hand_made_curves(seeds=1), bench.Args(seeds=1))
    printed = capsys.readouterr().out
    assert "FAILS" not in printed and "control: no learning (lr 0): cannot be judged at 1 training seed" in printed
    assert "| n/a |" in printed and "(above the 0.05 target)" not in printed


def test_the_bench_figures(tmp_path, capsys):
    """The table's total forwards (rollout + 3 x update), then tools/plot.py's forest plot and learning curves from a
    bench folder holding both budgets' results, as part 3 writes them."""
    curves = _hand_made_curves()
    for budget, total in (("rollout-nfe", 2688), ("total-forwards", 2688 + 3 * 48)):
        args = bench.Args(budget=budget, seeds=2, output_dir=str(tmp_path))
        table = bench.report(curves, args)
        assert table["G2RPO {1}"]["total_forwards"] == 2688 + 3 * 48
        bench.write_results(curves, table, args, total)
    assert "| total forwards |" in capsys.readouterr().out
    code, stdout, stderr = run_main([str(tmp_path)], plot.main)
    assert code in (0, None), stderr
    for name in ("gaps_to_g2rpo", "learning_curves", "learning_curves_total_forwards"):
        path = tmp_path / f"{name}.png"
        assert f"wrote {path}" in stdout and path.stat().st_size > 10_000
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_curve_is_drawn_in_the_watch_red(tmp_path):
    """tools/plot.py keeps red for the evaluations where the reward-hacking watch fired: ten curves, none red."""
    run = tmp_path / "run"
    run.mkdir()
    names = [f"r{i}" for i in range(5)]
    rows = [{"iteration": i, "perf/nfe": 10, **{f"train/reward/{n}": 0.1 * i for n in names},
             **{f"eval/reward/{n}": 0.1 * i for n in names}, "watch/fired": i == 2} for i in range(1, 4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import matplotlib.colors

    red = {matplotlib.colors.to_rgb(c) for c in ("red", "tab:red")}
    fig = plot.draw_runs([str(run)])
    lines = [line for axis in fig.axes for line in axis.get_lines()]
    assert len(lines) == 2 * 10 + 1  # ten curves in each panel, and the watch's line
    assert [matplotlib.colors.to_rgb(line.get_color()) in red for line in lines].count(True) == 1
