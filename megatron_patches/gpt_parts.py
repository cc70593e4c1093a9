"""GPTModel split at the decoder layers, so a schedule can run the layers itself.

`pre` and `post` call megatron-core's own `GPTModel._preprocess` / `_postprocess` (private
in megatron-core 0.19.2, hence here): embedding (with the sequence-parallel scatter), the
RoPE table, the final norm, the output layer (with the SP gather) and the per-token loss are
Megatron's code, unchanged. Works on a stock GPTModel (one layer chunk) and on a folded stage
(`megatron_patches.folded_model.FoldedGPTModel`: two chunks, embedding and loss on stage 0). Only the plain training path is supported: no multi-token prediction, no
packed sequences, no inference context, no virtual pipeline; anything else is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.utils import make_viewless_tensor


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
    this rank."""

    def __init__(self, model, whole_model: bool = True):
        self.model = unwrap_gpt(model)
        m = self.model
        if getattr(m, "mtp_process", False):
            raise UnsupportedModelError("multi-token prediction is not supported with --dhelix")
        if whole_model and not (m.pre_process and m.post_process):
            raise UnsupportedModelError("the PP=1 DHelix schedule needs the whole model on "
                                        "one stage (pre_process and post_process)")

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

    def pre(self, input_ids, position_ids, decoder_input=None) -> PreOutput:
        """Embedding (when `decoder_input` is None) and the RoPE table of one micro-batch."""
        out = self.model._preprocess(input_ids=input_ids, position_ids=position_ids,
                                     decoder_input=decoder_input)
        return PreOutput(decoder_input=out[0], rotary_pos_emb=out[1])

    def post(self, hidden_states, input_ids, position_ids, labels, pre: PreOutput):
        """Final norm, output layer and per-token loss (labels given) or logits."""
        final_norm = self.final_norm
        if final_norm is not None:
            hidden_states = final_norm(hidden_states)
            hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True,
                                                 keep_graph=True)
        return self.model._postprocess(
            hidden_states=hidden_states, input_ids=input_ids, position_ids=position_ids,
            labels=labels, rotary_pos_emb=pre.rotary_pos_emb, rotary_pos_cos=None,
            rotary_pos_sin=None, mtp_in_postprocess=False, loss_mask=None,
            decoder_input=pre.decoder_input, attention_mask=None,
        )
