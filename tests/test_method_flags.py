"""A method's own flags, checked before anything loads: every float flag of every method must be finite (one rule,
lab/flags.py's `non_finite_problem`, unless the method's `non_finite` allows it), the ranges each method checks in
its `problem`, refused in one `error:` line with exit code 2 by train.py and tools/plan.py alike, and the advice
of each refusal, taken as given, runs.

Run: python -m pytest -q tests/test_method_flags.py
"""
import re
import typing

import pytest

from conftest import run_train
from lab import flags
from methods import METHODS

TINY = ["--model", "tiny"]
# the refusals that came through before: (method, flags, the flag the line names)
LEAKS = [("diffusionnft", ["--nft-decay-rate", "nan"], "--nft-decay-rate"),
         ("diffusionnft", ["--nft-beta", "inf"], "--nft-beta"),
         ("diffusionnft", ["--time-micro-batch", "0"], "--time-micro-batch"),
         ("diffusionnft", ["--time-sampling", "discrete", "--time-micro-batch", "0"], "--time-micro-batch"),
         ("awm", ["--ema-kl-beta", "nan"], "--ema-kl-beta"),
         ("awm", ["--ema-anchor-rate", "inf"], "--ema-anchor-rate"),
         ("flow-dppo", ["--kl-mask-threshold", "nan"], "--kl-mask-threshold"),
         ("flow-dppo", ["--kl-guidance", "inf"], "--kl-guidance"),
         ("branchgrpo", ["--split-noise-scale", "nan"], "--split-noise-scale"),
         ("branchgrpo", ["--split-noise-scale", "inf"], "--split-noise-scale"),
         ("branchgrpo", ["--depth-pruning-stop", "-1"], "--depth-pruning-stop")]


def refusal(method, argv, capsys):
    """The one line check_flags refuses `--model tiny --method method argv` with (exit code 2)."""
    with pytest.raises(SystemExit) as exit_info:
        flags.check_flags(flags.parse_args([*TINY, "--method", method, *argv]), world=1)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), (argv, err)
    return err


def runs(method, argv, model="tiny"):
    """Whether check_flags accepts the flags (raises SystemExit where it refuses them)."""
    flags.check_flags(flags.parse_args(["--model", model, "--method", method, *argv]), world=1, log=lambda *a: None)
    return True


@pytest.mark.parametrize("method, argv, name", LEAKS)
def test_each_leak_is_refused_in_one_line_naming_its_flag(method, argv, name, capsys):
    err = refusal(method, argv, capsys)
    assert re.search(rf"{name} \S+: must be", err), err


def float_flags(method):
    """The own flags of `method` whose type holds a float (a bare float, Optional[float] or a list of floats)."""
    hints = typing.get_type_hints(METHODS[method])

    def holds_float(t):
        return t is float or any(holds_float(a) for a in typing.get_args(t))
    return [name for name in flags.own_flags(method) if holds_float(hints[name])]


def test_every_float_flag_of_every_method_must_be_finite(capsys):
    """One rule for all: nan and inf in any float flag of any method's own are refused, naming the flag, unless the
    method allows them (`non_finite`, empty in every method here)."""
    checked = []
    for method in METHODS:
        assert not METHODS[method].non_finite, method
        for name in float_flags(method):
            for value in ("nan", "inf", "-inf"):
                err = refusal(method, [flags.flag(name), value], capsys)
                assert f"{flags.flag(name)} {value}: must be a finite number" in err, err
            checked.append(name)
    assert {"nft_beta", "nft_decay_rate", "ema_kl_beta", "ema_anchor_rate", "kl_mask_threshold", "split_noise_scale",
            "kl_guidance", "curriculum_ema", "timestep_fraction"} <= set(checked), checked


def test_a_method_may_allow_a_non_finite_flag(monkeypatch):
    """A flag the method names in `non_finite` passes the rule (its own `problem` then decides)."""
    monkeypatch.setattr(METHODS["branchgrpo"], "non_finite", {"pruning_until": "a test's"})
    assert flags.non_finite_problem(flags.parse_args([*TINY, "--method", "branchgrpo", "--pruning-until", "inf"])) \
        is None
    monkeypatch.setattr(METHODS["branchgrpo"], "non_finite", {})
    assert "--pruning-until inf" in flags.non_finite_problem(
        flags.parse_args([*TINY, "--method", "branchgrpo", "--pruning-until", "inf"]))


