"""The folded GPT model of one pipeline stage, built from megatron-core's GPTModel pieces.

Stage s of p holds two chunks of k = L/(2p) transformer layers (`dhelix.folding`): chunk 0
with layers [s*k, (s+1)*k) and chunk 1 with the mirrored layers [L-(s+1)*k, L-s*k). Stage 0
also holds the embedding, the final norm, the output layer and the loss.

Guarantees:
- Same seed, same weights: every parameter starts with exactly the value stock Megatron's
  GPTModel (same TP/PP/DP/SP layout, same `seed`, seeded by
  `dhelix.parallel.init_megatron_parallel_state`) gives it. Each chunk's layers are drawn
  from the RNG stream of the stock stage that owns them, after replaying what that stage
  builds before them (the embedding on stage 0, its earlier layers: built and dropped, one
  at a time); the untied output layer is drawn after the last layer, as on stock's last
  stage (`megatron_patches.stage_rng`). Cost: model building draws up to k extra layers
  (and on the first two stages one extra embedding); the RNG states are left as found.
- Every layer keeps its global Megatron `layer_number` (1-based), so the model's
  `sharded_state_dict()` uses exactly the checkpoint keys and global offsets of stock
  Megatron's GPTModel (`decoder.layers.*` with the layer axis, `decoder.final_layernorm.*`,
  `embedding.*`, `output_layer.weight`): a checkpoint saved by stock Megatron with any PP
  loads into the folded model, and one saved from the folded model loads into stock.
- The forward of one chunk is megatron-core's own code: GPTModel's `_preprocess` (embedding,
  rotary embeddings) and `_postprocess` (output layer, vocab-parallel cross entropy) and
  TransformerBlock's forward; only which layers a block holds differs.
- Tied embeddings are one parameter on stage 0 used by both ends; Megatron's parallel state
  must be initialised with the folded embedding group (first stage only,
  `dhelix.parallel.init_megatron_parallel_state(..., folded=True)`); the constructor checks
  this instead of hanging in Megatron's tied-weight all-reduce.

Not supported (rejected with an error): virtual pipeline stages, multi-token prediction,
fp8/fp4 layers, heterogeneous layer configs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.models.common.embeddings.language_model_embedding import (
    LanguageModelEmbedding,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.quantization.utils import get_quant_config_or_none
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.utils import get_pg_rank

from dhelix.folding import FIRST_HALF, SECOND_HALF, FoldedLayout
from megatron_patches.stage_rng import pipeline_stage_rng


class FoldedModelError(RuntimeError):
    """The folded model cannot be built for this configuration or parallel state."""


@dataclass
class FoldedBlockSubmodules(TransformerBlockSubmodules):
    """Block spec plus the global 1-based Megatron layer number of each layer spec."""

    global_layer_numbers: list = field(default_factory=list)


def build_numbered_layer(spec: ModuleSpec, config: TransformerConfig, number: int,
                         pg_collection: ProcessGroupCollection, vp_stage=None):
    """One transformer layer with global 1-based `layer_number` `number` on this rank, built
    by the same `build_module` call as TransformerBlock's (so it draws the same random
    numbers as stock Megatron's layer `number`)."""
    if config.fp8 or config.fp4 or config.heterogeneous_block_specs:
        raise FoldedModelError("the folded model does not support fp8/fp4 or "
                               "heterogeneous layer configs")
    # TransformerLayer adds Megatron's per-rank offset to the number it is given.
    offset = get_transformer_layer_offset(config, vp_stage, get_pg_rank(pg_collection.pp))
    layer = build_module(spec, config=config, layer_number=number - offset,
                         pg_collection=pg_collection, vp_stage=vp_stage)
    if layer.layer_number != number:
        raise FoldedModelError(
            f"built layer_number {layer.layer_number}, wanted {number}: this "
            "megatron-core numbers layers differently (see megatron_patches/compat.py)")
    return layer


