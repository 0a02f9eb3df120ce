"""Chunking, manifests, checksums and reassembly (no sockets)."""

from __future__ import annotations

import random
import zlib

import grpc
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.wire_assembly import (
    BlobAssembler,
    Download,
    UploadAssembler,
    read_broadcast_stream,
    read_model_stream,
    read_upload_manifest,
    upload_chunks,
)
from geoloco.protos.wire_buffers import (
    DEFAULT_CHUNK_SIZE,
    MAX_CHUNK_SIZE,
    ChecksumMismatchError,
    ChunkIndexError,
    ChunkSizeError,
    IncompleteError,
    ManifestConflictError,
    ManifestError,
    ManifestTooLargeError,
    OversizeChunkError,
    StreamOverrunError,
    as_byte_view,
    checksum_hex,
    compute_checksum,
    ranges_to_indices,
    to_index_ranges,
)
from geoloco.protos.wire_chunks import (
    UPLOAD_REQUEST_CODEC,
    ChunkRef,
    MessageCodec,
    as_messages,
    broadcast_responses,
    decode_chunk_message,
    iter_chunks,
    model_responses,
    upload_requests,
)
from geoloco.protos.wire_manifests import blob_manifest, layout_slices, model_layout


def _chunks(data: bytes, chunk_size: int) -> list[pb.Chunk]:
    return list(iter_chunks(data, chunk_size))


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=700),
    chunk_size=st.integers(1, 64),
    order_seed=st.integers(0, 2**32 - 1),
    duplicates=st.integers(0, 10),
)
def test_any_size_any_order_with_duplicates_reassembles(data, chunk_size, order_seed, duplicates):
    manifest = blob_manifest(data, chunk_size=chunk_size)
    assert manifest.num_chunks == -(-len(data) // chunk_size)
    chunks = _chunks(data, chunk_size)
    assert sum(len(c.data) for c in chunks) == len(data)
    assert all(len(c.data) == chunk_size for c in chunks[:-1])
    rng = random.Random(order_seed)
    stream = chunks + [rng.choice(chunks) for _ in range(duplicates if chunks else 0)]
    rng.shuffle(stream)
    assembler = BlobAssembler(manifest)
    new = sum(assembler.add(c.index, c.data) for c in stream)
    assert new == len(chunks)
    assert assembler.duplicates == len(stream) - len(chunks)
    assert assembler.complete and assembler.missing() == []
    assert bytes(assembler.finish()) == data
    assert assembler.received_bytes == len(data)


@pytest.mark.parametrize("size,chunk_size", [(0, 4), (4096, 1024), (4097, 1024), (1023, 1024)])
def test_edge_sizes(size, chunk_size):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    manifest = blob_manifest(data, chunk_size=chunk_size)
    assembler = BlobAssembler(manifest)
    assembler.consume(_chunks(data, chunk_size))
    assert bytes(assembler.finish()) == data
    last = _chunks(data, chunk_size)[-1:] or []
    if size:
        assert len(last[0].data) == size - (manifest.num_chunks - 1) * chunk_size


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(1, 400),
    chunk_size=st.integers(1, 32),
    drop_seed=st.integers(0, 2**32 - 1),
)
def test_missing_chunks_are_reported_as_ranges(size, chunk_size, drop_seed):
    data = random.Random(drop_seed).randbytes(size)
    manifest = blob_manifest(data, chunk_size=chunk_size)
    chunks = _chunks(data, chunk_size)
    rng = random.Random(drop_seed + 1)
    dropped = {c.index for c in chunks if rng.random() < 0.3} or {chunks[-1].index}
    assembler = BlobAssembler(manifest)
    assembler.consume(c for c in chunks if c.index not in dropped)
    assert not assembler.complete
    assert ranges_to_indices(assembler.missing()) == sorted(dropped)
    assert assembler.first_missing() == min(dropped)
    assert sorted(
        ranges_to_indices(assembler.received()) + ranges_to_indices(assembler.missing())
    ) == list(range(manifest.num_chunks))
    with pytest.raises(IncompleteError) as info:
        assembler.finish()
    assert info.value.missing == assembler.missing()
    # Resume: only the missing chunks, then the blob is whole.
    assembler.consume(iter_chunks(data, chunk_size, indices=sorted(dropped)))
    assert bytes(assembler.finish()) == data


