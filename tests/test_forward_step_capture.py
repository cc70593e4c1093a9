"""`dhelix.runtime.forward_step_capture`: what a Megatron forward step hands the model is
captured without running it, and the attention mask is checked to be the causal one with
one read per pass (`CausalMaskCheck`). Pure, single process."""

import pytest
import torch

from dhelix.runtime.forward_step_capture import (CausalMaskCheck, ForwardStepError,
                                                 capture_forward_step)


def _causal(seq: int, batch: int = 2) -> torch.Tensor:
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
    return mask.expand(batch, 1, seq, seq)


def _forward_step(mask):
    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        return model(tokens, None, mask, labels=tokens), "loss function"
    return forward_step


def test_captures_inputs_and_accepts_the_causal_mask():
    check = CausalMaskCheck()
    tokens = torch.arange(8).view(2, 4)
    for mask in (_causal(4), None, _causal(4)):
        step = capture_forward_step(_forward_step(mask), iter([tokens]), object(), check)
        assert step.input_ids is tokens and step.labels is tokens
        assert step.loss_func == "loss function"
    check.verify()


def test_other_mask_values_are_refused_when_the_pass_is_verified():
    check = CausalMaskCheck()
    tokens = torch.arange(8).view(2, 4)
    document_mask = _causal(4).clone()
    document_mask[1, 0, 3, 0] = True  # a second document starts at position 3 of sample 1
    for mask in (_causal(4), document_mask, _causal(4)):
        capture_forward_step(_forward_step(mask), iter([tokens]), object(), check)
    with pytest.raises(ForwardStepError, match=r"only the causal attention mask .*\(2, 1, 4, 4\)"):
        check.verify()
    check.verify()  # the refused pass is forgotten: a later pass starts clean


def test_other_mask_shapes_are_refused_at_once():
    check = CausalMaskCheck()
    tokens = torch.arange(8).view(2, 4)
    with pytest.raises(ForwardStepError, match=r"shape \(2, 4, 4\)"):
        capture_forward_step(_forward_step(_causal(4)[:, 0]), iter([tokens]), object(), check)


def test_forward_step_must_call_the_model_once():
    def twice(data_iterator, model):
        tokens = next(data_iterator)
        model(tokens, None, None, labels=tokens)
        return model(tokens, None, None, labels=tokens), None

    with pytest.raises(ForwardStepError, match="call the model once"):
        capture_forward_step(twice, iter([torch.zeros(1, 4, dtype=torch.long)]), object(),
                             CausalMaskCheck())
