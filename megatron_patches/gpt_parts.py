"""GPTModel split at the decoder layers, so a schedule can run the layers itself.

`pre` and `post` call megatron-core's own `GPTModel._preprocess` / `_postprocess` (private
in megatron-core 0.19.2, hence here): embedding (with the sequence-parallel scatter), the
RoPE table, the final norm, the output layer (with the SP gather) and the per-token loss are
Megatron's code, unchanged. Works on a stock GPTModel (one layer chunk) and on a folded stage
(`megatron_patches.folded_model.FoldedGPTModel`: two chunks, embedding and loss on stage 0). Only the plain training path is supported: no multi-token prediction, no
packed sequences, no inference context, no virtual pipeline; anything else is refused.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import Float16Module, float16_to_fp32, fp32_to_float16
from megatron.core.utils import make_viewless_tensor

from megatron_patches import deferred_reduce
from megatron_patches.tied_embedding import tied_embedding_gradient


class UnsupportedModelError(ValueError):
    """The model uses a feature the DHelix layer split does not handle."""


def unwrap_gpt(model) -> GPTModel:
    """The GPTModel inside DDP / Float16Module wrappers."""
    inner = model
    while not isinstance(inner, GPTModel):
        if not hasattr(inner, "module"):
            raise UnsupportedModelError(f"expected a megatron-core GPTModel, got "
                                        f"{type(model).__name__}")
        inner = inner.module
    return inner


def float16_wrapper(model) -> Float16Module | None:
    """The `Float16Module` (`--bf16`/`--fp16`) among `model`'s wrappers, or None."""
    inner = model
    while not isinstance(inner, GPTModel):
        if isinstance(inner, Float16Module):
            return inner
        inner = getattr(inner, "module", None)
        if inner is None:
            return None
    return None


@dataclass
class PreOutput:
    """What `pre` produced for one micro-batch. `decoder_input` is the embedding output
    with its autograd graph (the caller back-propagates into it), or the hidden states
    handed in on a stage without the embedding; `rotary_pos_emb` is None without RoPE."""

    decoder_input: torch.Tensor
    rotary_pos_emb: object


class GPTParts:
    """Embedding / decoder layers / final norm + output + loss of one GPTModel chunk.

    `whole_model=True` (the PP=1 schedule) requires the embedding and the output layer on
    this rank.

    Precision: under Megatron's `Float16Module` (`--bf16`) `pre` and `post` convert where the
    wrapper converts on the model's ends, fp32 inputs of the embedding to bf16 and the
    output of the loss tail to fp32 (`Float16Module.forward` on the first and last stage;
    `megatron_patches.folded_float16` for the folded model, whose ends are both on stage 0).
    Tied embeddings: the schedules run every backward of the loss tail (`post`'s output)
    inside `tied_loss_tail()`, every backward into the embedding (`pre`'s output) inside
    `tied_embedding()`, and (folded stages) `finish_step()` after a step's last pass, so
    the shared weight's two gradients are summed as stock Megatron sums them
    (`megatron_patches.tied_embedding`; `tied` is None where this rank has no tied weight
    with both ends)."""

    def __init__(self, model, whole_model: bool = True):
        self.model = unwrap_gpt(model)
        self._float16 = float16_wrapper(model)
        m = self.model
        if getattr(m, "mtp_process", False):
            raise UnsupportedModelError("multi-token prediction is not supported with --dhelix")
        if whole_model and not (m.pre_process and m.post_process):
            raise UnsupportedModelError("the PP=1 DHelix schedule needs the whole model on "
                                        "one stage (pre_process and post_process)")
        self.tied = tied_embedding_gradient(m, whole_model)
        # whether the embedding's TP all-reduce can run asynchronously, exactly
        # (`megatron_patches.deferred_reduce`)
        self.embedding_reduce_deferrable = deferred_reduce.embedding_deferrable(m)

    @property
    def layers(self) -> list:
        """Every decoder layer of this rank, chunk by chunk."""
        return [layer for chunk in range(self.num_chunks) for layer in self.chunk_layers(chunk)]

    @property
    def num_chunks(self) -> int:
        chunks = getattr(self.model.decoder, "chunks", None)
        return 1 if chunks is None else len(chunks)

    def chunk_layers(self, chunk: int) -> list:
        """The layers of chunk `chunk` in forward order (a stock model has chunk 0 only)."""
        chunks = getattr(self.model.decoder, "chunks", None)
        if chunks is None:
            if chunk != 0:
                raise ValueError(f"a stock GPTModel has one layer chunk, not chunk {chunk}")
            return list(self.model.decoder.layers)
        return list(chunks[chunk].layers)

    @property
    def final_norm(self):
        """The final norm module, or None where this rank has none."""
        chunks = getattr(self.model.decoder, "chunks", None)
        if chunks is None:
            return self.model.decoder.final_layernorm
        return chunks[-1].final_layernorm

    def tied_loss_tail(self):
        """Context for a backward of the loss tail (see the class docstring)."""
        return self.tied.loss_tail() if self.tied is not None else contextlib.nullcontext()

    def tied_embedding(self):
        """Context for a backward into the embedding (see the class docstring)."""
        return self.tied.embedding() if self.tied is not None else contextlib.nullcontext()

    def finish_step(self) -> None:
        """After a step's last pass, before Megatron's `finalize_model_grads`."""
        if self.tied is not None:
            self.tied.finish_step()

    def pre(self, input_ids, position_ids, decoder_input=None) -> PreOutput:
        """Embedding (when `decoder_input` is None) and the RoPE table of one micro-batch."""
        if decoder_input is None and self._float16 is not None:
            input_ids, position_ids = fp32_to_float16((input_ids, position_ids),
                                                      self._float16.float16_convertor)
        out = self.model._preprocess(input_ids=input_ids, position_ids=position_ids,
                                     decoder_input=decoder_input)
        return PreOutput(decoder_input=out[0], rotary_pos_emb=out[1])

    def pre_deferred(self, input_ids, position_ids):
        """`pre` of the embedding with its TP all-reduce left in flight (only where
        `embedding_reduce_deferrable`): (the `PreOutput`, whose `decoder_input` carries the
        graph but not yet the summed values, the layer input as a `dhelix.arriving.Finishing`
        that holds them once waited on); `megatron_patches.deferred_reduce`."""
        return deferred_reduce.embedding_forward(
            lambda: self.pre(input_ids, position_ids))

    def post(self, hidden_states, input_ids, position_ids, labels, pre: PreOutput):
        """Final norm, output layer and per-token loss (labels given) or logits."""
        final_norm = self.final_norm
        if final_norm is not None:
            hidden_states = final_norm(hidden_states)
            hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True,
                                                 keep_graph=True)
        output = self.model._postprocess(
            hidden_states=hidden_states, input_ids=input_ids, position_ids=position_ids,
            labels=labels, rotary_pos_emb=pre.rotary_pos_emb, rotary_pos_cos=None,
            rotary_pos_sin=None, mtp_in_postprocess=False, loss_mask=None,
            decoder_input=pre.decoder_input, attention_mask=None,
        )
        return output if self._float16 is None else float16_to_fp32(output)
