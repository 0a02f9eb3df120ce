"""A sharded site's rank downloads its rows (``geoloco.coordinator.shard_views``): rows of the
weights with their digest, and rows of a broadcast delta from memory or from a file."""

from __future__ import annotations

import hashlib

import pytest
import torch

from geoloco.algorithms.shard_split import shard_ranges
from geoloco.compression import Encoded, decode, parse_codec
from geoloco.compression.slicing import row_positions
from geoloco.coordinator.domain import BroadcastRecord
from geoloco.coordinator.shard_views import ShardViews
from geoloco.protos.errors import InvalidUpdateError
from geoloco.protos.wire_files import FileBlob

SHAPES = [(5, 3), (7,), (2, 2, 2)]
NUMEL = 15 + 7 + 8


def _record(codec: str, values: torch.Tensor, *, in_file: bool, round_number: int = 4) -> BroadcastRecord:
    data = parse_codec(codec).encode(values).to_bytes()
    return BroadcastRecord(
        round=round_number, data=FileBlob.spill(data) if in_file else data, codec=parse_codec(codec).spec,
        shape=(NUMEL,), chunk_size=64, weights_digest="00", contributors=frozenset({"a"}), run_finished=False,
    )


def _rows(flat: torch.Tensor, index: int, count: int) -> torch.Tensor:
    return torch.cat([flat[o : o + n] for o, n in shard_ranges(SHAPES, index, count)])


@pytest.mark.parametrize("in_file", [False, True])
def test_delta_rows_are_the_rows_of_the_decoded_delta(in_file: bool) -> None:
    values = torch.randn(NUMEL, generator=torch.Generator().manual_seed(2))
    record = _record("fp16", values, in_file=in_file)
    whole = decode(Encoded.from_bytes(parse_codec("fp16").encode(values).to_bytes()))
    views = ShardViews(SHAPES)
    covered = 0
    for index in range(3):
        rows = views.delta_rows(record, (index, 3, "dim0"))
        assert rows is not None
        data = rows.data.read(0, len(rows.data)) if isinstance(rows.data, FileBlob) else rows.data
        assert hashlib.sha256(data).digest() == rows.sha256
        assert torch.equal(decode(Encoded.from_bytes(data)), _rows(whole, index, 3))
        covered += rows.numel
    assert covered == NUMEL
    assert views.delta_rows(record, (1, 3, "dim0")) is views.delta_rows(record, (1, 3, "dim0"))  # made once


def test_a_sparse_delta_has_no_rows_and_the_rank_gets_the_whole() -> None:
    assert ShardViews(SHAPES).delta_rows(_record("topk:0.5", torch.randn(NUMEL), in_file=False), (0, 2, "dim0")) is None


def test_a_quantized_delta_is_served_as_the_blocks_around_the_rows() -> None:
    values = torch.randn(NUMEL, generator=torch.Generator().manual_seed(3))
    whole = decode(parse_codec("int8:block=8").encode(values)).reshape(-1)
    record = _record("int8:block=8", values, in_file=False)
    ranges = shard_ranges(SHAPES, 1, 2)
    rows = ShardViews(SHAPES).delta_rows(record, (1, 2, "dim0"))
    assert rows is not None and isinstance(rows.data, bytes)
    served = decode(Encoded.from_bytes(rows.data)).reshape(-1)
    assert served.numel() == rows.numel
    positions = row_positions(ranges, 8, NUMEL)
    picked = torch.cat([served[p : p + n] for (_, n), p in zip(ranges, positions, strict=True)])
    assert torch.equal(picked, _rows(whole, 1, 2))


def test_weight_rows_and_their_digest() -> None:
    weights = torch.randn(NUMEL)
    views = ShardViews(SHAPES)
    rows = views.weight_rows(weights, (1, 2, "dim0"))
    assert torch.equal(rows, _rows(weights, 1, 2))
    assert views.rows_digest(weights, "w1", (1, 2, "dim0")) == hashlib.sha256(rows.numpy().tobytes()).hexdigest()


@pytest.mark.parametrize(("key", "match"), [
    ((2, 2, "dim0"), r"shard 2 of 2; count must be 1 \.\. 4096 and index 0 \.\. count-1"),
    ((0, 0, "dim0"), "shard 0 of 0"),
    ((0, 2, "cols"), r"split 'cols'; the known splits are \['dim0'\]"),
])
def test_a_shard_that_does_not_exist_is_refused_by_name(key: tuple[int, int, str], match: str) -> None:
    with pytest.raises(InvalidUpdateError, match=match):
        ShardViews(SHAPES).weight_rows(torch.zeros(NUMEL), key)
