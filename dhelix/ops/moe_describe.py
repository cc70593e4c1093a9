"""Symbolic description of an MoE layer's MLP (megatron-core's `MoELayer`): what the MoE
operators depend on, and the one place that says which MoE configurations they implement.

Supported: top-k routing by megatron-core's `TopKRouter` (softmax or sigmoid scores, with
the auxiliary load-balancing loss `aux_loss` or no balancing loss), the all-to-all token
dispatcher (dropless: no capacity factor), local experts run by `SequentialMLP` (the local
spec without `--moe-grouped-gemm`), expert tensor parallelism 1, and tensor parallelism 1
or larger with sequence parallelism (each TP rank routes its own sequence shard;
`megatron_patches.moe_support`, which the `--dhelix` argument checks share). Everything
else raises `UnsupportedLayerError` naming the setting.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_patches.moe_support import balancing_type, check_supported_moe  # noqa: F401


@dataclass(frozen=True)
class MoEDescription:
    """The MoE MLP on one rank of its expert-parallel group `ep_ranks` (global ranks)."""

    num_experts: int
    topk: int
    ffn_hidden_size: int
    ep_ranks: tuple
    aux_loss: bool  # the aux_loss balancing loss is attached to the routing probabilities

    def __post_init__(self):
        object.__setattr__(self, "ep_ranks", tuple(self.ep_ranks))

    def problems(self) -> list:
        """Sentences naming sizes the MoE operators cannot lay out (empty: none)."""
        found = []
        if not self.ep_ranks or self.num_experts % self.ep_size:
            found.append(f"{self.num_experts} experts do not divide over expert-parallel "
                         f"size {self.ep_size}")
        if not 1 <= self.topk <= self.num_experts:
            found.append(f"router top-k {self.topk} must be in 1..{self.num_experts}")
        return found

    @property
    def ep_size(self) -> int:
        return len(self.ep_ranks)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    def received_high(self, tokens: int) -> int:
        """The most token rows one rank's experts can receive: each of the `ep_size`
        ranks sends every one of its `tokens` at most once to each local expert."""
        return self.ep_size * tokens * min(self.topk, self.num_local_experts)

    def summary(self) -> str:
        return (f"moe {self.num_experts} experts top-{self.topk} ffn={self.ffn_hidden_size} "
                f"{'aux-loss' if self.aux_loss else 'no balancing loss'}, "
                f"ep-group {list(self.ep_ranks)}")

    @classmethod
    def from_config(cls, config, ep_ranks) -> "MoEDescription":
        return cls(num_experts=config.num_moe_experts, topk=config.moe_router_topk,
                   ffn_hidden_size=config.moe_ffn_hidden_size or config.ffn_hidden_size,
                   ep_ranks=tuple(ep_ranks),
                   aux_loss=balancing_type(config) == "aux_loss"
                   and bool(config.moe_aux_loss_coeff))


def moe_layer_pattern(config) -> list:
    """1 for each MoE layer, 0 for each dense layer, as megatron-core's GPT layer specs read
    `moe_layer_freq` (an int: every freq-th layer from the first; a list: as given); all
    zeros without experts."""
    layers = config.num_layers
    if not getattr(config, "num_moe_experts", None):
        return [0] * layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(layers)]
    return [1 if f else 0 for f in freq]
