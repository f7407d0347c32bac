"""`--show-config`: every resolved value of a run and where it came from, printed before anything loads.

Run: python -m pytest -q tests/test_show_config.py
"""
import re

import pytest

from lab import flags


def shown(capsys, *argv):
    with pytest.raises(SystemExit) as stop:
        flags.parse_args([*argv, "--show-config"])
    assert stop.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines if line.startswith("  --")]
    return {row[0]: row[1:] for row in rows}


def test_g2rpo_on_flux_shows_the_reference_values_from_its_file(capsys):
    rows = shown(capsys, "--model", "flux")
    for name, value in [("--lr", "2e-06"), ("--clip-range", "0.0001"), ("--eta", "0.7"), ("--group-size", "12"),
                        ("--sde-steps", "0 1 2 3 4 5 6 7"), ("--granularities", "1 2 3")]:
        assert rows[name][0] == value and rows[name][1].startswith("g2rpo.py"), (name, rows[name])
    assert rows["--num-steps"] == ["16", "lab/flags.py: its default"]


def test_a_peer_its_own_file_and_the_command_line(capsys):
    """A method's own values, the command line's, and the start every method shares; a model path that does not
    exist loads nothing and so fails nothing."""
    rows = shown(capsys, "--model", "tiny", "--method", "dancegrpo", "--lr", "1e-3", "--model-path", "/nowhere")
    assert rows["--eta"] == ["0.3", "methods/dancegrpo.py: on every model"]
    assert rows["--lr"] == ["0.001", "the command line"]
    assert rows["--group-size"] == ["8", "g2rpo.py: every method's start on --model tiny"]
    assert rows["--sde-steps"][-1] == "methods/dancegrpo.py: follows --num-steps"
