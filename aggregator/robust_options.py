"""The robustness options `aggregator serve` and `aggregator simulate` share: update bounds, clipping,
DP-FedAvg and the aggregation rule (docs/security.md). Declared once, as the option group RobustnessOptions,
so a simulated federation runs exactly the server's options; defaults come from the config dataclasses,
never restated here. Torch-free (nefl/support/settings.py and nefl/aggregation/config.py hold the defaults),
so the commands' --help answers at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer

from nefl.aggregation.config import AggregationConfig
from nefl.aggregation.registry import help_text as rule_help
from nefl.support.option_groups import option_group
from nefl.support.settings import DEFAULT_ADAPTIVE_K, DEFAULT_MAX_ABS, DEFAULT_RELATIVE, DEFAULT_ROOT_SAMPLES

if TYPE_CHECKING:
    from nefl.aggregation.pipeline import Robustness

_A = AggregationConfig()

MaxUpdateNorm = Annotated[Optional[float], typer.Option(
    "--max-update-norm", min=0, help="Fixed bound on an update's L2 norm (docs/security.md).")]
UpdateNormRelative = Annotated[float, typer.Option(
    "--update-norm-relative", min=0, help="Bound an update's norm by this multiple of its submodel's weight norm; 0 turns it off.")]
UpdateNormK = Annotated[float, typer.Option(
    "--update-norm-k", min=0, help="Bound an update's norm by K x the median of the latest norms of the submodel's recent "
                                   "clients (one vote per client, so no client can ratchet it); 0 turns it off.")]
Clip = Annotated[bool, typer.Option("--clip/--reject", help="Scale oversized updates down to the bound, or refuse them.")]
MaxWeightAbs = Annotated[float, typer.Option(
    "--max-weight-abs", min=0, help="A round whose new weights exceed this magnitude (or are not finite) is not committed.")]
DPNoise = Annotated[float, typer.Option(
    "--dp-noise-multiplier", min=0, help="DP-FedAvg: Gaussian noise std = this x --max-update-norm (needs --clip, "
                                         "--aggregator nefedavg; turns the centre check off); epsilon is logged per round.")]
Rule = Annotated[str, typer.Option("--aggregator", help=rule_help())]
Trim = Annotated[float, typer.Option("--trim", min=0, max=0.49, help="trimmed-mean: the fraction cut at each end.")]
CentreCheck = Annotated[Optional[bool], typer.Option(
    "--centre-check/--no-centre-check", help="Drop updates that point away from the round's majority (a cosine "
                                             "above a significance margin with fewer than --min-agreement of the "
                                             "others within the size bound), clip ones far "
                                             "larger than the median, and bound each per-submodel tensor's step (BN, "
                                             "step sizes) by its peers' and its history; default on, "
                                             "off under DP.", show_default=False)]
MinAgree = Annotated[float, typer.Option(
    "--min-agreement", min=0, max=1, help="Centre check: the least share of the round's other updates (those within "
                                          "--max-norm-ratio) an update must point the same way as.")]
MaxNormRatio = Annotated[float, typer.Option(
    "--max-norm-ratio", min=1, help="Centre check (and thin coverage): clip an update above this x the round's median "
                                    "relative norm.")]
RootData = Annotated[Optional[str], typer.Option(
    "--root-data", help="fltrust: the dataset whose test split holds the server's root set (default: the evaluation "
                        "dataset; its root images are left out of evaluation).")]
TensorClip = Annotated[float, typer.Option(
    "--tensor-clip", min=1, help="Centre check: scale each named tensor of an update down to this x its reference "
                                 "per-element size (the median over the round's updates carrying that tensor and its "
                                 "history).")]
TensorNoise = Annotated[float, typer.Option(
    "--tensor-noise", min=0, help="Centre check: Gaussian noise on each kept update after the per-tensor clip, std = "
                                  "this x its tensor's reference per-element size; 0 turns it off.")]
StepElement = Annotated[float, typer.Option(
    "--step-element", min=0, help="Centre check: also hold each element of a per-submodel tensor's step to this x "
                                  "that tensor's step bound, so a push in one channel is cut there; 0 (off) or >= 1.")]
GateOpt = Annotated[bool, typer.Option(
    "--gate/--no-gate", help="Judge each round on held-out test images: leave out the updates that make it worse "
                             "(leave-one-out), and refuse a round still worse than the best of the last 3 committed "
                             "states; needs --eval-dataset (simulate: its test split).")]
ServerStats = Annotated[bool, typer.Option(
    "--server-stats/--device-stats", help="Batch norm's running statistics: the server's own, recomputed at every "
                                          "commit on held-out test images (needs --eval-dataset; simulate: its test "
                                          "split), or the devices' merged values.")]
ClassifierRows = Annotated[bool, typer.Option(
    "--classifier-rows/--no-classifier-rows", help="With --server-stats: take each class's classifier row back from "
                                                   "the round's plain average where that lowers the loss on the "
                                                   "server's images (the per-element merge cuts honest pushes under "
                                                   "label skew).")]
FinetuneEpochs = Annotated[int, typer.Option(
    "--finetune-epochs", min=0, help="With --server-stats: passes of every submodel over the server's images at each "
                                     "commit, before its running statistics (unlearns what clean images do not "
                                     "exercise, a backdoor's trigger; docs/security.md); 0 turns it off.")]
FinetuneLr = Annotated[float, typer.Option(
    "--finetune-lr", min=0, help="--finetune-epochs: the server's learning rate.")]
StatsSamples = Annotated[int, typer.Option(
    "--stats-samples", min=1, help="--server-stats: held-out test images the running statistics are recomputed on.")]
RootSamples = Annotated[int, typer.Option("--root-samples", min=1, help="fltrust: images in the root set.")]


@option_group("Robustness (docs/security.md)")
class RobustnessOptions:
    max_update_norm: MaxUpdateNorm = None
    update_norm_relative: UpdateNormRelative = DEFAULT_RELATIVE
    update_norm_k: UpdateNormK = DEFAULT_ADAPTIVE_K
    clip: Clip = False
    max_weight_abs: MaxWeightAbs = DEFAULT_MAX_ABS
    dp_noise_multiplier: DPNoise = 0.0
    aggregator: Rule = _A.rule
    trim: Trim = _A.trim
    centre_check: CentreCheck = None
    min_agree: MinAgree = _A.min_agree
    max_norm_ratio: MaxNormRatio = _A.max_norm_ratio
    tensor_clip: TensorClip = _A.tensor_clip
    tensor_noise: TensorNoise = _A.tensor_noise
    step_element: StepElement = _A.step_element
    gate: GateOpt = _A.gate
    server_stats: ServerStats = _A.server_stats
    stats_samples: StatsSamples = _A.stats_samples
    classifier_rows: ClassifierRows = _A.classifier_rows
    finetune_epochs: FinetuneEpochs = _A.finetune_epochs
    finetune_lr: FinetuneLr = _A.finetune_lr
    root_samples: RootSamples = DEFAULT_ROOT_SAMPLES

    def robustness(self) -> Robustness:
        """The options as a Robustness; raises ValueError with a one-line reason for a combination that
        cannot work."""
        from nefl.aggregation.pipeline import Robustness  # torch: only when a command runs
        from nefl.aggregation.robust import NormBound

        centre_check = self.centre_check
        if centre_check is None:
            centre_check = _A.centre_check and not self.dp_noise_multiplier
        bound = NormBound(max_norm=self.max_update_norm or None, relative=self.update_norm_relative or None,
                          adaptive_k=self.update_norm_k or None, mode="clip" if self.clip else "reject")
        agg = AggregationConfig(rule=self.aggregator, trim=self.trim, centre_check=centre_check,
                                min_agree=self.min_agree, max_norm_ratio=self.max_norm_ratio,
                                tensor_clip=self.tensor_clip, tensor_noise=self.tensor_noise,
                                step_element=self.step_element, gate=self.gate, server_stats=self.server_stats,
                                stats_samples=self.stats_samples, classifier_rows=self.classifier_rows,
                                finetune_epochs=self.finetune_epochs, finetune_lr=self.finetune_lr)
        return Robustness(bound, self.max_weight_abs, self.dp_noise_multiplier, aggregation=agg)
