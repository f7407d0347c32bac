"""The methods train.py can run, by --method name: G2RPO (g2rpo.py), its full-SDE ablation, its peers, its authors'
follow-ups (Pave-GRPO, AdaGRPO), the field's newest (Flow-DPPO, BranchGRPO), and DiffusionNFT and AWM, which score no
SDE step. Each is a class on the interface of methods/base.py, in a file of its own that holds all of its decisions,
flags and state.

`REGISTRY` is the registry: one line a method, its name and where its class lives; `METHODS`, {name: class}, is
built from it when first read (so that g2rpo.py and the method files can import methods.base without a cycle). A new method is a file here and a
line below (docs/methods.md walks one through).
"""
import importlib

REGISTRY = {
    "g2rpo": "g2rpo:G2RPO",
    "full-sde": "methods.full_sde:FullSDE",
    "dancegrpo": "methods.dancegrpo:DanceGRPO",
    "flow-grpo": "methods.flow_grpo:FlowGRPO",
    "flow-grpo-fast": "methods.flow_grpo:FlowGRPOFast",
    "mixgrpo": "methods.mixgrpo:MixGRPO",
    "pavegrpo": "methods.pavegrpo:PaveGRPO",
    "adagrpo": "methods.adagrpo:AdaGRPO",
    "flow-dppo": "methods.flow_dppo:FlowDPPO",
    "branchgrpo": "methods.branchgrpo:BranchGRPO",
    "diffusionnft": "methods.diffusionnft:DiffusionNFT",
    "awm": "methods.awm:AWM",
}

DEFAULT_METHOD = "g2rpo"  # --method's default: the paper's

STEP_CREDITS = ("own", "mean", "rolled")


def __getattr__(name):
    """`METHODS`, {name: class}, built from the registry on first use (a fork or a test may add to it)."""
    if name != "METHODS":
        raise AttributeError(name)
    classes = {}
    for method, where in REGISTRY.items():
        module, cls = where.split(":")
        classes[method] = getattr(importlib.import_module(module), cls)
    globals()["METHODS"] = classes
    return classes


def step_credit(advantages, credit: str):
    """Which advantage each trained step gets, (B, K, G) -> (B, K, G): a control for every method whose steps have
    their own advantages. own: its own (the method); the bench's controls destroy that credit: mean, every step of
    member i gets the mean of its K advantages; rolled, step k gets step k + 1's (the last step the first's), the
    right values at the wrong steps."""
    if credit == "mean":
        return advantages.mean(1, keepdim=True).expand_as(advantages)
    if credit == "rolled":
        return advantages.roll(-1, dims=1)
    return advantages
