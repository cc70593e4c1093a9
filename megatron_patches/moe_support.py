"""Which MoE settings the DHelix MoE operators implement, read off a megatron-core
TransformerConfig or Megatron's argument namespace (the attribute names are shared; the
expert count is `num_moe_experts` on a config, `num_experts` on the arguments). One list
serves the layer description (`dhelix.ops.moe_describe`) and the `--dhelix` refusals before
any process group exists (`dhelix.megatron_lm_checks`)."""

from __future__ import annotations

BALANCING = ("aux_loss", "none")


def balancing_type(config):
    """The load-balancing type (a one-element list reads as its element)."""
    kind = getattr(config, "moe_router_load_balancing_type", "aux_loss")
    if isinstance(kind, (list, tuple)):
        return kind[0] if len(kind) == 1 else list(kind)
    return kind


_UNSUPPORTED_FLAGS = (
    ("moe_grouped_gemm", "--moe-grouped-gemm (the operators run SequentialMLP's local "
                         "experts; drop it)"),
    ("moe_shared_expert_intermediate_size", "shared experts "
                                            "(--moe-shared-expert-intermediate-size)"),
    ("moe_expert_capacity_factor", "token dropping (--moe-expert-capacity-factor)"),
    ("moe_pad_expert_input_to_capacity", "--moe-pad-expert-input-to-capacity"),
    ("moe_router_padding_for_quantization", "router padding for quantization"),
    ("moe_z_loss_coeff", "the router z-loss (--moe-z-loss-coeff)"),
    ("moe_input_jitter_eps", "router input jitter (--moe-input-jitter-eps)"),
    ("moe_router_enable_expert_bias", "the router's expert bias "
                                      "(--moe-router-enable-expert-bias)"),
    ("moe_router_num_groups", "group-limited routing (--moe-router-num-groups)"),
    ("moe_router_force_load_balancing", "--moe-router-force-load-balancing"),
    ("moe_router_force_biased", "--moe-router-force-biased"),
    ("moe_permute_fusion", "--moe-permute-fusion"),
    ("moe_router_fusion", "--moe-router-fusion"),
    ("moe_apply_probs_on_input", "--moe-apply-probs-on-input"),
    ("moe_latent_size", "MoE latent projections (--moe-latent-size)"),
    ("moe_enable_routing_replay", "routing replay"),
    ("overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm (Megatron's own "
                                         "MoE overlap; DHelix overlaps the all-to-alls itself)"),
    ("moe_shared_expert_overlap", "--moe-shared-expert-overlap"),
)


def check_supported_moe(config) -> list:
    """Sentences naming each MoE setting of `config` the MoE operators do not implement
    (empty: supported)."""
    problems = []
    dispatcher = getattr(config, "moe_token_dispatcher_type", "allgather")
    if dispatcher != "alltoall":
        problems.append(f"MoE token dispatcher {dispatcher!r} is not supported by the operator "
                        "programs; use --moe-token-dispatcher-type alltoall")
    balancing = balancing_type(config)
    if balancing not in BALANCING:
        problems.append(f"MoE load balancing {balancing!r} is not supported; use "
                        "--moe-router-load-balancing-type aux_loss or none")
    tp = getattr(config, "tensor_model_parallel_size", 1) or 1
    if tp > 1 and not getattr(config, "sequence_parallel", False):
        problems.append("MoE layers with --tensor-model-parallel-size > 1 need "
                        "--sequence-parallel (Megatron's MoE layer refuses to train without it)")
    # Megatron sets an unset --expert-tensor-parallel-size to the tensor-parallel size
    etp = getattr(config, "expert_tensor_parallel_size", None) or tp
    if etp != 1:
        problems.append(f"expert tensor parallelism {etp} is not supported (Megatron defaults "
                        "--expert-tensor-parallel-size to the tensor-parallel size); use "
                        "--expert-tensor-parallel-size 1")
    for name, text in _UNSUPPORTED_FLAGS:
        if getattr(config, name, None):
            problems.append(f"{text} is not supported by the MoE operators")
    return problems
