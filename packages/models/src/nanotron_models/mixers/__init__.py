"""Sequence mixers other than attention (attention lives in attention.py): Mamba-2 (SSD),
Mamba-1 (S6, for Nanotron's Mamba example) and Gated DeltaNet (Qwen3-Next's linear attention;
its context parallel in gated_deltanet_cp.py, as Mamba-2's in mamba2_cp.py)."""

from .gated_deltanet import (
    GatedDeltaNetDims,
    GatedDeltaNetMixer,
    GatedDeltaNetState,
    GatedRMSNorm,
    gated_deltanet_init,
)
from .gated_deltanet_tp import GATED_DELTANET_TP_PLAN, shard_gated_deltanet, unshard_gated_deltanet
from .gdn_scan import combine_affine_states, gated_delta_rule, gated_delta_rule_affine
from .mamba1 import Mamba1Dims, Mamba1Mixer, Mamba1State, mamba1_dt_init
from .mamba2 import GatedGroupRMSNorm, Mamba2Dims, Mamba2Mixer, Mamba2State, mamba2_ssm_init
from .mamba2_tp import MAMBA2_TP_PLAN, conv_channels, in_proj_rows, shard_mamba2, unshard_mamba2
from .selective_scan import linear_recurrence, selective_scan
from .ssd_scan import (
    causal_conv,
    combine_segment_states,
    conv_halo,
    reset_mask_from_document_ids,
    ssd_initial_state_output,
    ssd_scan,
    ssd_total_decay,
)

__all__ = [
    "GATED_DELTANET_TP_PLAN",
    "GatedDeltaNetDims",
    "GatedDeltaNetMixer",
    "GatedDeltaNetState",
    "GatedRMSNorm",
    "combine_affine_states",
    "gated_delta_rule",
    "gated_delta_rule_affine",
    "gated_deltanet_init",
    "shard_gated_deltanet",
    "unshard_gated_deltanet",
    "Mamba1Dims",
    "Mamba1Mixer",
    "Mamba1State",
    "linear_recurrence",
    "mamba1_dt_init",
    "selective_scan",
    "MAMBA2_TP_PLAN",
    "GatedGroupRMSNorm",
    "Mamba2Dims",
    "Mamba2Mixer",
    "Mamba2State",
    "causal_conv",
    "combine_segment_states",
    "conv_halo",
    "conv_channels",
    "in_proj_rows",
    "mamba2_ssm_init",
    "reset_mask_from_document_ids",
    "shard_mamba2",
    "ssd_initial_state_output",
    "ssd_scan",
    "ssd_total_decay",
    "unshard_mamba2",
]