def test_train_and_plan_refuse_alike_before_loading(capsys):
    """train.py and tools/plan.py both refuse in one line, exit code 2, before any model loads (no tiny cache
    here: train.py would build one)."""
    from tools import plan

    argv = [*TINY, "--method", "diffusionnft", "--time-sampling", "discrete", "--time-micro-batch", "0"]
    proc = run_train(argv, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --method diffusionnft: --time-micro-batch 0: must be >= 1 (1: each image its own draw)"], proc.stderr
    with pytest.raises(SystemExit) as exit_info:
        plan.main([*TINY, "--method", "awm", "--ema-kl-beta", "nan"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and "--ema-kl-beta nan: must be" in err, err


# ---- the advice of a refusal runs ----
def advice(err):
    """The flags a refusal advises, as a command line: what follows its last 'e.g. ' or ': ', up to a ')' or its
    end."""
    tail = re.split(r"e\.g\. |trained steps: ", err.split(" (--")[0])[-1]
    return tail.rstrip(")").split()


def taken(argv, advised):
    """The command line `argv` with the advice taken: each flag it names set to its values there."""
    def by_flag(line):
        out = {}
        for a in line:
            if a.startswith("--"):
                out[a] = []
                last = a
            else:
                out[last].append(a)
        return out
    merged = {**by_flag(argv), **by_flag(advised)}
    return [part for name, values in merged.items() for part in (name, *values)]


def test_branchgrpo_with_no_split_points_advises_a_tree_that_runs(capsys):
    """An empty --split-points advised --group-size 1, which is refused; now log2(G) split points over 0..N-2 (or,
    for a G no power of two, the largest one below it)."""
    for argv, expected in [(["--split-points"], ["--split-points", "0", "2", "4"]),
                           (["--split-points", "--group-size", "6"], ["--split-points", "0", "3", "--group-size", "4"]),
                           (["--split-points", "--num-steps", "2", "--group-size", "4"], ["--split-points", "0",
                                                                                         "--group-size", "2"]),
                           (["--group-size", "4"], ["--split-points", "0", "3"])]:
        err = refusal("branchgrpo", argv, capsys)
        assert "--group-size 1" not in err and advice(err) == expected, err
        assert runs("branchgrpo", taken(argv, advice(err))), err


def test_a_cps_window_that_reaches_the_last_step_is_advised_the_window_that_runs(capsys):
    """Flow-DPPO --sde-window 8 under CPS named --sde-steps 0 1 2 3, which it does not read (and refuses); now the
    window (and draws) that keep step N-1 out. Flow-GRPO-Fast's --window-end and a --sde-steps method's likewise."""
    for method, argv, expected in [
            ("flow-dppo", ["--sde-window", "8"], ["--sde-window", "7"]),
            ("flow-dppo", ["--sde-window", "8", "--sde-draws", "8"], ["--sde-window", "7", "--sde-draws", "7"]),
            ("flow-grpo-fast", ["--window-end", "8"], ["--window-end", "7"]),
            ("flow-grpo-fast", ["--window-end", "8", "--window-size", "8"], ["--window-end", "7", "--window-size",
                                                                             "7"]),
            ("g2rpo", ["--sde-type", "cps", "--sde-steps", "5", "7"], ["--sde-steps", "5"]),
            ("dancegrpo", ["--sde-type", "cps", "--sde-steps", "5", "6", "7"], ["--sde-steps", "5", "6"])]:
        err = refusal(method, argv, capsys)
        assert "--sde-steps 0 1 2 3" not in err and advice(err) == expected, (argv, err)
        assert runs(method, taken(argv, advice(err))), err
    err = refusal("g2rpo", ["--sde-steps", "--num-steps", "3", "--sde-type", "cps"], capsys)  # empty, on 3 steps
    assert advice(err) == ["--sde-steps", "0", "1"]
    assert runs("g2rpo", taken(["--num-steps", "3", "--sde-type", "cps"], advice(err)))


def test_flow_dppo_takes_the_kl_guidance_of_its_recipe():
    """--kl-guidance: None (the run's --guidance) on every model, until the harness runs the base forward at another
    guidance (Flow-Factory's SD3.5-M 4.5 is refused with the KL on); `base_guidance` answers it."""
    for model, kl_guidance, run_guidance in (("sd3", None, 1.0), ("flux", None, 3.5), ("tiny", None, 3.5)):
        args = flags.parse_args(["--model", model, "--method", "flow-dppo"])
        method = flags.method_of(args)
        assert (args.kl_guidance, args.guidance) == (kl_guidance, run_guidance), model
        assert method.base_guidance(args.guidance) == (kl_guidance or run_guidance)
    given = flags.parse_args(["--model", "sd3", "--method", "flow-dppo", "--kl-guidance", "None"])
    assert given.kl_guidance is None and flags.method_of(given).base_guidance(1.0) == 1.0
    assert flags.method_of(flags.parse_args(["--model", "sd3"])).base_guidance(4.5) == 4.5