def layer_specs(spec, num_layers: int) -> list:
    """One layer spec per global layer (0-based): `spec` repeated when it is one
    `ModuleSpec`, else `spec` itself, which must then list `num_layers` specs (a stack of
    different layers, e.g. MoE and dense layers of a `--moe-layer-freq` pattern)."""
    if isinstance(spec, ModuleSpec):
        return [spec] * num_layers
    specs = list(spec)
    if len(specs) != num_layers or not all(isinstance(s, ModuleSpec) for s in specs):
        raise FoldedModelError(f"the folded model needs one layer spec or one per layer "
                               f"({num_layers}); got {len(specs)} entries")
    return specs


class FoldedTransformerBlock(TransformerBlock):
    """A TransformerBlock whose layers carry given global layer numbers instead of the
    contiguous range Megatron derives from the pipeline rank. Forward is TransformerBlock's."""

    def _build_layers(self):
        sub = self.submodules
        numbers = list(sub.global_layer_numbers)
        if len(numbers) != len(sub.layer_specs):
            raise FoldedModelError(
                f"{len(sub.layer_specs)} layer specs but {len(numbers)} layer numbers")
        self.layers = torch.nn.ModuleList([
            build_numbered_layer(spec, self.config, number, self.pg_collection, self.vp_stage)
            for spec, number in zip(sub.layer_specs, numbers)])
        cfg = self.config
        if self.has_final_layernorm_in_this_stage():
            self.final_layernorm = build_module(
                sub.layer_norm, config=cfg, hidden_size=cfg.hidden_size,
                eps=cfg.layernorm_epsilon)
        else:
            self.final_layernorm = None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None):
        """TransformerBlock's sharded state dict (checkpoint keys from the global layer
        numbers), with the state-dict keys renamed to this block's own layer indices."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        offset = get_transformer_layer_offset(
            self.config, self.vp_stage, get_pg_rank(self.pg_collection.pp))
        # TransformerBlock names layer i `layers.{layer_number - 1 - offset}`, which is not
        # its index here; map that name back to the index.
        local = {str(layer.layer_number - 1 - offset): str(i)
                 for i, layer in enumerate(self.layers)}
        head = f"{prefix}layers."
        renamed = {}
        for key, value in sharded.items():
            if key.startswith(head):
                index, rest = key[len(head):].split(".", 1)
                key = f"{head}{local[index]}.{rest}"
            renamed[key] = value
        return renamed


class FoldedDecoder(MegatronModule):
    """The two layer chunks of one stage (`spec`: one layer spec, or one per global layer,
    `layer_specs`): `chunks[0]` (first half, going down the pipeline)
    and `chunks[1]` (mirrored second half, coming back), the latter with the final norm on
    stage 0. Checkpoint keys are those of a single stock `decoder`.

    `chunk_rng(layers)`, if given, returns the context each chunk is built in (`layers`:
    its global 0-based layer indices); FoldedGPTModel uses it to draw every chunk from the
    stock stage's RNG stream."""

    def __init__(self, config: TransformerConfig, spec, final_norm,
                 layout: FoldedLayout, stage: int, pg_collection: ProcessGroupCollection,
                 chunk_rng=None):
        super().__init__(config=config)
        self.input_tensor = None  # read by Megatron's rotary helpers; inputs are explicit here
        specs = layer_specs(spec, layout.num_layers)
        blocks = []
        for chunk in (FIRST_HALF, SECOND_HALF):
            has_final_norm = stage == 0 and chunk == SECOND_HALF
            layers = layout.chunk_layers(stage, chunk)
            sub = FoldedBlockSubmodules(
                layer_specs=[specs[g] for g in layers],
                layer_norm=final_norm if has_final_norm else None,
                global_layer_numbers=[g + 1 for g in layers],
            )
            with chunk_rng(layers) if chunk_rng else contextlib.nullcontext():
                blocks.append(FoldedTransformerBlock(
                    config=config, spec=sub, pre_process=True, post_process=has_final_norm,
                    pg_collection=pg_collection))
        self.chunks = torch.nn.ModuleList(blocks)

    def forward(self, hidden_states, chunk: int, **block_kwargs):
        return self.chunks[chunk](hidden_states=hidden_states, **block_kwargs)

    def set_input_tensor(self, input_tensor) -> None:
        self.input_tensor = input_tensor

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None):
        sharded = {}
        for chunk, block in enumerate(self.chunks):
            part = block.sharded_state_dict(f"{prefix}chunks.{chunk}.", sharded_offsets, metadata)
            replace_prefix_for_sharding(part, f"{prefix}chunks.{chunk}.", prefix)
            sharded.update(part)
        return sharded


