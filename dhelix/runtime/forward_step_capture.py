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
silently ignored: a mask of another shape at once, a mask of the causal shape with other
values by `CausalMaskCheck.verify` once the pass's micro-batches ran (comparing values on
the mask's device per micro-batch and reading them there would stop the host once per
micro-batch and leave a GPU idle while it refills its queue: measured on an H100).
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


class CausalMaskCheck:
    """Checks that every attention mask a forward/backward pass's forward steps gave the
    model is None or the plain causal mask, with one host-device synchronisation per pass
    instead of one per micro-batch. `submit` refuses a mask of another shape at once and
    queues an on-device comparison of its values (no synchronisation; the causal reference
    is built once per sequence length and device and kept); `verify` reads the queued
    comparisons together and raises ForwardStepError if any mask differed, then forgets
    them. The schedule engine calls `verify` at the end of each pass, before Megatron's
    optimizer step, so a wrong mask never reaches the weights."""

    def __init__(self):
        self._causal: dict = {}
        self._pending: list = []
        self._shape: tuple | None = None

    def submit(self, mask) -> None:
        if mask is None:
            return
        seq = mask.shape[-1]
        if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-2] != seq:
            raise _mask_error(mask.shape)
        key = (seq, mask.device)
        if key not in self._causal:
            self._causal[key] = torch.triu(
                torch.ones(seq, seq, dtype=torch.bool, device=mask.device), diagonal=1)
        self._pending.append((mask.bool() == self._causal[key]).all())
        self._shape = tuple(mask.shape)

    def verify(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not bool(torch.stack(pending).all()):
            raise _mask_error(self._shape)


def _mask_error(shape) -> "ForwardStepError":
    return ForwardStepError(
        "with --dhelix only the causal attention mask is supported (the model got "
        f"another mask of shape {tuple(shape)}, e.g. from --reset-attention-mask); "
        "drop the option that makes it")


class _CapturingModel:
    """Stands in for the model while `forward_step_func` runs: records the call's
    arguments and returns a placeholder; attribute access reaches the real model."""

    def __init__(self, model, require_labels: bool, mask_check: CausalMaskCheck):
        self._model = model
        self._require_labels = require_labels
        self._mask_check = mask_check
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
        self._mask_check.submit(attention_mask)
        self.calls.append((input_ids, position_ids, labels))
        return _ModelOutputPlaceholder()


def capture_forward_step(forward_step_func, data_iterator, model, mask_check: CausalMaskCheck,
                         require_labels: bool = True) -> CapturedStep:
    """Call `forward_step_func(data_iterator, stand-in for model)` once (so the data
    iterator advances exactly as under Megatron's schedules) and return what it gave the
    model and its loss function; the attention mask goes to `mask_check` (whose `verify`
    the caller owes before the pass's results are used). Raises ForwardStepError when the
    forward step does not follow the supported pattern (module docstring)."""
    capture = _CapturingModel(model, require_labels, mask_check)
    result = forward_step_func(data_iterator, capture)
    if not (isinstance(result, tuple) and len(result) == 2
            and isinstance(result[0], _ModelOutputPlaceholder) and len(capture.calls) == 1):
        raise ForwardStepError(
            "with --dhelix forward_step_func must call the model once and return "
            "(model_output, loss_func) with the output unchanged")
    input_ids, position_ids, labels = capture.calls[0]
    return CapturedStep(input_ids, position_ids, labels, result[1])
