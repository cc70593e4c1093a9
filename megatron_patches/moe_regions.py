"""Run the parts of megatron-core's `MoELayer` (alltoall token dispatcher, dropless, expert
tensor parallelism 1, any tensor parallelism with sequence parallelism) between its
communications, for the MoE operators (`dhelix.ops.moe_kernels`). The only
code touching MoE internals, as `layer_regions` is for the dense layer.

Each region calls Megatron's own code on Megatron's own modules: the router
(`MoELayer.route`: gating, top-k, the auxiliary load-balancing loss attached to the
probabilities and recorded in Megatron's MoE metrics tracker), `moe_utils.permute` /
`unpermute` / `sort_chunks_by_idxs` with the dispatcher's sort indices, and each local
expert's own MLP code between its GEMMs (`layer_regions.expert_activation` /
`expert_fc2_bias`; the GEMMs are the operators' own, as for the dense MLP). What `MoEAlltoAllTokenDispatcher` keeps on itself between
its steps (split sizes, permutation rows, routing map) is returned here as values, which the
operators hold per micro-batch, so two micro-batches can be in flight in one layer.
`dispatch_splits` repeats the dispatcher's `preprocess` arithmetic for expert tensor
parallelism 1 (dropless), from the token counts the operators exchanged themselves;
`record_tracker_state` keeps the tracker untouched by a measurement run.

With expert tensor parallelism 1 the dispatcher's own "TP" group (Megatron's expert-TP
group) has one rank, so Megatron all-gathers no tokens around the experts even when the
attention's TP is larger: under sequence parallelism each TP rank routes its own sequence
shard, its token-count exchange group (expert-TP x EP) is the EP group, and the only
communication over the attention's TP group is the router's all-reduce of token counts
for the auxiliary loss (`route_deferring_aux_loss` / `attach_aux_loss`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


def route(moe_layer, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [tokens, experts] with the aux-loss attached when training, routing map
    [tokens, experts] bool): `MoELayer.route` on the MLP input [s, b, h]."""
    return moe_layer.route(hidden)


@dataclass(frozen=True)
class DeferredRoute:
    """`MoELayer.route` with the auxiliary loss not yet attached: the probabilities, the
    routing map, the scores the loss is computed from (None when the router attaches no
    loss: evaluation, or no aux loss) and this rank's token count per expert under the
    aux-loss routing (zeros without scores)."""

    probs: torch.Tensor
    routing_map: torch.Tensor
    scores: torch.Tensor | None
    local_counts: torch.Tensor


