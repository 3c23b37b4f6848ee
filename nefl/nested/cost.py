"""Analytic parameter and FLOP counts of a submodel, computed from its spec alone.

Used to print ladders, to derive baseline ladders with a target size, and as the device agent's
first cost estimate. FLOPs are counted as multiply-accumulates of convolutions, linear layers and
(for transformers) the attention products: the convention of the paper's tables and of most of
the literature. Each family computes its own (nefl/nested/families/costs.py, no torch: `nefl profile show`
runs on the inference-only install); this is the one entry point.
"""

from __future__ import annotations

from nefl.nested.families.costs import Cost, full_steps, submodel_cost  # noqa: F401 (Cost, submodel_cost re-exported)
from nefl.nested.profile import Profile, SubmodelSpec


def full_cost(profile: Profile) -> Cost:
    full = SubmodelSpec(-1, 1.0, 1.0, full_steps(profile.arch.depths))
    return submodel_cost(profile, full)


BYTES = 4  # float32
# Fitted to calibrations of the resnet20-fmnist ladders (x86-64, torch 2.14, batch 8 and 32; see
# docs/device-selection.md): peak growth = weights + grads + 1.15 x counted activations + ~173 MiB.
ACTIVATION_FACTOR = 1.2  # saved activations and backward buffers per counted conv/BN output element
FRAMEWORK_OVERHEAD = 170 * 2**20  # a fresh process's first step: lazy kernel pages, thread pools


def training_peak_bytes(params: int, activations: int, input_elements: int, batch_size: int, momentum: float = 0.0) -> int:
    """Analytic peak memory of training steps: weights, gradients (and momentum), the batch's inputs and
    saved activations, and the framework's fixed overhead."""
    state_copies = 2 + (momentum != 0)  # weights, gradients, momentum buffer
    sample = input_elements + activations * ACTIVATION_FACTOR
    return int(params * state_copies * BYTES + batch_size * sample * BYTES + FRAMEWORK_OVERHEAD)
