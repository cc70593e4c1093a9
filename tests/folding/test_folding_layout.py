"""The folded layer assignment (pure Python): chunks, route, mirror pairing, bad sizes."""

import pytest

from dhelix.folding import FoldedLayout, FoldingError


def test_paper_example_32_layers_4_stages():
    """Paper Figure 7: 32 layers on 4 GPUs, G0 holds L0-L3 and L28-L31."""
    layout = FoldedLayout(32, 4)
    assert layout.layers_per_chunk == 4
    assert list(layout.chunk_layers(0, 0)) == [0, 1, 2, 3]
    assert list(layout.chunk_layers(0, 1)) == [28, 29, 30, 31]
    assert list(layout.chunk_layers(3, 0)) == [12, 13, 14, 15]
    assert list(layout.chunk_layers(3, 1)) == [16, 17, 18, 19]


@pytest.mark.parametrize("layers,stages", [(2, 1), (8, 2), (8, 4), (24, 3), (48, 6)])
def test_every_layer_once_and_route_visits_layers_in_order(layers, stages):
    layout = FoldedLayout(layers, stages)
    held = sorted(g for s in range(stages) for g in layout.stage_layers(s))
    assert held == list(range(layers))
    in_route_order = [g for s, c in layout.forward_route() for g in layout.chunk_layers(s, c)]
    assert in_route_order == list(range(layers))
    assert layout.backward_route() == list(reversed(layout.forward_route()))
    for g in range(layers):
        stage, chunk = layout.locate(g)
        assert g in layout.chunk_layers(stage, chunk)
        # Forward layer g pairs with backward layer L-1-g, on the same stage.
        assert layout.locate(layout.paired_layer(g))[0] == stage


def test_turn_is_on_the_last_stage():
    route = FoldedLayout(12, 3).forward_route()
    assert route[2] == (2, 0) and route[3] == (2, 1)
    assert route[0] == (0, 0) and route[-1] == (0, 1)


@pytest.mark.parametrize("layers,stages", [(4, 4), (6, 2), (7, 1), (0, 1)])
def test_bad_sizes_name_both_arguments(layers, stages):
    with pytest.raises(FoldingError) as info:
        FoldedLayout(layers, stages)
    message = str(info.value)
    assert "--num-layers" in message and "--pipeline-model-parallel-size" in message
    assert str(2 * stages) in message


def test_bad_stage_and_chunk():
    layout = FoldedLayout(8, 2)
    with pytest.raises(FoldingError):
        layout.chunk_layers(2, 0)
    with pytest.raises(FoldingError):
        layout.chunk_layers(0, 2)
    with pytest.raises(FoldingError):
        FoldedLayout(8, 0)


@pytest.mark.parametrize("layers,stages", [(8, 2), (8, 4), (24, 3), (48, 6)])
def test_each_chunk_is_one_half_of_one_stock_stage(layers, stages):
    """Stock Megatron gives stage t layers [t*L/p, (t+1)*L/p); every folded chunk is one
    contiguous half of one of those (what the folded model's stock-seed replay relies on)."""
    layout = FoldedLayout(layers, stages)
    per_stage = layers // stages
    assert layout.stock_position(0) == (0, 0)
    assert layout.stock_position(layers - 1) == (stages - 1, per_stage - 1)
    for stage in range(stages):
        for chunk in (0, 1):
            chunk_layers = list(layout.chunk_layers(stage, chunk))
            owners = {layout.stock_position(g)[0] for g in chunk_layers}
            assert len(owners) == 1
            positions = [layout.stock_position(g)[1] for g in chunk_layers]
            assert positions[0] in (0, per_stage // 2)
            assert positions == list(range(positions[0], positions[0] + len(chunk_layers)))
    with pytest.raises(FoldingError):
        layout.stock_position(layers)