def _ranges_of(indices: set[int]) -> list[tuple[int, int]]:
    """Sorted, merged half-open ranges covering ``indices`` (the test's own, independent of the wire code)."""
    ranges: list[tuple[int, int]] = []
    for i in sorted(indices):
        if ranges and ranges[-1][1] == i:
            ranges[-1] = (ranges[-1][0], i + 1)
        else:
            ranges.append((i, i + 1))
    return ranges


@given(st.sets(st.integers(0, 200), max_size=60))
def test_index_ranges_round_trip(indices):
    ranges = _ranges_of(indices)
    assert ranges_to_indices(ranges) == sorted(indices)
    assert all(a < b for a, b in ranges)
    assert all(ranges[i][1] < ranges[i + 1][0] for i in range(len(ranges) - 1))
    assert ranges_to_indices(to_index_ranges(ranges)) == sorted(indices)


def test_oversize_chunk_is_resource_exhausted():
    data = bytes(2500)
    assembler = BlobAssembler(blob_manifest(data, chunk_size=1000))
    with pytest.raises(OversizeChunkError) as info:
        assembler.add(0, bytes(1001))
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The last slot holds 500 bytes: a full-size last chunk would write past the manifest.
    with pytest.raises(OversizeChunkError):
        assembler.add(2, bytes(1000))
    with pytest.raises(ChunkSizeError) as short:
        assembler.add(1, bytes(999))
    assert short.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert assembler.received_count == 0


def test_index_past_manifest_is_rejected():
    assembler = BlobAssembler(blob_manifest(bytes(2000), chunk_size=1000))
    with pytest.raises(ChunkIndexError) as info:
        assembler.add(2, bytes(1000))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.reason == pb.ERROR_REASON_CHUNK_OUT_OF_BOUNDS
    empty = BlobAssembler(blob_manifest(b"", chunk_size=8))
    with pytest.raises(ChunkIndexError):
        empty.add(0, b"")
    assert bytes(empty.finish()) == b""


def test_stream_past_manifest_size_is_resource_exhausted():
    data = bytes(range(250)) * 8
    manifest = blob_manifest(data, chunk_size=500)
    chunks = _chunks(data, 500)
    assembler = BlobAssembler(manifest)
    with pytest.raises(StreamOverrunError) as info:
        assembler.consume(chunks + chunks[:1])  # a sender repeating itself within one stream
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Duplicates across streams (a resumed upload) stay idempotent.
    assert assembler.consume(chunks) == 0
    assert bytes(assembler.finish()) == data


def test_checksum_mismatch_is_data_loss_and_requires_everything_again():
    data = bytes(range(256)) * 10
    manifest = blob_manifest(data, chunk_size=1000)
    chunks = _chunks(data, 1000)
    corrupted = pb.Chunk(index=1, data=bytes(1000))
    assembler = BlobAssembler(manifest)
    assembler.consume([chunks[0], corrupted, chunks[2]])
    assert assembler.complete
    with pytest.raises(ChecksumMismatchError) as info:
        assembler.finish()
    assert info.value.code == grpc.StatusCode.DATA_LOSS
    assert info.value.reason == pb.ERROR_REASON_CHECKSUM_MISMATCH
    assert assembler.missing() == [(0, 3)]
    assembler.consume(chunks)
    assert bytes(assembler.finish()) == data


@pytest.mark.parametrize("algorithm", [pb.CHECKSUM_ALGORITHM_CRC32, pb.CHECKSUM_ALGORITHM_SHA256])
def test_checksums(algorithm):
    data = b"geoloco" * 1000
    checksum = compute_checksum(data, algorithm)
    if algorithm == pb.CHECKSUM_ALGORITHM_CRC32:
        assert checksum.digest == zlib.crc32(data).to_bytes(4, "big")
    else:
        assert len(checksum.digest) == 32
    assert compute_checksum(memoryview(data), algorithm) == checksum
    assert compute_checksum(data[:-1] + b"x", algorithm).digest != checksum.digest
    assert checksum_hex(checksum).startswith(("crc32:", "sha256:"))