def _check_folded_embedding_group(pg_collection: ProcessGroupCollection) -> None:
    group = pg_collection.embd
    if group is None:
        return
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) > 1:
        raise FoldedModelError(
            f"the embedding group spans ranks {ranks}, but a folded model keeps both ends "
            "of the tied embedding on the first stage: initialise Megatron's parallel state "
            "with dhelix.parallel.init_megatron_parallel_state(..., folded=True)")


class FoldedGPTModel(GPTModel):
    """One pipeline stage of a folded GPT: GPTModel's embedding/output/loss (stage 0 only)
    around a `FoldedDecoder`. `forward(..., chunk=c)` runs one chunk of one micro-batch.

    `transformer_layer_spec` is one layer spec for every layer, or a list of one per global
    layer (`layer_specs`: a `--moe-layer-freq` stack of MoE and dense layers).
    `pre_process` and `post_process` are both True on stage 0 (embedding and output layer
    live there) and both False elsewhere. `seed` is the `--seed` Megatron's stages were
    seeded from: every parameter gets stock Megatron's initial value for it (module
    docstring). `rng_prelude`, if given, is what the training loop draws on a stock stage
    between seeding and building its model (`megatron_patches.stage_rng.pipeline_stage_rng`);
    it is replayed after each stage seeding.
    """

    def __init__(self, config: TransformerConfig, transformer_layer_spec, final_norm,
                 layout: FoldedLayout, stage: int, vocab_size: int, max_sequence_length: int,
                 *, seed: int, share_embeddings_and_output_weights: bool = True,
                 position_embedding_type: str = "learned_absolute", rotary_percent: float = 1.0,
                 rotary_base: int = 10000, pg_collection: ProcessGroupCollection | None = None,
                 rng_prelude=None):
        if (config.num_layers, config.pipeline_model_parallel_size) != (
                layout.num_layers, layout.pipeline_size):
            raise FoldedModelError(
                f"config has {config.num_layers} layers over PP "
                f"{config.pipeline_model_parallel_size}, layout has {layout.num_layers} over "
                f"{layout.pipeline_size}")
        if config.virtual_pipeline_model_parallel_size or config.mtp_num_layers:
            raise FoldedModelError("the folded model does not support virtual pipeline "
                                   "stages or multi-token prediction")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        _check_folded_embedding_group(pg_collection)
        first = stage == 0
        # GPTModel builds an empty decoder here; the folded one replaces it below. The
        # embedding is the first thing stock stage 0 draws; an untied output layer drawn
        # here is redrawn after the last layer (`_stock_stream`).
        self._rng_prelude = rng_prelude
        with pipeline_stage_rng(seed, 0, rng_prelude):
            super().__init__(
                config=config,
                transformer_layer_spec=TransformerBlockSubmodules(layer_specs=[],
                                                                  layer_norm=None),
                vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                pre_process=first, post_process=first,
                share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                position_embedding_type=position_embedding_type, rotary_percent=rotary_percent,
                rotary_base=rotary_base, pg_collection=pg_collection,
            )
        self.layout = layout
        self.stage = stage
        self._init_seed = seed
        self._layer_specs = layer_specs(transformer_layer_spec, layout.num_layers)
        self._embedding_type = position_embedding_type
        self.decoder = FoldedDecoder(config, transformer_layer_spec, final_norm, layout, stage,
                                     self.pg_collection, chunk_rng=self._stock_stream)
        for name, module in self.decoder.named_modules(prefix="decoder"):
            if hasattr(module, "finish_init"):
                module.finish_init(get_quant_config_or_none(name, config.quant_recipe))

    @contextlib.contextmanager
    def _stock_stream(self, layers: range):
        """Build the chunk holding global layers `layers` inside this: the RNG stream of the
        stock stage that owns them, advanced past what that stage builds before them (the
        embedding on stage 0, its earlier layers; built and dropped one at a time). After
        the model's last layer (and the final norm) it redraws an untied output layer, as
        stock's last stage draws it there. Every RNG state is restored on exit."""
        stage, index = self.layout.stock_position(layers[0])
        if self.layout.stock_position(layers[-1]) != (stage, index + len(layers) - 1):
            raise FoldedModelError(f"layers {layers[0]}..{layers[-1]} are not contiguous on "
                                   "one stock pipeline stage")
        with pipeline_stage_rng(self._init_seed, stage, self._rng_prelude):
            if stage == 0:
                LanguageModelEmbedding(  # GPTModel's first module on stock stage 0
                    config=self.config, vocab_size=self.vocab_size,
                    max_sequence_length=self.max_sequence_length,
                    position_embedding_type=self._embedding_type, tp_group=self.pg_collection.tp)
            for g in range(layers[0] - index, layers[0]):
                build_numbered_layer(self._layer_specs[g], self.config, g + 1,
                                     self.pg_collection)
            yield
            if (layers[-1] == self.layout.num_layers - 1 and self.post_process
                    and not self.share_embeddings_and_output_weights):
                self._redraw_output_layer()

    def _redraw_output_layer(self) -> None:
        """Draw the output layer's weight as GPTModel does on the last stock stage."""
        stock = tensor_parallel.ColumnParallelLinear(
            self.config.hidden_size, self.vocab_size, config=self.config,
            init_method=self.config.init_method, bias=False, skip_bias_add=False,
            gather_output=not self.parallel_output, tp_group=self.pg_collection.tp)
        with torch.no_grad():
            self.output_layer.weight.copy_(stock.weight)

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                *, chunk: int, loss_mask=None, packed_seq_params=None):
        """Run chunk `chunk` (0 or 1) of this stage on one micro-batch.

        Chunk 0 on stage 0 embeds `input_ids`/`position_ids`; every other chunk takes the
        previous hop's output as `decoder_input` ([s, b, h], sequence-sharded under SP).
        Chunk 1 on stage 0 returns the per-token loss [b, s] when `labels` are given, else
        logits [b, s, v/tp]; every other chunk returns its hidden states.
        """
        if chunk not in (FIRST_HALF, SECOND_HALF):
            raise ValueError(f"chunk must be 0 or 1, got {chunk!r}")
        embeds = self.pre_process and chunk == FIRST_HALF
        if embeds:
            decoder_input = None
        elif decoder_input is None:
            raise ValueError(f"stage {self.stage} chunk {chunk} needs decoder_input (the "
                             "previous hop's output)")
        (decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset,
         _padding) = self._preprocess(
            input_ids=input_ids, position_ids=position_ids, decoder_input=decoder_input,
            packed_seq_params=packed_seq_params)[:6]
        hidden_states = self.decoder(
            decoder_input, chunk, attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin, packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset)
        if not (self.post_process and chunk == SECOND_HALF):
            return hidden_states
        return self._postprocess(
            hidden_states=hidden_states, input_ids=input_ids, position_ids=position_ids,
            labels=labels, rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin, mtp_in_postprocess=False, loss_mask=loss_mask,
            decoder_input=decoder_input, attention_mask=attention_mask,
            packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset)
