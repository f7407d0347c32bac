"""tools/plot.py: training curves from the metrics.jsonl files train.py writes."""
import json

from test_evaluate import run_main

from tools import plot


def run_plot(argv):
    return run_main(argv, plot.main)


def test_plot_of_training_curves(tmp_path):
    """Rows per iteration (eval-only at 0, a null, a repeated iteration, a line cut by a crash) -> curves, PNG."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"iteration": 0, "eval/reward/shapes": 0.5},
            {"iteration": 1, "train/reward/shapes": 0.4, "train/reward/shapes/g1": 0.4, "perf/nfe": 100},
            {"iteration": 2, "train/reward/shapes": None, "perf/nfe": 100},
            {"iteration": 2, "train/reward/shapes": 0.45, "perf/nfe": 100},  # a resume repeated iteration 2
            {"iteration": 3, "train/reward/shapes": 0.5, "eval/reward/shapes": 0.6, "perf/nfe": 100}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"iteration": 4, "tr')
    curves = plot.reward_curves(plot.read_metrics(str(run)))
    assert sorted(curves) == ["eval/reward/shapes", "train/reward/shapes"]
    assert curves["train/reward/shapes"] == ([1, 2, 3], [100, 200, 300], [0.4, 0.45, 0.5])
    assert curves["eval/reward/shapes"] == ([0, 3], [0, 300], [0.5, 0.6])
    code, stdout, stderr = run_plot([str(run), str(run), "--output-dir", str(tmp_path / "plots")])
    assert code in (0, None), stderr
    from PIL import Image

    assert Image.open(tmp_path / "plots" / "curves.png").size[0] > 800


def test_plot_says_what_it_cannot_read(tmp_path):
    empty, odd = tmp_path / "empty", tmp_path / "odd"
    empty.mkdir()
    odd.mkdir()
    (empty / "metrics.jsonl").write_text("")
    code, _, stderr = run_plot([str(empty), "--output-dir", str(tmp_path / "plots")])
    assert code == 2 and "holds no readable rows" in stderr and not (tmp_path / "plots" / "curves.png").exists()
    (odd / "metrics.jsonl").write_text('{"iteration": 1, "train/reward/shapes": "high"}\n'
                                       '{"iteration": 2, "train/reward/shapes": 0.5}\nnot json\n')
    code, stdout, stderr = run_plot([str(odd), "--output-dir", str(tmp_path / "plots")])
    assert code in (0, None), stderr
    assert "1 of the 3 rows" in stdout and (tmp_path / "plots" / "curves.png").exists()




def test_a_missing_run_is_one_error_line(tmp_path):
    code, _, stderr = run_plot(["/nonexistent/run", "--output-dir", str(tmp_path / "plots")])
    assert code == 2 and "metrics.jsonl' not found" in stderr and "Traceback" not in stderr
