"""The methods train.py can run, by --method name: G2RPO (g2rpo.py), its full-SDE ablation, its peers, and its
authors' follow-ups (Pave-GRPO, AdaGRPO; AdaGRPO's curriculum and advantage are also flags of every method).

A method is a dataclass whose fields are the values it reads: first the run's flags (lab/flags.py documents them),
then its own flags, each with a docstring, which train.py adds to its command line under that --method. Beside
them, as class attributes and methods:

    same_noise            whether the G members of a prompt share their initial noise x_T (else noise (B, G, ...))
    per_step_advantages   whether each trained step has its own advantage (--step-credit can move them)
    recipe, flux          the values of the run's flags it sets on every --model, and with --model flux (its
                          published sizes); per_steps: those that follow the run's N, as functions of N
    problem(num_steps)    why its values cannot run, in one line, or None
    notes(sigmas)         (optional) lines worth saying before the run starts
    step(latents, velocity, sigmas, i, noise=None, next_latents=None) -> (next_latents, log_prob (n,))
                          its SDE step: samples, or scores a stored sample (the update, the gradient self-check)
    kl(velocity, base_velocity, sigmas, i) -> (n,)
                          its step's KL to the base model, for --kl-beta
    trained_steps(it)     the SDE steps trained in iteration `it`
    rollout(velocity_fn, noise, sigmas, generators, steps, image_only_fn) -> sampler.Rollout
    advantages(scores (B, J, K, G, R), weights (R,), ranks) -> (B, K or 1, G)
    update(velocity_fn, params, optimizer, rollout, advantages (B, K, G), sigmas, generators, base_velocity_fn,
           ranks) -> statistics (g2rpo.update_stats)
    optimizer_steps(K)    the optimizer steps one update takes

`lab.flags.method_of(args)` builds the method of a run's flags. `ranks` is None in one process, or the run's ranks:
.world, .sum(n), .max(n), .gather(tensor). A new method is a file here and a line in METHODS (docs/methods.md works
one through).
"""
from g2rpo import G2RPO
from methods.adagrpo import AdaGRPO
from methods.dancegrpo import DanceGRPO
from methods.flow_grpo import FlowGRPO, FlowGRPOFast
from methods.full_sde import FullSDE
from methods.mixgrpo import MixGRPO
from methods.pavegrpo import PaveGRPO

METHODS = {
    "g2rpo": G2RPO,
    "full-sde": FullSDE,
    "dancegrpo": DanceGRPO,
    "flow-grpo": FlowGRPO,
    "flow-grpo-fast": FlowGRPOFast,
    "mixgrpo": MixGRPO,
    "pavegrpo": PaveGRPO,
    "adagrpo": AdaGRPO,
}

STEP_CREDITS = ("own", "mean", "rolled")


def step_credit(advantages, credit: str):
    """Which advantage each trained step gets, (B, K, G) -> (B, K, G): a knob for every method whose steps have
    their own advantages. own: its own (the method); the bench's controls destroy that credit: mean, every step of
    member i gets the mean of its K advantages; rolled, step k gets step k + 1's (the last step the first's), the
    right values at the wrong steps."""
    if credit == "mean":
        return advantages.mean(1, keepdim=True).expand_as(advantages)
    if credit == "rolled":
        return advantages.roll(-1, dims=1)
    return advantages
