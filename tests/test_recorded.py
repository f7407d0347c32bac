"""The numbers a change of structure must not move, recorded before it: every method's resolved values on every
model, and two iterations of every method (rollout, advantages, update) on a small velocity network.

The values are exact (they are the flags' resolution, no arithmetic). The two iterations run on a seeded linear
velocity field over 4 x 2 x 2 latents with a smooth reward, so another CPU's floating-point path moves them only in
the last digits: they are compared to a relative 1e-4 (with RECORDED_EXACT=1, bit for bit, as on the machine that
recorded them).

    python -m pytest -q tests/test_recorded.py           # check
    python tests/test_recorded.py --write                # record anew (only when a number is meant to change)
"""
import dataclasses
import json
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lab import flags  # noqa: E402
from lab.loop import batch_prompts, generators  # noqa: E402
from methods import METHODS  # noqa: E402
from methods.base import UpdateContext  # noqa: E402
from sampler import sigma_schedule  # noqa: E402

RECORD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recorded_values.json")
SHAPE = (4, 2, 2)  # a latent
PROMPTS = [f"prompt {i}" for i in range(6)]
# a small run of each method on the tiny preset: 2 prompts of its group size, 2 iterations
SMALL = ["--model", "tiny", "--prompts-per-iteration", "2", "--max-batch", "3"]
# every method at its tiny values, and those whose update has a KL term with one
RUNS = {**{name: [name] for name in METHODS},
        **{f"{name} kl": [name, "--kl-beta", "0.1"] for name in ("g2rpo", "dancegrpo", "pavegrpo", "branchgrpo")}}


class Field(torch.nn.Module):
    """A seeded velocity network: linear in the latent, the sigma and a per-prompt embedding."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        size = math.prod(SHAPE)
        self.linear = torch.nn.Linear(size + 1, size)
        self.prompt = torch.nn.Embedding(len(PROMPTS), size)

    def forward(self, x, sigma, prompt_index, cond):
        h = torch.cat([x.flatten(1).float(), sigma.float()[:, None]], 1)  # (n, size + 1)
        return (self.linear(h) + self.prompt(cond[prompt_index])).view_as(x)  # (n, ...)


class Data:
    """What a method's `prompts` hook is given (lab.loop.Harness's part of it), on the field."""

    def __init__(self, field, sigmas):
        self.field, self.sigmas, self.prompts, self.world, self.ranks = field, sigmas, PROMPTS, 1, None
        self.weights = torch.tensor([1.0])

    def batch(self, it, per_slot=1):
        return batch_prompts(PROMPTS, 0, it, 2 * per_slot, 0, 2 * per_slot)

    def note(self, line):
        pass

    @torch.no_grad()
    def ode_images(self, it, prompts, positions):
        from sampler import ode_sample

        noise = draw(generators(0, it, positions))
        return ode_sample(velocity(self.field, prompts), noise, self.sigmas, max_batch=3)

    def score(self, latents, prompts):
        return reward(latents, prompts)[:, None]


def draw(gens):
    return torch.stack([torch.randn(SHAPE, generator=g) for g in gens])


def velocity(field, prompts):
    cond = torch.tensor([PROMPTS.index(p) for p in prompts])
    return lambda x, sigma, index: field(x, sigma, index, cond)


def reward(latents, prompts):
    """A smooth reward of each final latent (M, ...): closeness to its prompt's own target."""
    target = torch.stack([torch.full(SHAPE, 0.3 * PROMPTS.index(p) - 0.5) for p in prompts])  # (M, ...)
    return -((latents.float() - target) ** 2).mean(dim=(1, 2, 3))  # (M,)


def two_iterations(run):
    """Every number two iterations of `run` (a key of RUNS) log: the rollout's counts, each update's statistics, and
    a checksum of the weights and of the method's state after."""
    name, *extra = RUNS[run]
    args = flags.parse_args([*SMALL, "--method", name, *extra])
    method, sigmas = flags.method_of(args), sigma_schedule(args.num_steps, args.shift, args.sigma_grid)
    field, base = Field(), Field()
    params = [p for p in field.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    method.start(list(field.named_parameters()))
    data, out = Data(field, sigmas), []
    for it in range(2):
        batch = method.prompts(it, data)
        gens = generators(0, it, batch.positions)
        noise = method.initial_noise(draw, gens)
        steps = method.trained_steps(it)
        with torch.no_grad():
            rollout = method.rollout(velocity(field, batch.prompts), noise, sigmas, gens, steps)
        B, J, K, G = rollout.final_latents.shape[:4]
        prompts = [p for p in batch.prompts for _ in range(J * K * G)]
        scores = reward(rollout.final_latents.flatten(0, 3), prompts).view(B, J, K, G, 1)
        advantages = method.advantages(scores, data.weights, None, rollout).expand(B, len(steps), G)
        ctx = UpdateContext(velocity(field, batch.prompts), params, optimizer, sigmas, gens,
                            velocity(base, batch.prompts), None, it)
        stats = method.update(rollout, advantages, ctx)
        out.append({"prompts": batch.prompts, "nfe": rollout.nfe + batch.nfe, "calls": rollout.calls,
                    "update_nfe": method.update_nfe(rollout), "steps": list(steps),
                    "reward": float(scores.mean()), "advantage_sq": float((advantages.float() ** 2).sum()),
                    **{k: float(v) for k, v in sorted(stats.items())}})
    state = method.state_dict()
    out.append({"weights": sum(float(p.detach().double().sum()) for p in params),
                "weights_abs": sum(float(p.detach().double().abs().sum()) for p in params),
                "state": sum(float(t.double().abs().sum()) for part in state.values() for t in part.values()
                             if t.dtype.is_floating_point and t.isfinite().all())})
    return out


def resolved_values():
    """Every flag's value under each --model and --method (and --sde-type cps where a method has it)."""
    values = {}
    for model in flags.PRESETS:
        for name, cls in METHODS.items():
            values[f"{model} {name}"] = flags.preset(model, name)
            if "sde_type" in {f.name for f in dataclasses.fields(cls)}:
                values[f"{model} {name} cps"] = flags.preset(model, name, "cps")
    return json.loads(json.dumps(values))


def record():
    return {"values": resolved_values(), "runs": {run: two_iterations(run) for run in RUNS}}


def close(a, b, exact):
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b if exact else math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)
    return a == b


@pytest.fixture(scope="module")
def recorded():
    with open(RECORD) as f:
        return json.load(f)


def test_every_resolved_value_is_as_recorded(recorded):
    now = resolved_values()
    assert sorted(now) == sorted(recorded["values"])
    for key, values in recorded["values"].items():
        changed = {k: (v, now[key].get(k)) for k, v in values.items() if now[key].get(k) != v}
        added = set(now[key]) - set(values)
        assert not changed and not added, (key, changed, added)


@pytest.mark.parametrize("run", sorted(RUNS))
def test_two_iterations_of_every_method_are_as_recorded(run, recorded):
    exact = os.environ.get("RECORDED_EXACT") == "1"
    for now, then in zip(two_iterations(run), recorded["runs"][run], strict=True):
        assert now.keys() == then.keys(), run
        wrong = {k: (now[k], then[k]) for k in then if not close(now[k], then[k], exact)}
        assert not wrong, (run, wrong)


if __name__ == "__main__":
    if "--write" in sys.argv:
        with open(RECORD, "w") as f:
            json.dump(record(), f, indent=1, sort_keys=True)
        print(f"wrote {RECORD}")
