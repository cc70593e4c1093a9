"""`megatron_patches.tied_embedding` in one process: a bf16 weight used by an embedding and an
output layer, its gradients accumulated into an fp32 main_grad by Megatron DDP's
post-accumulate hook (`param.main_grad.add_(param.grad)`, then `param.grad = None`). The
schedules' two backward passes (loss tail, then embedding) must give exactly what one
stock backward (PP = 1) or two stock stages summed after the step (PP > 1) give."""

import contextlib

import pytest
import torch

from megatron_patches.tied_embedding import TiedEmbeddingGradient, TiedSum

VOCAB, HIDDEN, TOKENS = 64, 16, 24


def _weight():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN).bfloat16())
    weight.main_grad = torch.zeros(VOCAB, HIDDEN)

    def ddp_hook(param):  # megatron DDP's backward post-hook, without bucketing
        param.main_grad.add_(param.grad.data)
        param.grad = None

    weight.register_post_accumulate_grad_hook(ddp_hook)
    return weight


def _micro_batches(count=3):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (TOKENS,), generator=gen),
             torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16()) for _ in range(count)]


def _embed(weight, tokens):
    return torch.nn.functional.embedding(tokens, weight)


def _loss(weight, hidden):
    return (hidden @ weight.t()).float().square().mean()


def _two_passes(embedding_weight, output_weight, tokens, mix, tied=None):
    """The schedules' order: the loss tail from a detached leaf, then the embedding."""
    emb = _embed(embedding_weight, tokens)
    leaf = (emb.detach() * mix).requires_grad_(True)
    with tied.loss_tail() if tied else contextlib.nullcontext():
        _loss(output_weight, leaf).backward()
    with tied.embedding() if tied else contextlib.nullcontext():
        emb.backward(leaf.grad * mix)


def test_pp1_two_passes_equal_one_stock_backward():
    stock, dhelix, apart = _weight(), _weight(), _weight()
    tied = TiedEmbeddingGradient(dhelix, TiedSum.JOIN_PER_MICROBATCH)
    for tokens, mix in _micro_batches():
        # stock: one graph through the embedding and the output layer
        (_loss(stock, _embed(stock, tokens) * mix)).backward()
        _two_passes(dhelix, dhelix, tokens, mix, tied)
        _two_passes(apart, apart, tokens, mix)  # without the keeper
    assert torch.equal(stock.main_grad, dhelix.main_grad)
    # the two halves reaching main_grad apart differ from stock in bf16
    assert not torch.equal(stock.main_grad, apart.main_grad)


def test_pipelined_sides_summed_apart_then_added():
    first, last, folded = _weight(), _weight(), _weight()
    tied = TiedEmbeddingGradient(folded, TiedSum.APART_PER_STEP)
    for tokens, mix in _micro_batches():
        # stock PP > 1: the embedding on the first stage, a copy of the weight on the last
        _two_passes(first, last, tokens, mix)
        _two_passes(folded, folded, tokens, mix, tied)  # folded stage 0: one weight
    tied.finish_step()
    assert torch.equal(first.main_grad + last.main_grad, folded.main_grad)


def test_held_gradient_that_never_joins_is_an_error():
    weight = _weight()
    tied = TiedEmbeddingGradient(weight, TiedSum.JOIN_PER_MICROBATCH)
    tokens, mix = _micro_batches(1)[0]
    with tied.loss_tail():
        _loss(weight, _embed(weight, tokens).detach() * mix).backward()
    with pytest.raises(RuntimeError, match="did not reach the shared weight"):
        with tied.embedding():
            pass
