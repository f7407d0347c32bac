"""bench.py --quick runs every part and its numbers are consistent.

Run: python -m pytest -q tests/test_bench.py
"""
import bench


def test_bench_quick(tiny_cache, tmp_path, capsys):
    out = bench.main(bench.Args(quick=True, tiny_cache=tiny_cache, output_dir=str(tmp_path)))
    rows = {(r[0], r[1]): r for r in out["rollout_cost"]}
    ref = rows[("G2RPO reference code", "G 12, N 16, M 0..7, Lambda {1, 2}")]
    ours = rows[("G2RPO, this project", "G 12, N 16, M 0..7, Lambda {1, 2}")]
    assert (ref[2], ref[3], ours[2]) == (1792, 1792, 1504) and ours[3] < 40
    speed = out["speed"]
    assert speed["batched"]["nfe"] < speed["reference"]["nfe"]
    assert speed["batched"]["sampling"] < speed["reference"]["sampling"]
    assert set(out["learning"]) == set(bench.METHODS)
    assert (tmp_path / "quick" / "learning_per_compute.png").exists()
    printed = capsys.readouterr().out
    assert "## 1." in printed and "## 2." in printed and "## 3." in printed
