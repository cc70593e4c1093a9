"""Model folding: which layers each pipeline stage holds, and the route a micro-batch takes.

With p pipeline stages and L transformer layers (L divisible by 2p), k = L / (2p) and
stage s holds two chunks of k layers each:

- chunk 0 (first half): layers [s*k, (s+1)*k)
- chunk 1 (mirrored second half): layers [L-(s+1)*k, L-s*k)

so the layers make a U across the stages: stage 0 holds the first and the last k layers,
stage p-1 the two middle chunks. The embedding and the output layer with the loss both live
on stage 0. A micro-batch's forward visits (stage, chunk) hops
(0,0) -> (1,0) -> ... -> (p-1,0) -> (p-1,1) -> ... -> (0,1); its backward visits them in
reverse. The turn between (p-1,0) and (p-1,1) stays on one stage and needs no communication.

Layer numbers here are 0-based global indices (Megatron's `layer_number` is this plus one).
This module is pure Python: no torch, no Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

FIRST_HALF, SECOND_HALF = 0, 1
CHUNKS_PER_STAGE = 2


def uses_folded_model(args) -> bool:
    """True when a run with these (Megatron-style) arguments trains the folded model: `--dhelix`
    with `--pipeline-model-parallel-size` > 1 (the W-shaped schedule needs it)."""
    return bool(getattr(args, "dhelix", False)) and args.pipeline_model_parallel_size > 1


class FoldingError(ValueError):
    """A model/pipeline size that cannot be folded; the message names the arguments."""


@dataclass(frozen=True)
class FoldedLayout:
    """The folded layer assignment for `num_layers` layers over `pipeline_size` stages.

    Construction validates the sizes and raises `FoldingError` naming `--num-layers` and
    `--pipeline-model-parallel-size` when L is not a positive multiple of 2p.
    """

    num_layers: int
    pipeline_size: int

    def __post_init__(self):
        L, p = self.num_layers, self.pipeline_size
        if not isinstance(p, int) or p < 1:
            raise FoldingError(f"--pipeline-model-parallel-size must be >= 1, got {p!r}")
        if not isinstance(L, int) or L < 1 or L % (2 * p):
            raise FoldingError(
                f"model folding needs --num-layers divisible by 2 x "
                f"--pipeline-model-parallel-size: --num-layers {L} is not a multiple of "
                f"2 x {p} = {2 * p}; choose a layer count that is a multiple of {2 * p}"
            )

    @property
    def layers_per_chunk(self) -> int:
        """k = L / (2p)."""
        return self.num_layers // (2 * self.pipeline_size)

    def chunk_layers(self, stage: int, chunk: int) -> range:
        """Global 0-based layer indices of `chunk` (0 or 1) on `stage`, in execution order."""
        self._check_stage(stage)
        k, L = self.layers_per_chunk, self.num_layers
        if chunk == FIRST_HALF:
            return range(stage * k, (stage + 1) * k)
        if chunk == SECOND_HALF:
            return range(L - (stage + 1) * k, L - stage * k)
        raise FoldingError(f"chunk must be 0 or 1, got {chunk!r}")

    def stage_layers(self, stage: int) -> list[int]:
        """All global layer indices held by `stage`: chunk 0's, then chunk 1's."""
        return list(self.chunk_layers(stage, FIRST_HALF)) + list(
            self.chunk_layers(stage, SECOND_HALF))

    def locate(self, layer: int) -> tuple[int, int]:
        """(stage, chunk) that holds global layer index `layer`."""
        if not 0 <= layer < self.num_layers:
            raise FoldingError(f"layer {layer} is outside [0, {self.num_layers})")
        k, p = self.layers_per_chunk, self.pipeline_size
        position = layer // k  # which of the 2p chunks along the forward route
        if position < p:
            return position, FIRST_HALF
        return 2 * p - 1 - position, SECOND_HALF

    def stock_position(self, layer: int) -> tuple[int, int]:
        """(stage, index) of global layer index `layer` in stock Megatron's pipeline with the
        same sizes: L/p contiguous layers per stage (Megatron's even split), so `index` is
        how many layers that stage builds before this one."""
        self.locate(layer)
        per_stage = self.num_layers // self.pipeline_size
        return layer // per_stage, layer % per_stage

    def forward_route(self) -> list[tuple[int, int]]:
        """(stage, chunk) hops of one micro-batch's forward pass, in order (2p hops)."""
        p = self.pipeline_size
        return [(s, FIRST_HALF) for s in range(p)] + [
            (s, SECOND_HALF) for s in reversed(range(p))]

    def backward_route(self) -> list[tuple[int, int]]:
        """(stage, chunk) hops of one micro-batch's backward pass: the forward route reversed."""
        return list(reversed(self.forward_route()))

    def paired_layer(self, layer: int) -> int:
        """The layer whose backward pairs with `layer`'s forward in an SI block: L-1-layer,
        always on the same stage."""
        self.locate(layer)
        return self.num_layers - 1 - layer

    def _check_stage(self, stage: int) -> None:
        if not 0 <= stage < self.pipeline_size:
            raise FoldingError(
                f"stage {stage} is outside [0, {self.pipeline_size}) "
                f"(--pipeline-model-parallel-size {self.pipeline_size})"
            )
