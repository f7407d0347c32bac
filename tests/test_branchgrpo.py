"""BranchGRPO (methods/branchgrpo.py): the tree rollout against a node-by-node restatement with batch-1 forwards, its
forwards and edges on the authors' FLUX tree, the node rewards (mean and probability-weighted) and the per-depth
advantages against a float64 restatement on an explicit tree, depth and width pruning on hand-made advantages, and one
update against a restatement edge by edge. Its 2-iteration tiny run and exact resume, and its recipe's resolved
values, are test_baselines.py's.

Run: python -m pytest -q tests/test_branchgrpo.py
"""
import math
import statistics

import pytest
import torch

from lab import flags
from methods.base import UpdateContext
from methods.branchgrpo import BranchGRPO, edges_per_step, kept_by_width
from sampler import sigma_schedule
from test_baselines import make


def branch(**values):
    return make(BranchGRPO, **{"eta": 0.3, "num_steps": 6, "num_iterations": 10, "split_points": [0, 2],
                               "group_size": 4, **values})


def test_the_tree_rollout_against_a_node_by_node_restatement():
    torch.manual_seed(0)
    method, sigmas = branch(), sigma_schedule(6, 3.0)
    net = torch.nn.Linear(5, 5)
    velocity = lambda x, s, i: net(x) + s[:, None] + 0.1 * i[:, None]
    noise = torch.randn(2, 5)
    gens = lambda: [torch.Generator().manual_seed(b) for b in range(2)]
    out = method.rollout(velocity, noise, sigmas, gens(), method.trained_steps(0))
    assert out.start_latents.shape == (2, 6, 4, 5) and out.final_latents.shape == (2, 1, 1, 4, 5)
    for b, gen in enumerate(gens()):
        nodes = [noise[b : b + 1]]  # the live nodes, in the tree's order
        for i in range(6):
            children = 2 if i in (0, 2) else 1
            eps = torch.randn((len(nodes) * children, 5), generator=gen)  # the prompt's draw of this step
            grown = []
            for p, x in enumerate(nodes):
                v = velocity(x, sigmas[i].expand(1), torch.tensor([b]))
                for c in range(children):
                    e = p * children + c  # the edge's index; its leaves are block e of 4 / (edges) leaves
                    scale = 4.0 if children == 2 else 1.0
                    child, log_prob = method.step(x, v, sigmas, i, noise=scale * eps[e : e + 1])
                    # DanceGRPO's Gaussian of std eta sqrt(-dt) scores it, the split's scale aside
                    s, dt = float(sigmas[i]), float(sigmas[i + 1] - sigmas[i])
                    mean = x + dt * (v + 0.3**2 / (2 * s) * (x + (1 - s) * v))
                    expected = torch.distributions.Normal(mean, 0.3 * math.sqrt(-dt)).log_prob(child).mean()
                    torch.testing.assert_close(log_prob[0], expected, atol=1e-5, rtol=1e-5)
                    block = 4 // (len(nodes) * children)
                    for leaf in range(e * block, (e + 1) * block):
                        torch.testing.assert_close(out.start_latents[b, i, leaf], x[0])
                        torch.testing.assert_close(out.next_latents[b, i, leaf], child[0])
                        torch.testing.assert_close(out.old_log_probs[b, i, leaf], log_prob[0])
                    grown.append(child)
                if i == 5:  # each leaf's image: the last step's x0_hat
                    torch.testing.assert_close(out.final_latents[b, 0, 0, p], (x - float(sigmas[i]) * v)[0])
            nodes = grown
    assert out.nfe == 2 * (1 + 2 + 2 + 4 + 4 + 4)  # one forward per node a step
    # the authors' FLUX tree: 20 steps, splits 0 3 6 9, 16 leaves: 203 forwards, 218 edges, against 320 and 320
    flux = flags.method_of(flags.parse_args(["--model", "flux", "--method", "branchgrpo"]))
    zero = lambda x, s, i: torch.zeros_like(x)
    tree = flux.rollout(zero, torch.zeros(1, 2), sigma_schedule(20, 3.0), [torch.Generator()], flux.trained_steps(0))
    assert tree.nfe == 203 and sum(edges_per_step(20, [0, 3, 6, 9])) == 218 and flux.update_nfe(tree) == 218


