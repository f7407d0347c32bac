"""Seconds from a scheduler's SIGTERM to a verified checkpoint, for a 2-rank full fine-tune under torchrun, with the
signal landing in each phase of an iteration: the rollout, its decoding and scoring, the update, the evaluation.

Each phase is one torchrun job of the tiny model (a full fine-tune, as its preset is): the job runs two iterations,
their metrics give the length of each phase, and the signal is sent halfway into that phase of the third. The figure
is the newest checkpoint's time less the signal's, once checkpoint.verify passes; torchrun's own grace is 30 s.

    python -m tools.preemption                  # about 6 minutes on 2 cores (the tiny model is cached once first)

Phases named before `--` are measured alone (`python -m tools.preemption evaluation`); flags of train.py after `--`
go to every job (e.g. `-- --inner-epochs 8`).
"""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# each phase: the flags that make it long enough to land in (on 2 cores), the stop line it must give
PHASES = {
    "rollout": ([], r"stopped during iteration \d+, before its update"),
    "decode + reward": (["--reward-batch-size", "1"], r"stopped during iteration \d+, before its update"),
    "update": (["--inner-epochs", "8"], r"stopped during iteration \d+'s update"),
    "evaluation": (["--eval-every", "1", "--eval-seeds", "48"], r"stopped after iteration \d+"),
}
COMMON = ["--model", "tiny", "--num-iterations", "100", "--checkpoint-every", "1000", "--log-with", "none"]


def rows(path):
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def measure(phase, extra, out):
    """(seconds from the signal to the checkpoint, the run's stop line, the phase's length in s)."""
    from lab import checkpoint

    flags, expected = PHASES[phase]
    argv = [*COMMON, *flags, *([] if "--eval-every" in flags else ["--eval-every", "1000"]), *extra, "--output-dir", out]
    log = open(out + ".log", "w+")  # (a file: a pipe nobody reads while this waits would fill and block the job)
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            os.path.join(ROOT, "train.py"), *argv], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                           text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    metrics, seen, started = os.path.join(out, "metrics.jsonl"), {}, time.time()
    while 2 not in seen:  # the time each iteration's row appears
        if job.poll() is not None or time.time() - started > 600:
            job.kill()
            log.seek(0)
            raise SystemExit(f"error: the {phase} job ended or stalled before its second iteration:\n"
                             f"{log.read()[-3000:]}")
        for row in rows(metrics):
            seen.setdefault(row["iteration"], time.time())
        time.sleep(0.01)
    last = rows(metrics)[-1]  # iteration 2, as iteration 3 will run
    rollout, score, update = last["time/rollout"], last["time/decode_and_reward"], last["time/update"]
    evaluation = max(seen[2] - seen[1] - last["time/iteration"], 0.0)
    offset, length = {"rollout": (rollout / 2, rollout), "decode + reward": (rollout + score / 2, score),
                      "update": (rollout + score + update / 2, update),
                      "evaluation": (rollout + score + update + evaluation / 2, evaluation)}[phase]
    time.sleep(max(seen[2] + offset - time.time(), 0.0))
    signalled = time.time()
    job.send_signal(signal.SIGTERM)
    job.wait(timeout=300)
    log.seek(0)
    output = log.read()
    found = re.search(r"stopped (?:during|after) [^\r\n]*", output)  # (a progress bar may share its line)
    stopped = found.group(0) if found else None
    if stopped is None or not re.match(expected, stopped):
        raise SystemExit(f"error: the signal missed the {phase} (stop line: {stopped!r}); the phases' lengths moved "
                         f"between iterations on this machine: run it again. The run's last lines:\n"
                         + "\n".join(output.splitlines()[-6:]))
    newest = checkpoint.latest_checkpoint(out)
    problem = checkpoint.verify(newest) if newest else "no checkpoint"
    if problem:
        raise SystemExit(f"error: the {phase} stop left no verified checkpoint: {problem}")
    return os.path.getmtime(newest) - signalled, stopped, length


def main(argv):
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    phases = argv[: argv.index("--")] if "--" in argv else argv
    if {"-h", "--help"} & set(phases):
        print(__doc__)
        return
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        raise SystemExit(f"error: unknown phase {unknown[0]!r}; choose from {', '.join(PHASES)}")
    from lab import tiny

    tiny.ensure_pretrained(os.path.join(ROOT, ".cache"))
    print("| phase the SIGTERM lands in | phase length s | SIGTERM -> verified checkpoint s | the run's stop line |")
    print("|---|---|---|---|")
    for phase in phases or PHASES:
        with tempfile.TemporaryDirectory() as tmp:
            seconds, line, length = measure(phase, extra, os.path.join(tmp, "run"))
        line = line.split(";")[0]
        print(f"| {phase} | {length:.1f} | {seconds:.2f} | {line} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
