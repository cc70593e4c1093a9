"""Runs a Megatron `forward_step_func` against a stand-in model, to learn one micro-batch's
inputs and its loss function without running the model: the DHelix schedules then run the
model themselves (layer by layer, paired with another micro-batch).

`forward_step_func(data_iterator, model)` must call the model once, as Megatron's
pretrain_gpt does, `model(tokens, position_ids, attention_mask, labels=labels
[, loss_mask=loss_mask] [, packed_seq_params=None])`, and return `(output, loss_func)` with the
output unchanged. `loss_mask` is accepted and not used (GPTModel reads it only for
multi-token prediction, which `--dhelix` refuses). The attention mask must be None or the
plain causal mask a Megatron dataloader builds (`[b, 1, s, s]`, True above the diagonal):
the DHelix layers apply the implicit causal mask, so any other mask is refused, never
silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class ForwardStepError(RuntimeError):
    """forward_step_func does not follow the pattern the DHelix schedule supports."""


class _ModelOutputPlaceholder:
    """Returned by the capturing model; the real output is computed by the schedule."""


@dataclass
class CapturedStep:
    """One micro-batch as `forward_step_func` handed it to the model, and its loss function.
    `input_ids`, `position_ids` and `labels` are None where the forward step gives none (a
    pipeline stage that neither embeds nor computes the loss)."""

    input_ids: torch.Tensor | None
    position_ids: torch.Tensor | None
    labels: torch.Tensor | None
    loss_func: object


def _check_causal_mask(mask) -> None:
    if mask is None:
        return
    seq = mask.shape[-1]
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=mask.device), diagonal=1)
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-2] != seq or not bool(
            (mask.bool() == causal).all()):
        raise ForwardStepError(
            "with --dhelix only the causal attention mask is supported (the model got "
            f"another mask of shape {tuple(mask.shape)}, e.g. from --reset-attention-mask); "
            "drop the option that makes it")


class _CapturingModel:
    """Stands in for the model while `forward_step_func` runs: records the call's
    arguments and returns a placeholder; attribute access reaches the real model."""

    def __init__(self, model, require_labels: bool):
        self._model = model
        self._require_labels = require_labels
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, input_ids=None, position_ids=None, attention_mask=None, *args,
                 labels=None, loss_mask=None, packed_seq_params=None, **kwargs):
        if args or kwargs or packed_seq_params is not None:
            extra = list(kwargs) + (["packed_seq_params"] if packed_seq_params is not None
                                    else [])
            raise ForwardStepError(
                "with --dhelix the model must be called as model(tokens, position_ids, "
                f"attention_mask, labels=labels); got extra arguments {extra or args}")
        if labels is None and self._require_labels:
            raise ForwardStepError("with --dhelix forward_step_func must pass labels (training)")
        _check_causal_mask(attention_mask)
        self.calls.append((input_ids, position_ids, labels))
        return _ModelOutputPlaceholder()


def capture_forward_step(forward_step_func, data_iterator, model,
                         require_labels: bool = True) -> CapturedStep:
    """Call `forward_step_func(data_iterator, stand-in for model)` once (so the data
    iterator advances exactly as under Megatron's schedules) and return what it gave the
    model and its loss function. Raises ForwardStepError when the forward step does not
    follow the supported pattern (module docstring)."""
    capture = _CapturingModel(model, require_labels)
    result = forward_step_func(data_iterator, capture)
    if not (isinstance(result, tuple) and len(result) == 2
            and isinstance(result[0], _ModelOutputPlaceholder) and len(capture.calls) == 1):
        raise ForwardStepError(
            "with --dhelix forward_step_func must call the model once and return "
            "(model_output, loss_func) with the output unchanged")
    input_ids, position_ids, labels = capture.calls[0]
    return CapturedStep(input_ids, position_ids, labels, result[1])