def test_node_rewards_and_depth_advantages_against_float64():
    # 6 steps, splits at 0 and 2: the root's two children (depth 1) each have one child (depth 2), which split
    # in two (depth 3, the 4 leaves' lineages, to depth 6)
    torch.manual_seed(0)
    method = branch(adv_clip_max=100.0)
    leaves = [0.2, 0.9, 0.4, 0.1]
    scores = torch.tensor(leaves).view(1, 1, 1, 4, 1)
    got = method.advantages(scores, torch.ones(1))  # (1, 6, 4)

    def normalised(values):  # unbiased std + 1e-8, 0 where one node or no spread
        if len(values) < 2 or statistics.stdev(values) < 1e-6:
            return [0.0] * len(values)
        return [(v - statistics.mean(values)) / (statistics.stdev(values) + 1e-8) for v in values]

    pairs = [statistics.mean(leaves[:2]), statistics.mean(leaves[2:])]  # the two subtrees' mean rewards
    expected = {0: normalised(pairs), 1: normalised(pairs)}
    for i in (2, 3, 4, 5):
        expected[i] = normalised(leaves)
    for i in range(6):
        blocks = [expected[i][leaf * len(expected[i]) // 4] for leaf in range(4)]
        torch.testing.assert_close(got[0, i].double(), torch.tensor(blocks, dtype=torch.float64), atol=1e-6,
                                   rtol=1e-6)
    # probability-weighted: a node's reward is the softmax over its children's edge log-probs of theirs
    rollout = method.rollout(lambda x, s, i: 0.5 * x, torch.randn(1, 3), sigma_schedule(6, 3.0),
                             [torch.Generator().manual_seed(0)], method.trained_steps(0))
    weighted = branch(adv_clip_max=100.0, tree_prob_weighted=True).advantages(scores, torch.ones(1), None, rollout)
    lp = rollout.old_log_probs[0]  # (K, G)
    softmax = lambda a, b: (math.exp(a) / (math.exp(a) + math.exp(b)), math.exp(b) / (math.exp(a) + math.exp(b)))
    lp2 = [float(lp[2, leaf]) for leaf in range(4)]  # the edges into depth 3: two children of each subtree
    w01, w23 = softmax(lp2[0], lp2[1]), softmax(lp2[2], lp2[3])
    sub = [w01[0] * leaves[0] + w01[1] * leaves[1], w23[0] * leaves[2] + w23[1] * leaves[3]]
    assert lp2[0] != lp2[1]
    for i in (0, 1):
        torch.testing.assert_close(weighted[0, i].double(), torch.tensor(
            [normalised(sub)[leaf // 2] for leaf in range(4)], dtype=torch.float64), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(weighted[0, 2:], got[0, 2:])  # the leaves' depths stay the leaves'
    # a depth of equal rewards gets 0, and so does the clip
    flat = method.advantages(torch.ones(1, 1, 1, 4, 1), torch.ones(1))
    assert torch.equal(flat, torch.zeros(1, 6, 4))
    assert float(branch(adv_clip_max=0.5).advantages(scores, torch.ones(1)).abs().max()) == 0.5


def test_depth_and_width_pruning():
    # depth: the depths listed, sliding one shallower every interval down to the stop, while pruning lasts
    method = branch(num_steps=20, split_points=[0, 3, 6, 9], group_size=16, num_iterations=100,
                    depth_pruning=[15, 16], depth_pruning_interval=30, pruning_until=0.5)
    # (iterations counted from 1: the first move after iteration 30, 0-based 29)
    assert [method.pruned_depths(it) for it in (0, 28, 29, 49)] == [{15, 16}, {15, 16}, {14, 15}, {14, 15}]
    assert method.pruned_depths(50) == set()  # iteration 51 > int(0.5 * 100)
    long = branch(num_steps=20, split_points=[0, 3, 6, 9], group_size=16, num_iterations=10**4,
                  depth_pruning=[15], depth_pruning_interval=1)
    assert long.pruned_depths(100) == {9}  # the stop: the last split point
    advantages = torch.zeros(1, 20, 16)
    mask = method.edge_mask(0, advantages, list(range(20)))
    assert int(mask[0, 14].sum()) == 0 and int(mask[0, 15].sum()) == 0  # the edges into depths 15 and 16
    assert int(mask[0].sum()) == 218 - 32
    # width, mode 1: of each leaf's chain after the last split, the top half by advantage, among the edges alive
    torch.manual_seed(0)
    values, alive = torch.randn(1, 4, 16), torch.ones(1, 4, 16, dtype=torch.bool)
    keep = kept_by_width(values, alive, 1, 0.5)
    for leaf in range(16):
        top = values[0, :, leaf].argsort(descending=True)[:2]
        assert set(keep[0, :, leaf].nonzero().flatten().tolist()) == set(top.tolist())
    equal = kept_by_width(torch.randn(1, 1, 16).expand(1, 4, 16), alive, 1, 0.5)  # a leaf's A at every depth
    assert equal[0, :2].all() and not equal[0, 2:].any()  # ties: the chain's earliest edges
    alive[0, 0] = False  # an edge depth pruning took is not ranked: 3 left a chain, 1 kept
    pruned = kept_by_width(values, alive, 1, 0.5)
    assert (pruned.sum(1) == 1).all() and not pruned[0, 0].any()
    # mode 2: the best and the worst of the tree's edges after the last split, k = max(2, int(ratio n))
    values = torch.randn(1, 3, 16)
    keep = kept_by_width(values, torch.ones(1, 3, 16, dtype=torch.bool), 2, 0.25)  # n 48, k 12: 6 best, 6 worst
    ranked = values.flatten().argsort(descending=True)
    assert set(keep.flatten().nonzero().flatten().tolist()) == set(ranked[:6].tolist()) | set(ranked[-6:].tolist())
    widths = branch(num_steps=20, split_points=[0, 3, 6, 9], group_size=16, width_pruning=1)
    # 80 of the 160 edges after the last split go: 138 trained, the authors' 8.625 a leaf of 16
    assert int(widths.edge_mask(0, torch.randn(1, 20, 16), list(range(20)))[0].sum()) == 218 - 80


def authors_transitions(num_steps, split_points, leaves):
    """The transitions of one tree in the authors' order (`collect_all_transitions`: each node's edges to its
    children, each followed at once by the child's subtree), as (step, first leaf of the child's block)."""
    out = []

    def visit(step, first, width):  # the node at `step` whose leaves are first .. first + width - 1
        if step == num_steps:
            return
        children = 2 if step in split_points else 1
        for c in range(children):
            out.append((step, first + c * width // children))
            visit(step + 1, first + c * width // children, width // children)
    visit(0, 0, leaves)
    return out


def authors_mode_2(advantages, num_steps, split_points, ratio):
    """Their width pruning, mode 2, restated: the transitions after the last split in their order, sorted by advantage
    (Python's stable sort, reverse=True), the first k // 2 and the last k - k // 2 kept, k = max(2, int(ratio n)).
    advantages (E, G) over the E steps after the last split. Returns the kept {(e, leaf)}."""
    last = max(split_points)
    after = [(step - last - 1, leaf) for step, leaf in authors_transitions(num_steps, split_points, advantages.shape[1])
             if step > last]
    ranked = sorted(after, key=lambda edge: float(advantages[edge]), reverse=True)
    k = max(2, int(len(ranked) * ratio))
    return set(ranked[: k // 2]) | set(ranked[len(ranked) - (k - k // 2):])


def test_width_pruning_mode_2_keeps_the_authors_edges_on_tied_advantages():
    """After the last split a node's advantage is its leaf's at every depth, so a chain's edges tie, and tied leaves
    tie with each other: mode 2 then keeps the edges the authors' depth-first order keeps (ranked step by step it
    kept others). On the authors' FLUX tree with 2 leaves sharing each advantage, and on random ties."""
    for num_steps, splits, leaves, ratio in ((20, [0, 3, 6, 9], 16, 0.05), (8, [0, 2, 4], 8, 0.25)):
        E = num_steps - 1 - max(splits)
        per_leaf = torch.arange(leaves // 2).repeat_interleave(2).float()  # leaves 0, 1 tie, 2, 3 tie, ...
        for leaf_values in (per_leaf, torch.zeros(leaves), torch.randint(0, 3, (leaves,)).float()):
            advantages = leaf_values.expand(E, leaves)  # (E, G): equal along each chain
            keep = kept_by_width(advantages[None], torch.ones(1, E, leaves, dtype=torch.bool), 2, ratio)[0]
            ours = {(e, g) for e, g in keep.nonzero().tolist()}
            assert ours == authors_mode_2(advantages, num_steps, splits, ratio), (num_steps, leaf_values)
        # step by step (the earlier ranking) the tied leaves' edges interleave, and another set is kept
        step_major = sorted([(e, g) for e in range(E) for g in range(leaves)],
                            key=lambda edge: -float(per_leaf[edge[1]]))
        k = max(2, int(E * leaves * ratio))
        earlier = set(step_major[: k // 2]) | set(step_major[len(step_major) - (k - k // 2):])
        assert earlier != authors_mode_2(per_leaf.expand(E, leaves), num_steps, splits, ratio)


def test_update_nfe_counts_the_forwards_pruning_leaves():
    """perf/update_nfe is the forwards with gradients the update ran (counted at the velocity), pruned edges left
    out; on a rollout no update ran on (tools/bench.py's cost) the count the pruning rule implies, averaged over the
    run's iterations where depth pruning slides."""
    torch.manual_seed(0)
    B, sigmas = 2, sigma_schedule(8, 3.0)
    weight = torch.nn.Parameter(torch.tensor(0.3))
    net = lambda x, s, i: weight * x + 0.1 * i[:, None]  # noqa: E731
    forwarded = []
    counted = lambda x, s, i: forwarded.append(len(x)) or net(x, s, i)  # noqa: E731
    method = branch(num_steps=8, split_points=[0, 2, 4], group_size=8, width_pruning=2, num_iterations=4,
                    inner_epochs=2)

    def rollout():
        with torch.no_grad():
            return method.rollout(net, torch.randn(B, 3), sigmas, [torch.Generator().manual_seed(b) for b in range(B)],
                                  method.trained_steps(0))
    first, second = rollout(), rollout()
    # 44 edges a tree; mode 2 keeps 12 of the 24 after the last split (steps 5, 6, 7): 32 a tree, 2 epochs
    assert method.update_nfe(first) == B * 32 * 2  # before the update: the rule's count
    method.update(first, torch.randn(B, 8, 8), UpdateContext(counted, [weight], torch.optim.SGD([weight], lr=0.1),
                                                            sigmas, generators=[torch.Generator()] * B))
    assert sum(forwarded) == B * 32 * 2 and method.update_nfe(first) == sum(forwarded)
    assert method.update_nfe(second) == B * 32 * 2  # another rollout: the rule's count
    unpruned = branch(num_steps=8, split_points=[0, 2, 4], group_size=8, num_iterations=4)
    assert unpruned.update_nfe(first) == B * 44  # (the count before: 352 on the tiny preset's 8 prompts)
    # depth pruning that slides: depth 4 (step 3's 4 edges) moves to 3 after iteration 2, to 2 (step 1's 2) after 4
    sliding = branch(num_steps=8, split_points=[0, 2, 4], group_size=8, num_iterations=4, depth_pruning=[4],
                     depth_pruning_interval=2, depth_pruning_stop=1)
    assert [sliding.trained_edges(it, list(range(8))) for it in range(4)] == [40, 40, 40, 42]
    assert sliding.update_nfe(first) == B * (40 * 3 + 42) / 4


def test_one_update_against_the_restatement():
    # two prompts: every edge once, in its prompt's random order, each optimizer step on the next `edges_per_step`
    # edges of each prompt, each edge's clipped loss times 1 / (B x edges_per_step x the tree's edges), restated with
    # batch-1 forwards
    torch.manual_seed(0)
    B, sigmas = 2, sigma_schedule(6, 3.0)
    weight = torch.nn.Parameter(torch.tensor(0.3))
    net = lambda x, s, i: weight * x + 0.1 * i[:, None]
    method = branch(clip_range=0.05, max_grad_norm=100.0, edges_per_step=6)
    with torch.no_grad():
        rollout = method.rollout(net, torch.randn(B, 3), sigmas, [torch.Generator().manual_seed(b) for b in range(B)],
                                 method.trained_steps(0))
    advantages = torch.randn(B, 6, 4)
    shuffles = [torch.Generator().manual_seed(7 + b) for b in range(B)]
    method.update(rollout, advantages, UpdateContext(net, [weight], torch.optim.SGD([weight], lr=10.0), sigmas,
                                                     generators=shuffles))
    ours = float(weight.detach())

    weight.data.fill_(0.3)
    optimizer = torch.optim.SGD([weight], lr=10.0)
    edges = [(i, leaf) for i, m in enumerate(edges_per_step(6, [0, 2])) for leaf in range(0, 4, 4 // m)]
    assert len(edges) == 20
    orders = [torch.randperm(20, generator=torch.Generator().manual_seed(7 + b)).tolist() for b in range(B)]
    for start in range(0, 20, 6):  # 4 optimizer steps: 6, 6, 6, 2 edges of each prompt
        for b in range(B):
            for e in orders[b][start : start + 6]:
                i, leaf = edges[e]
                x = rollout.start_latents[b, i, leaf : leaf + 1]
                _, log_prob = method.step(x, net(x, None, torch.tensor([b])), sigmas, i,
                                          next_latents=rollout.next_latents[b, i, leaf : leaf + 1])
                ratio = torch.exp(log_prob - rollout.old_log_probs[b, i, leaf])
                a = advantages[b, i, leaf]
                (torch.maximum(-a * ratio, -a * ratio.clamp(0.95, 1.05)).sum() / (B * 6 * 20)).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert abs(ours - float(weight.detach())) < 1e-6 and abs(ours - 0.3) > 1e-5


def test_its_refusals(capsys):
    for argv, words in [(["--group-size", "6"], "a tree with 3 binary splits has 8 leaves"),
                        (["--split-points", "0", "7", "2"], "distinct steps in 0..6"),
                        (["--width-pruning", "3"], "mode 0, 1 or 2"),
                        (["--depth-pruning", "9"], "depths in 1..8"),
                        (["--sde-type", "cps", "--eta", "2"], "(0, 1]")]:
        with pytest.raises(SystemExit):
            flags.check_flags(flags.parse_args(["--model", "tiny", "--method", "branchgrpo", *argv]), world=1)
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1, (argv, err)
    # with --sde-type cps the last step (no noise) is sampled but not trained
    cps = flags.method_of(flags.parse_args(["--model", "tiny", "--method", "branchgrpo", "--sde-type", "cps"]))
    assert cps.trained_steps(0) == list(range(7))
