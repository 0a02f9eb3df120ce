"""``RunningSum.add_rows``: a sharded site's update added piece by piece into its rows is the
same sum, bit for bit, as adding the assembled vector; pieces that do not tile the vector once
are refused before anything is added."""

from __future__ import annotations

import pytest
import torch

from geoloco.algorithms.aggregation import RunningSum
from geoloco.algorithms.robust import RobustAggregation, RobustRule
from geoloco.algorithms.round import Round
from geoloco.compression import parse_codec
from geoloco.compression.slicing import element_pieces


def _pieces(update: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    cuts = [0, 3, 10, 11, 40, update.numel()]
    return [(a, update[a:b].clone()) for a, b in zip(cuts, cuts[1:], strict=False)][::-1]  # any order


@pytest.mark.parametrize("spec", ["none", "fp16"])
def test_encoded_pieces_add_the_same_numbers_as_the_decoded_update(spec: str) -> None:
    """A shard's elementwise encoding cut into pieces (views of its payload) and added into its
    rows: what the coordinator does with a sharded site's ``none`` or cast shards."""
    gen = torch.Generator().manual_seed(5)
    update = torch.randn(50, generator=gen)
    encoded = parse_codec(spec).encode(update)
    lengths = [3, 7, 1, 29, 10]
    pieces = element_pieces(encoded, lengths)
    assert pieces is not None and element_pieces(parse_codec("int8").encode(update), lengths) is None
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    whole, rows = RunningSum(50), RunningSum(50)
    whole.add(encoded, 0.3, site="b")
    rows.add_rows(list(zip(offsets, pieces, strict=True))[::-1], 0.3, site="b")
    assert torch.equal(whole.take_result(), rows.take_result())


def test_rows_add_the_same_numbers_as_the_assembled_update() -> None:
    gen = torch.Generator().manual_seed(4)
    other, update = torch.randn(50, generator=gen), torch.randn(50, generator=gen)
    whole, rows = RunningSum(50), RunningSum(50)
    for agg in (whole, rows):
        agg.add(other, 2.0, site="a")
    whole.add(update, 0.7, site="b")
    rows.add_rows(_pieces(update), 0.7, site="b")
    assert torch.equal(whole.take_result(), rows.take_result())
    assert rows.sites == ["a", "b"] and rows.total_weight == pytest.approx(2.7)


@pytest.mark.parametrize(
    "pieces",
    [
        [(0, torch.ones(20)), (25, torch.ones(25))],  # a gap
        [(0, torch.ones(30)), (25, torch.ones(25))],  # an overlap
        [(0, torch.ones(20)), (20, torch.ones(31))],  # past the end
    ],
    ids=["gap", "overlap", "past-the-end"],
)
def test_pieces_that_do_not_tile_are_refused_and_nothing_is_added(pieces: list[tuple[int, torch.Tensor]]) -> None:
    agg = RunningSum(50)
    agg.add(torch.ones(50), 1.0, site="a")
    with pytest.raises(ValueError, match="site 'b'"):
        agg.add_rows(pieces, 1.0, site="b")
    assert agg.sites == ["a"] and torch.equal(agg.take_result(), torch.ones(50))


def test_aggregations_that_keep_whole_updates_get_them_assembled() -> None:
    update = torch.arange(50, dtype=torch.float32)
    robust = RobustAggregation(50, RobustRule(aggregation="median"))
    core = Round(number=0, aggregation=robust, opened_s=0.0)
    core.add_rows(_pieces(update), 1.0, numel=50, site="b", now=0.0)
    assert core.contributed == {"b": 1.0}
    assert torch.equal(robust.take_result(), update)
