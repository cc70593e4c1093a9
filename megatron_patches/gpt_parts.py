"""GPTModel split at the decoder layers, so a schedule can run the layers itself.

`pre` and `post` call megatron-core's own `GPTModel._preprocess` / `_postprocess` (private
in 0.16.1, hence here): embedding (with the sequence-parallel scatter), the RoPE table, the
final norm, the output layer (with the SP gather) and the per-token loss are Megatron's
code, unchanged. Only the plain training path is supported: no multi-token prediction, no
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
    with its autograd graph (the caller back-propagates into it); `rotary_pos_emb` is None
    without RoPE."""

    decoder_input: torch.Tensor
    rotary_pos_emb: object


class GPTParts:
    """Embedding / decoder layers / final norm + output + loss of one GPTModel chunk."""

    def __init__(self, model):
        self.model = unwrap_gpt(model)
        m = self.model
        if getattr(m, "mtp_process", False):
            raise UnsupportedModelError("multi-token prediction is not supported with --dhelix")
        if not (m.pre_process and m.post_process):
            raise UnsupportedModelError("the PP=1 DHelix schedule needs the whole model on "
                                        "one stage (pre_process and post_process)")

    @property
    def layers(self) -> list:
        return list(self.model.decoder.layers)

    def pre(self, input_ids, position_ids) -> PreOutput:
        out = self.model._preprocess(input_ids=input_ids, position_ids=position_ids)
        return PreOutput(decoder_input=out[0], rotary_pos_emb=out[1])

    def post(self, hidden_states, input_ids, position_ids, labels, pre: PreOutput):
        """Final norm, output layer and per-token loss (labels given) or logits."""
        final_norm = self.model.decoder.final_layernorm
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