@pytest.mark.parametrize(
    "mutate,error",
    [
        (lambda m: setattr(m, "chunk_size", 0), ManifestError),
        (lambda m: setattr(m, "num_chunks", m.num_chunks + 1), ManifestError),
        (lambda m: setattr(m, "chunk_size", MAX_CHUNK_SIZE + 1), ManifestTooLargeError),
        (lambda m: setattr(m, "total_bytes", 1 << 40), ManifestTooLargeError),
        (lambda m: m.checksum.__setattr__("algorithm", 0), ManifestError),
        (lambda m: m.checksum.__setattr__("digest", b"\x00"), ManifestError),
    ],
)
def test_bad_manifests(mutate, error):
    manifest = blob_manifest(bytes(3000), chunk_size=1000)
    mutate(manifest)
    with pytest.raises(error) as info:
        BlobAssembler(manifest, max_total_bytes=1 << 30)
    expected = (
        grpc.StatusCode.RESOURCE_EXHAUSTED
        if error is ManifestTooLargeError
        else grpc.StatusCode.INVALID_ARGUMENT
    )
    assert info.value.code == expected


def test_byte_views_of_tensors_and_arrays_do_not_copy():
    weights = torch.arange(10, dtype=torch.float32)
    view = as_byte_view(weights)
    assert len(view) == 40 and bytes(view) == weights.numpy().tobytes()
    bf16 = torch.ones(3, dtype=torch.bfloat16)
    assert len(as_byte_view(bf16)) == 6
    array = np.arange(6, dtype=np.float16).reshape(2, 3)
    assert bytes(as_byte_view(array)) == array.tobytes()
    with pytest.raises(ValueError, match="contiguous"):
        as_byte_view(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="read-only"):
        as_byte_view(b"abc", writable=True)
    with pytest.raises(TypeError, match="CPU torch tensor"):
        as_byte_view(3.0)


def test_assembling_straight_into_a_weight_tensor():
    source = torch.randn(1000)
    target = torch.zeros(1000)
    manifest = blob_manifest(source, dtype=source.dtype, shape=source.shape, chunk_size=512)
    assert manifest.dtype == "float32" and list(manifest.shape) == [1000]
    assembler = BlobAssembler(manifest, out=target)
    assembler.consume(reversed(list(iter_chunks(source, 512))))
    assembler.finish()
    assert torch.equal(source, target)
    with pytest.raises(ValueError, match="needs 4000"):
        BlobAssembler(manifest, out=torch.zeros(10))


def _upload_manifest(data: bytes, **kwargs) -> pb.UploadManifest:
    return pb.UploadManifest(
        site="eu",
        session_id="s",
        round=7,
        sample_weight=128.0,
        blob=blob_manifest(data, codec="int8", chunk_size=100),
        **kwargs,
    )


def test_upload_stream_helpers_and_manifest_conflict():
    data = bytes(range(250))
    manifest = _upload_manifest(data, metrics={"loss": 2.5})
    requests = iter(list(upload_requests(manifest, data)))
    received = read_upload_manifest(requests)
    assembler = UploadAssembler(received)
    assembler.consume(upload_chunks(requests))
    assert bytes(assembler.finish()) == data
    assert assembler.upload_response().complete
    status = assembler.status_response()
    assert status.known and status.complete and status.manifest == manifest
    assert [(r.start, r.end) for r in status.received] == [(0, 3)]
    assembler.check_same_manifest(manifest)
    other = _upload_manifest(data[::-1])
    with pytest.raises(ManifestConflictError) as info:
        assembler.check_same_manifest(other)
    assert info.value.reason == pb.ERROR_REASON_MANIFEST_CONFLICT

    only = list(upload_requests(manifest, data, missing=[pb.IndexRange(start=1, end=2)]))
    assert [r.WhichOneof("kind") for r in only] == ["manifest", "chunk"]
    assert only[1].chunk.index == 1


def test_upload_stream_must_start_with_exactly_one_manifest():
    data = bytes(300)
    manifest = _upload_manifest(data)
    with pytest.raises(ManifestError, match="empty"):
        read_upload_manifest(iter([]))
    chunk_first = iter([pb.UploadRequest(chunk=pb.Chunk(index=0, data=bytes(100)))])
    with pytest.raises(ManifestError, match="first message"):
        read_upload_manifest(chunk_first)
    twice = iter([pb.UploadRequest(manifest=manifest)])
    with pytest.raises(ManifestError, match="after its manifest"):
        list(upload_chunks(twice))
    with pytest.raises(ValueError, match="announces"):
        list(upload_requests(manifest, bytes(10)))


