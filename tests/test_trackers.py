"""The experiment trackers, offline: a run of 2 iterations and a resume log to one tracker run in the run folder,
with the held-out samples as images at every evaluation and no step logged twice.

Run: python -m pytest -q tests/test_trackers.py
"""
import glob
import os
import shutil

from conftest import QUICK, run_train


def _tiny_run(flux_path, out, log_with):
    return ["--model", "flux", "--model-path", flux_path, "--output-dir", out, "--log-with", log_with,
            "--eval-every", "1", "--checkpoint-every", "1", *QUICK]


def test_tensorboard_one_run_across_a_resume(flux_path, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = str(tmp_path / "run")
    first = run_train([*_tiny_run(flux_path, out, "tensorboard"), "--num-iterations", "2"])
    assert f"tensorboard --logdir {out}/tensorboard" in first.stdout
    # a crash after iteration 2 was logged but before its checkpoint: the resume redoes iteration 2
    shutil.rmtree(os.path.join(out, "checkpoints", "iter_000002"))
    run_train([*_tiny_run(flux_path, out, "tensorboard"), "--num-iterations", "3", "--resume"])
    assert len(glob.glob(os.path.join(out, "tensorboard", "events.out.tfevents.*"))) == 2  # one folder, one run
    events = EventAccumulator(os.path.join(out, "tensorboard"), size_guidance={"images": 0, "scalars": 0}).Reload()
    for tag in ("eval/reward/shapes", "train/reward/shapes", "eval/samples"):
        values = events.Scalars(tag) if tag != "eval/samples" else events.Images(tag)
        steps = [v.step for v in values]
        expected = [0, 1, 2, 3] if tag.startswith("eval") else [1, 2, 3]
        assert steps == expected, (tag, steps)  # iteration 2's first logging was purged, none is doubled
    assert events.Images("eval/samples")[0].width > 32  # a grid of samples
    assert "config" in events.Tags()["tensors"] or "config/text_summary" in events.Tags()["tensors"]


def test_wandb_offline_one_run_across_a_resume(flux_path, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = str(tmp_path / "run")
    first = run_train([*_tiny_run(flux_path, out, "wandb"), "--num-iterations", "2"])
    run_id = open(os.path.join(out, "wandb_run_id.txt")).read().strip()
    assert f"({run_id}), offline, files in" in first.stdout
    run_train([*_tiny_run(flux_path, out, "wandb"), "--num-iterations", "3", "--resume"])
    assert open(os.path.join(out, "wandb_run_id.txt")).read().strip() == run_id
    runs = sorted(glob.glob(os.path.join(out, "wandb", "offline-run-*")))
    assert len(runs) == 2 and all(r.endswith(f"-{run_id}") for r in runs)  # both processes log to the one run
    assert not os.path.exists("wandb") or os.path.abspath("wandb") == os.path.join(out, "wandb")
    images = [glob.glob(os.path.join(r, "files", "media", "images", "eval", "*.png")) for r in runs]
    # every evaluation's samples, one file per sample: iterations 0, 1, 2 in the first process, 3 in the second
    n = len(images[1])
    assert n > 0 and len(images[0]) == 3 * n, [len(i) for i in images]
    # a garbled id file is one line before any model loads; a missing one starts a new wandb run, and says so
    with open(os.path.join(out, "wandb_run_id.txt"), "w") as f:
        f.write("not an id!\n")
    bad = run_train([*_tiny_run(flux_path, out, "wandb"), "--num-iterations", "4", "--resume"], check=False)
    assert bad.returncode == 2 and "holds no wandb run id" in bad.stderr and "Traceback" not in bad.stderr
    os.remove(os.path.join(out, "wandb_run_id.txt"))
    fresh = run_train([*_tiny_run(flux_path, out, "wandb"), "--num-iterations", "4", "--resume"])
    assert "is missing, so a new wandb run starts" in fresh.stdout
    bad = run_train([*_tiny_run(flux_path, str(tmp_path / "other"), "wandb"), "--tracker-project", "a/b"], check=False)
    assert bad.returncode == 2 and "a wandb project name cannot" in bad.stderr