def route_deferring_aux_loss(moe_layer, hidden: torch.Tensor) -> DeferredRoute:
    """`MoELayer.route` on the MLP input (through the router module, so its hooks run) with
    `TopKRouter._apply_aux_loss` held back: Megatron's version all-reduces the token
    counts over the router's TP x CP group inside the call; here the counts are returned
    for the operators to all-reduce on their own lane, and `attach_aux_loss` finishes
    the loss. Only the `aux_loss` balancing type is deferred (`moe_support` refuses the
    others)."""
    router = moe_layer.router
    held = {}

    def hold(probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        if with_padding_mask:
            raise NotImplementedError("the MoE operators route without a padding mask")
        held.update(scores=scores_for_aux_loss, map=routing_map)
        return probs

    router._apply_aux_loss = hold  # an instance attribute shadowing the method, this call only
    try:
        probs, routing_map = moe_layer.route(hidden)
    finally:
        del router._apply_aux_loss
    scores = held.get("scores")
    if scores is None:
        counts = torch.zeros(routing_map.shape[1], dtype=torch.long, device=routing_map.device)
    else:
        # `get_tokens_per_expert_and_token_count`: the local count before its all-reduce
        counts = held["map"].sum(dim=0)
    return DeferredRoute(probs=probs, routing_map=routing_map, scores=scores,
                         local_counts=counts)


def attach_aux_loss(moe_layer, probs: torch.Tensor, scores: torch.Tensor | None,
                    reduced_counts: torch.Tensor) -> torch.Tensor:
    """The rest of `TopKRouter._apply_aux_loss` after its all-reduce: the switch
    load-balancing loss from `scores` and the token counts per expert summed over the
    router's TP x CP group (`reduced_counts`), over that group's tokens, attached to
    `probs` and recorded in Megatron's MoE metrics tracker, as Megatron's router does.
    `probs` unchanged (as a view) without scores."""
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

    if scores is None:
        return probs.view_as(probs)
    router = moe_layer.router
    coeff = router.get_aux_loss_coeff("aux_loss")
    local_tokens = scores.shape[0]
    aux_loss = switch_load_balancing_loss_func(
        probs=scores, tokens_per_expert=reduced_counts,
        total_num_tokens=local_tokens * router.tp_cp_group.size(), topk=router.topk,
        num_experts=router.config.num_moe_experts, moe_aux_loss_coeff=coeff,
        fused=router.config.moe_router_fusion)
    return router.attach_and_log_load_balancing_loss(
        probs, coeff, aux_loss, "load_balancing_loss", router.tp_cp_group,
        valid_token_count=local_tokens)


def local_token_counts(routing_map: torch.Tensor) -> torch.Tensor:
    """Tokens this rank routes to each expert (`preprocess`: `routing_map.sum(0).long()`)."""
    return routing_map.sum(dim=0).long()


def permute_tokens(moe_layer, hidden: torch.Tensor, probs: torch.Tensor,
                   routing_map: torch.Tensor):
    """`dispatch_preprocess`'s permutation: (token rows grouped by expert [T*k, h], their
    probabilities [T*k], the permutation rows unpermute needs)."""
    from megatron.core.transformer.moe.moe_utils import permute

    config = moe_layer.config
    flat = hidden.view(-1, hidden.shape[-1])
    tokens, permuted_probs, rows, _, _ = permute(
        flat, routing_map, probs=probs, num_out_tokens=routing_map.size(0) * config.moe_router_topk,
        fused=config.moe_permute_fusion, drop_and_pad=False)
    return tokens, permuted_probs, rows


@dataclass(frozen=True)
class DispatchSplits:
    """Per micro-batch all-to-all metadata of one MoE layer, on the host: rows sent to /
    received from each expert-parallel rank, tokens per local expert, received tokens per
    (source rank, local expert) (`num_global_tokens_per_local_expert`, a CPU tensor as
    megatron-core's unfused dispatcher keeps it; `--moe-permute-fusion` is refused), and
    this rank's routed rows per global expert (`sent_per_expert`: the sizes of the permuted
    rows' groups, in expert order)."""

    input_splits: tuple
    output_splits: tuple
    tokens_per_expert: tuple
    per_local_expert: torch.Tensor
    sent_per_expert: tuple

    def one_expert_exchange(self, local_expert: int) -> tuple[list, list, list]:
        """The all-to-all that carries local expert `local_expert`'s rows alone toward the
        experts (the combine's gradient split by local expert, `moe_program`): (the (start,
        stop) range of this rank's permuted rows it sends to each expert-parallel rank, in
        group order: that rank's local expert `local_expert`; the send split sizes; the
        receive split sizes, one per source rank). The rows received, in source-rank order,
        are that expert's rows as `sort_received` orders them (host integers only)."""
        local = self.per_local_expert.shape[1]
        starts = [0]
        for count in self.sent_per_expert:
            starts.append(starts[-1] + count)
        ranges = [(starts[e], starts[e + 1])
                  for e in range(local_expert, len(self.sent_per_expert), local)]
        receive = [int(n) for n in self.per_local_expert[:, local_expert].tolist()]
        return ranges, [stop - start for start, stop in ranges], receive


def dispatch_splits(moe_layer, gathered: torch.Tensor, ep_rank: int) -> DispatchSplits:
    """The alltoall dispatcher's `preprocess` for expert tensor parallelism 1 (dropless)
    from the token counts of every rank of the expert-parallel group (`gathered`,
    [ep * experts] in group order). Reads `gathered` on the host once (megatron-core's
    dispatcher also synchronises once for its split sizes); every later use of the split
    sizes (the experts' row ranges, the sorts, the backward all-to-alls) reads host
    integers, so no operator after the dispatch waits for the device."""
    dispatcher = moe_layer.token_dispatcher
    if dispatcher.tp_size != 1:
        raise NotImplementedError(f"the MoE operators need expert tensor parallelism 1, the "
                                  f"dispatcher has {dispatcher.tp_size}")
    ep, experts = dispatcher.ep_size, dispatcher.num_experts
    local_experts = dispatcher.num_local_experts
    counts = gathered.tolist()
    sent = [counts[rank * experts:(rank + 1) * experts] for rank in range(ep)]
    mine = sent[ep_rank]
    input_splits = tuple(sum(mine[q * local_experts:(q + 1) * local_experts])
                         for q in range(ep))
    first = dispatcher.local_expert_indices[0]
    per_local = [row[first:first + local_experts] for row in sent]
    return DispatchSplits(
        input_splits=input_splits,
        output_splits=tuple(sum(row) for row in per_local),
        tokens_per_expert=tuple(sum(row[j] for row in per_local) for j in range(local_experts)),
        per_local_expert=torch.tensor(per_local, dtype=gathered.dtype, device="cpu"),
        sent_per_expert=tuple(mine))


def sort_received(moe_layer, tokens: torch.Tensor, probs: torch.Tensor,
                  splits: DispatchSplits):
    """`dispatch_postprocess` for expert TP 1: the received rows (and probabilities) sorted by
    local expert (unchanged, as views, with one local expert)."""
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    dispatcher = moe_layer.token_dispatcher
    if dispatcher.num_local_experts == 1:
        return tokens.view_as(tokens), probs.view_as(probs)
    return sort_chunks_by_idxs(tokens, splits.per_local_expert.ravel(),
                               dispatcher.sort_input_by_local_experts, probs=probs,
                               fused=moe_layer.config.moe_permute_fusion)


def unsort_expert_rows(moe_layer, rows: torch.Tensor, splits: DispatchSplits) -> torch.Tensor:
    """`combine_preprocess` for expert TP 1: expert output rows back in received order."""
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    dispatcher = moe_layer.token_dispatcher
    if dispatcher.num_local_experts == 1:
        return rows
    output, _ = sort_chunks_by_idxs(rows, splits.per_local_expert.T.ravel(),
                                    dispatcher.restore_output_by_local_experts,
                                    fused=moe_layer.config.moe_permute_fusion)
    return output


def local_experts(moe_layer) -> list:
    """The rank's local experts (megatron-core MLPs), in order."""
    return list(moe_layer.experts.local_experts)


def expert_rows(splits: DispatchSplits) -> list:
    """(start, stop) of each local expert's rows in the sorted received rows (SequentialMLP
    splits them by `tokens_per_expert`)."""
    bounds, start = [], 0
    for count in splits.tokens_per_expert:
        bounds.append((start, start + count))
        start += count
    return bounds


def unpermute_tokens(moe_layer, rows_back: torch.Tensor, permutation_rows: torch.Tensor,
                     routing_map: torch.Tensor, hidden_shape) -> torch.Tensor:
    """`combine_postprocess`: the combined expert rows summed back into token order,
    reshaped to the MLP input's [s, b, h]."""
    from megatron.core.transformer.moe.moe_utils import unpermute

    tokens = routing_map.size(0)
    output = unpermute(rows_back, permutation_rows, restore_shape=torch.Size(
        (tokens, hidden_shape[-1])), routing_map=routing_map,
        fused=moe_layer.config.moe_permute_fusion, drop_and_pad=False)
    return output.view(hidden_shape)


def is_moe_layer(layer) -> bool:
    return bool(getattr(layer, "is_moe_layer", False))


def check_supported_moe_layer(layer) -> list:
    """Sentences naming what the MoE operators do not implement in `layer`'s MLP (empty:
    supported): megatron-core's MoELayer with a TopKRouter, the alltoall dispatcher and
    SequentialMLP experts, shared experts as `check_supported_shared_expert` allows."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    mlp = layer.mlp
    if type(mlp) is not MoELayer:
        return [f"the MoE layer's mlp must be megatron-core's MoELayer, got {type(mlp).__name__}"]
    problems = []
    if type(mlp.router) is not TopKRouter:
        problems.append(f"router {type(mlp.router).__name__} (TopKRouter only)")
    if not isinstance(mlp.token_dispatcher, MoEAlltoAllTokenDispatcher):
        problems.append(f"token dispatcher {type(mlp.token_dispatcher).__name__} (alltoall only)")
    if not isinstance(mlp.experts, SequentialMLP):
        problems.append(f"experts {type(mlp.experts).__name__} (SequentialMLP only: drop "
                        "--moe-grouped-gemm)")
    else:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        for index, expert in enumerate(mlp.experts.local_experts):
            fc1, fc2 = expert.linear_fc1, expert.linear_fc2
            if not (type(fc1) is ColumnParallelLinear and type(fc2) is RowParallelLinear
                    and fc1.skip_bias_add and fc2.skip_bias_add):
                problems.append(f"local expert {index}'s linears must be Column/RowParallelLinear "
                                "that skip their bias add (the local spec)")
    if mlp.shared_experts is not None:
        problems.extend(check_supported_shared_expert(mlp.shared_experts))
    return problems


def check_supported_shared_expert(shared) -> list:
    """Sentences naming what the shared-expert operators (`dhelix.ops.moe_shared_program`)
    do not implement in an MoELayer's `shared_experts` (empty: supported): megatron-core's
    SharedExpertMLP without its gate or overlap, whose linears are Column/RowParallelLinear
    without biases that skip their bias add (the dense MLP's layout)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    if type(shared) is not SharedExpertMLP:
        return [f"shared experts {type(shared).__name__} (SharedExpertMLP only)"]
    problems = []
    if shared.use_shared_expert_gate:
        problems.append("the shared expert's gate (--moe-shared-expert-gate)")
    if shared.config.moe_shared_expert_overlap:
        problems.append("--moe-shared-expert-overlap")
    fc1, fc2 = shared.linear_fc1, shared.linear_fc2
    if not (type(fc1) is ColumnParallelLinear and type(fc2) is RowParallelLinear
            and fc1.skip_bias_add and fc2.skip_bias_add and fc1.bias is None
            and fc2.bias is None and not fc1.gather_output and fc2.input_is_parallel):
        problems.append("the shared expert's linears must be Column/RowParallelLinear without "
                        "biases (the local spec)")
    return problems


@contextlib.contextmanager
def record_tracker_state():
    """Leave Megatron's MoE metrics tracker (the recorded load-balancing losses) as it was:
    for runs of MoE layers that are measurements, not training."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    saved = {name: entry.values.clone() for name, entry in tracker.metrics.items()}
    try:
        yield
    finally:
        for name in list(tracker.metrics):
            if name in saved:
                tracker.metrics[name].values.copy_(saved[name])
            else:
                del tracker.metrics[name]