def test_download_resumes_after_a_broken_stream():
    model = random.Random(3).randbytes(10_000)
    manifest = pb.ModelManifest(round=1, blob=blob_manifest(model, chunk_size=1000))
    download = Download()
    stream = model_responses(manifest, model)

    def broken():
        for i, response in enumerate(stream):
            if i == 5:  # manifest + 4 chunks, then the connection drops
                raise ConnectionError("link down")
            yield response

    with pytest.raises(ConnectionError):
        read_model_stream(broken(), download)
    start, digest = download.resume_point()
    assert start == 4 and digest == manifest.blob.checksum
    resumed = pb.ModelManifest()
    resumed.CopyFrom(manifest)
    resumed.start_chunk = start
    got = read_model_stream(model_responses(resumed, model), download)
    assert got.round == 1
    assert bytes(download.result()) == model
    assert download.assembler.duplicates == 0


def test_broadcast_stream_reader():
    delta = bytes(range(200)) * 3
    header = pb.BroadcastHeader(
        action=pb.BROADCAST_ACTION_APPLY_DELTA,
        round=2,
        delta=blob_manifest(delta, codec="int4", chunk_size=128),
    )
    progress = [pb.AwaitBroadcastResponse(progress=pb.RoundProgress(round=2, uploads_complete=1))]
    seen: list[pb.RoundProgress] = []
    download = Download()
    got = read_broadcast_stream(
        progress + list(broadcast_responses(header, delta)), download, on_progress=seen.append
    )
    assert got.round == 2 and len(seen) == 1 and bytes(download.result()) == delta

    resync = pb.BroadcastHeader(action=pb.BROADCAST_ACTION_RESYNC, round=2)
    untouched = Download()
    got = read_broadcast_stream(broadcast_responses(resync, None), untouched)
    assert got.action == pb.BROADCAST_ACTION_RESYNC and untouched.assembler is None
    with pytest.raises(ManifestError, match="without a header"):
        read_broadcast_stream(progress, Download())


def test_model_layout_offsets_and_validation():
    layout = model_layout([("emb", torch.Size([10, 4])), ("bias", (4,)), ("scale", ())])
    assert [t.offset for t in layout.tensors] == [0, 40, 44]
    assert layout.numel == 45 and layout.dtype == "float32"
    slices = layout_slices(layout)
    assert slices["bias"] == (slice(40, 44), (4,))
    layout.tensors[1].offset = 41
    with pytest.raises(ManifestError, match="bias"):
        layout_slices(layout)
    with pytest.raises(ValueError, match="twice"):
        model_layout([("a", (1,)), ("a", (2,))])


def test_default_chunk_size_fits_limits():
    assert 0 < DEFAULT_CHUNK_SIZE <= MAX_CHUNK_SIZE
    with pytest.raises(ValueError, match="chunk_size"):
        blob_manifest(b"x", chunk_size=MAX_CHUNK_SIZE + 1)


_CHUNK_MESSAGES = [pb.UploadRequest, pb.FetchModelResponse, pb.AwaitBroadcastResponse]


@settings(max_examples=80, deadline=None)
@given(
    message_type=st.sampled_from(_CHUNK_MESSAGES),
    index=st.one_of(st.just(0), st.integers(0, 2**32 - 1)),
    data=st.one_of(st.just(b""), st.binary(max_size=300)),
)
def test_fast_chunk_encoding_is_protobufs_encoding(message_type, index, data):
    codec = MessageCodec(message_type)
    reference = message_type(chunk=pb.Chunk(index=index, data=data)).SerializeToString()
    fast = codec.serialize(ChunkRef(index, memoryview(data)))
    assert fast == reference
    decoded = codec.deserialize(reference)
    assert isinstance(decoded, ChunkRef)
    assert decoded.index == index and bytes(decoded.data) == data
    assert decoded.WhichOneof("kind") == "chunk" and decoded.chunk is decoded
    assert message_type.FromString(fast).chunk == decoded.to_proto()


