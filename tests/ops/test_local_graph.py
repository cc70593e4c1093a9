"""`local_graph.enter`: a tensor entered into a graph is not kept alive by it, and the
gradient that reaches it lands in the sink (plain CPU tensors, single process)."""

from __future__ import annotations

import weakref

import torch

from dhelix.ops.local_graph import enter


def test_entered_tensor_is_freed_after_the_forward_and_gets_its_gradient():
    weight = torch.nn.Parameter(torch.tensor([2.0, 3.0]))
    x = torch.tensor([0.5, -1.0])
    sink: dict = {}
    entered = enter(x, sink, "x")
    assert entered.requires_grad and entered.data_ptr() == x.data_ptr()
    # exp saves its output, not its input: nothing in the graph needs x's storage
    loss = (torch.exp(entered) * weight).sum()
    alive = weakref.ref(x)
    expected_grad = torch.exp(x) * weight.detach()
    del x, entered
    assert alive() is None
    loss.backward()
    torch.testing.assert_close(sink.pop("x"), expected_grad)
    torch.testing.assert_close(weight.grad, torch.exp(torch.tensor([0.5, -1.0])))


def test_what_the_graph_saves_keeps_the_entered_tensor_alive():
    """The check above can fail: mul saves the entered view (for the weight's gradient),
    and the view keeps its base."""
    weight = torch.nn.Parameter(torch.tensor([2.0, 3.0]))
    x = torch.tensor([0.5, -1.0])
    sink: dict = {}
    entered = enter(x, sink, "x")
    loss = (entered * weight).sum()
    alive = weakref.ref(x)
    del x, entered
    assert alive() is not None
    loss.backward()
    torch.testing.assert_close(sink["x"], torch.tensor([2.0, 3.0]))
    assert alive() is None  # the backward freed what the graph saved


def test_no_gradient_reaching_the_entry_leaves_none():
    sink: dict = {}
    entered = enter(torch.ones(2), sink, "x")
    weight = torch.nn.Parameter(torch.ones(2))
    (entered.detach() * weight).sum().backward()
    assert "x" not in sink  # the entry node never ran
    loss = (entered * 0).sum() + weight.sum()
    loss.backward()
    torch.testing.assert_close(sink["x"], torch.zeros(2))