def test_fast_decoder_falls_back_to_protobuf_for_everything_else():
    codec = UPLOAD_REQUEST_CODEC
    manifest = pb.UploadRequest(manifest=pb.UploadManifest(site="x", round=2))
    decoded = codec.deserialize(manifest.SerializeToString())
    assert isinstance(decoded, pb.UploadRequest) and decoded == manifest
    assert codec.serialize(manifest) == manifest.SerializeToString()

    chunk = pb.UploadRequest(chunk=pb.Chunk(index=5, data=b"abc")).SerializeToString()
    # Valid protobuf in other shapes: inner fields reversed (the fast decoder reads it), an
    # unknown field and the chunk repeated (it steps aside for protobuf, whose merge rules apply).
    reversed_fields = b"\x12\x07" + b"\x12\x03abc" + b"\x08\x05"
    unknown_field = chunk + b"\x18\x01"
    repeated = chunk + pb.UploadRequest(chunk=pb.Chunk(index=6, data=b"d")).SerializeToString()
    for buf in (reversed_fields, unknown_field, repeated):
        message = codec.deserialize(buf)
        reference = pb.UploadRequest.FromString(buf)
        assert message.WhichOneof("kind") == "chunk"
        assert message.chunk.index == reference.chunk.index
        assert bytes(message.chunk.data) == reference.chunk.data
    assert decode_chunk_message(reversed_fields, 2).index == 5  # any field order is fine
    assert decode_chunk_message(unknown_field, 2) is None
    assert decode_chunk_message(repeated, 2) is None
    for truncated in (chunk[:-1], chunk[:1], b"", b"\x12\xff"):
        assert decode_chunk_message(truncated, 2) is None


def test_senders_yield_views_and_as_messages_converts():
    data = bytearray(b"0123456789")
    stream = list(iter_chunks(data, 4))
    assert [type(c) for c in stream] == [ChunkRef] * 3
    assert [bytes(c.data) for c in stream] == [b"0123", b"4567", b"89"]
    data[0:1] = b"X"  # views, not copies
    assert bytes(stream[0].data) == b"X123"
    manifest = pb.UploadManifest(blob=blob_manifest(data, chunk_size=4))
    messages = list(as_messages(upload_requests(manifest, data), pb.UploadRequest))
    assert all(isinstance(m, pb.UploadRequest) for m in messages)
    assert [m.chunk.data for m in messages[1:]] == [b"X123", b"4567", b"89"]


def test_running_checksum_handles_out_of_order_arrival():
    data = random.Random(9).randbytes(5000)
    for algorithm in (pb.CHECKSUM_ALGORITHM_CRC32, pb.CHECKSUM_ALGORITHM_SHA256):
        manifest = blob_manifest(data, chunk_size=700, checksum_algorithm=algorithm)
        chunks = list(iter_chunks(data, 700))
        assembler = BlobAssembler(manifest)
        assembler.consume(chunks[3:] + chunks[:3])  # the digest catches up when 0..2 arrive
        assert bytes(assembler.finish()) == data


def test_a_released_blob_answers_for_itself_without_its_bytes():
    """Once a verified upload was added to its round the coordinator drops its bytes; a resumed
    or repeated stream still learns that it is complete, and nothing reads the bytes again."""
    data = random.Random(7).randbytes(5000)
    manifest = blob_manifest(data, chunk_size=1000)
    assembler = BlobAssembler(manifest)
    with pytest.raises(RuntimeError, match="still needed"):
        assembler.release()  # not verified yet: its bytes are the upload
    assembler.consume(_chunks(data, 1000))
    assert bytes(assembler.finish()) == data
    assembler.release()
    assert assembler.complete and assembler.verified and assembler.missing() == []
    assert ranges_to_indices(assembler.received()) == list(range(manifest.num_chunks))
    assert assembler.consume(_chunks(data, 1000)) == 0  # a repeated stream: duplicates, ignored
    with pytest.raises(RuntimeError, match="released"):
        assembler.finish()


def test_a_manifest_with_a_nan_metric_is_the_same_as_its_copy():
    """A manifest holding a NaN metric is the same as its resent copy: protobuf backends that
    compare floats by IEEE ``==`` (NaN unequal to itself) would otherwise refuse a client's
    second stream of its own upload; the serialised bytes decide then."""
    data = bytes(range(250))
    manifest = _upload_manifest(data, metrics={"loss": float("nan"), "steps": 3.0})
    assembler = UploadAssembler(manifest)
    assembler.check_same_manifest(pb.UploadManifest.FromString(manifest.SerializeToString()))
    with pytest.raises(ManifestConflictError, match="these fields differ"):
        assembler.check_same_manifest(_upload_manifest(data, metrics={"loss": float("nan"), "steps": 4.0}))
