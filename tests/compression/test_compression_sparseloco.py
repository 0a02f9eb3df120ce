"""SparseLoCo as its authors run it: ``tiletopk:F,tile=T,divisors`` (each dimension chunked by its
largest divisor <= T, a fixed count kept per chunk) and ``int2mean`` (2-bit codes over mean-shifted,
σ-scaled bins decoded to per-tensor bin means), against reference computations written here the
way the authors' code computes them."""

from __future__ import annotations

import math

import pytest
import torch

from geoloco.compression import CodecError, Encoded, ErrorFeedback, decode, describe_codecs, parse_codec
from geoloco.compression.tiles import largest_divisor

FAITHFUL = "tiletopk:0.015625,tile=64,divisors|int2mean"


def _authors_split(n: int, close_to: int = 64) -> int:
    """The authors' ``_get_smaller_split``: walk the sorted divisors of ``n``."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    for index, value in enumerate(divisors):
        if value == close_to:
            return value
        if value > close_to:
            return value if index == 0 else divisors[index - 1]
    return n


def _authors_k(k: int, size: int) -> int:
    """The authors' ``_clamp_topk`` (capped at the chunk, where theirs would fail on a chunk of 1)."""
    k = max(min(k, size), 2)
    return min(size, k - k % 2)


def _reference_mask(shape: tuple[int, ...], x: torch.Tensor, k: int) -> torch.Tensor:
    """Which values the authors keep: chunk, top-k |x| per chunk, scatter back."""
    rows, cols = (1, x.numel()) if len(shape) < 2 else (shape[0], x.numel() // shape[0])
    h, w = _authors_split(rows), _authors_split(cols)
    chunks = x.view(rows // h, h, cols // w, w).permute(0, 2, 1, 3).reshape(-1, h * w)
    keep = _authors_k(k, h * w)
    index = torch.topk(chunks.abs(), keep, dim=1).indices
    mask = torch.zeros_like(chunks, dtype=torch.bool).scatter_(1, index, True)
    return mask.view(rows // h, cols // w, h, w).permute(0, 2, 1, 3).reshape(-1)


@pytest.mark.parametrize(
    ("n", "expected"),
    [(768, 64), (3072, 64), (100, 50), (7, 7), (64, 64), (67, 1), (97, 1), (1, 1), (50257, 29), (4096, 64)],
)
def test_largest_divisor_is_the_authors_split(n: int, expected: int) -> None:
    assert largest_divisor(n, 64) == expected == _authors_split(n)


@pytest.mark.parametrize(
    ("shape", "chunks", "kept_per_chunk"),
    [
        ((768, 3072), 12 * 48, 64),  # 64x64 chunks, 64 of 4096 kept
        ((100,), 2, 50),  # 1-D: two chunks of 50 (largest divisor <= 64), min(64, 50) kept
        ((7,), 1, 6),  # one chunk of 7: 7 rounded down to even
        ((67,), 67, 1),  # prime above 64: chunks of one value, each sent
        ((97, 89), 97 * 89, 1),  # both sides prime: one value per chunk
        ((96, 3, 5), 2 * 1, 64),  # read as 96 x 15: chunks 48 x 15 of 720 values
    ],
)
def test_chunk_shapes_and_counts_match_the_authors(
    shape: tuple[int, ...], chunks: int, kept_per_chunk: int
) -> None:
    numel = math.prod(shape)
    codec = parse_codec("tiletopk:0.015625,tile=64,divisors").with_shapes([shape])  # lossless values
    assert codec.sparsifier is not None
    assert codec.sparsifier.num_selected(numel) == chunks * kept_per_chunk
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    decoded = decode(codec.encode(x)).view(-1)
    mask = _reference_mask(shape, x, 64)
    assert torch.equal(decoded, torch.where(mask, x, torch.zeros_like(x)))


def test_every_chunk_keeps_at_least_two_and_an_even_count() -> None:
    shape = (128, 192)  # 64x64 chunks
    x = torch.randn(math.prod(shape), generator=torch.Generator().manual_seed(3))
    for fraction, per_chunk in ((1e-6, 2), (65 / 4096, 64), (0.5, 2048), (1.0, 4096)):
        codec = parse_codec(f"tiletopk:{fraction!r},tile=64,divisors").with_shapes([shape])
        dense = decode(codec.encode(x)).view(128, 192)
        counts = {int(dense[r : r + 64, c : c + 64].count_nonzero()) for r in (0, 64) for c in (0, 64, 128)}
        assert counts == {per_chunk}, fraction


def test_the_fixed_tiles_are_unchanged_without_the_flag() -> None:
    """``tiletopk:0.03,tile=64`` still keeps 3 % of each 64x64 tile and of 4096-value runs."""
    codec = parse_codec("tiletopk:0.03,tile=64|int2").with_shapes([(768, 3072), (100,)])
    assert codec.sparsifier is not None
    assert codec.sparsifier.num_selected(768 * 3072 + 100) == 576 * 123 + 3


def _accumulated_residual(shape: tuple[int, int], rounds: int = 5) -> torch.Tensor:
    """What a site's error feedback holds after some rounds of heavy-tailed updates under the
    faithful top-k (the values the quantizer then sees are this residual's largest)."""
    generator = torch.Generator().manual_seed(1)
    numel = math.prod(shape)
    feedback = ErrorFeedback(parse_codec("tiletopk:0.015625,tile=64,divisors").with_shapes([shape]), decay=0.95)
    for _ in range(rounds):
        update = torch.randn(numel, generator=generator) * (1 + 3 * torch.rand(numel, generator=generator))
        feedback.encode(update)
    assert feedback.residual is not None
    return feedback.residual + torch.randn(numel, generator=generator)


def test_int2mean_errs_far_less_than_int2_on_an_accumulated_residual() -> None:
    """Same residual, same kept coordinates: relative L2 error of the kept values measured at
    0.059 for ``int2mean`` and 0.237 for the absmax ``int2`` (its grid ``{±A/3, ±A}`` per 256
    values), at the same bytes within 0.5 %."""
    shape = (768, 3072)
    residual = _accumulated_residual(shape)
    kept = decode(parse_codec("tiletopk:0.015625,tile=64,divisors").with_shapes([shape]).encode(residual)).view(-1)
    mask = kept != 0
    errors, sizes = {}, {}
    for values in ("int2", "int2mean"):
        codec = parse_codec(f"tiletopk:0.015625,tile=64,divisors|{values}").with_shapes([shape])
        encoded = codec.encode(residual)
        decoded = decode(encoded).view(-1)
        assert torch.equal(decoded != 0, mask)
        errors[values] = float((decoded[mask] - kept[mask]).norm() / kept[mask].norm())
        sizes[values] = encoded.nbytes
    assert errors["int2mean"] == pytest.approx(0.059, abs=0.01)
    assert errors["int2"] == pytest.approx(0.237, abs=0.02)
    assert abs(sizes["int2mean"] - sizes["int2"]) < 0.005 * sizes["int2"]


def _reference_bin_means(x: torch.Tensor, sigmas: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and bin means as the authors compute them (``_quantize_values``, 4 bins), in float64."""
    x64 = x.to(torch.float64)
    centred = x64 - x64.mean()
    std = centred.norm() / math.sqrt(x.numel() - 1)
    scale = sigmas * std / 4
    codes = (centred / scale + 2).round().clamp(0, 3).long()
    means = torch.zeros(4, dtype=torch.float64)
    for j in range(4):
        if (codes == j).any():
            means[j] = x64[codes == j].mean()
    return codes, means


@pytest.mark.parametrize("sigmas", [6, 3])
def test_int2mean_decodes_every_value_to_its_bins_mean(sigmas: int) -> None:
    x = torch.randn(1001, generator=torch.Generator().manual_seed(5)) * 3 + 0.7
    codes, means = _reference_bin_means(x, sigmas)
    assert len(set(codes.tolist())) == 4  # every bin in use
    decoded = decode(parse_codec(f"int2mean:sigmas={sigmas}").encode(x))
    assert torch.equal(decoded, means.to(torch.float32)[codes])
    # Each bin's sum survives (up to the float32 rounding of its mean).
    for j in range(4):
        assert float(decoded[codes == j].sum()) == pytest.approx(float(x[codes == j].sum()), rel=1e-5)


def test_int2mean_has_a_table_per_tensor() -> None:
    """Two tensors of very different scales: each gets its own four means, so the small one is
    not rounded to the large one's bins."""
    shapes = [(64, 64), (64,)]
    generator = torch.Generator().manual_seed(2)
    x = torch.cat([torch.randn(4096, generator=generator) * 100, torch.randn(64, generator=generator) * 1e-3])
    codec = parse_codec("tiletopk:1.0,tile=64,divisors|int2mean").with_shapes(shapes)
    decoded = decode(codec.encode(x))
    for part, reference in ((decoded[:4096], x[:4096]), (decoded[4096:], x[4096:])):
        codes, means = _reference_bin_means(reference)
        assert torch.equal(part, means.to(torch.float32)[codes])


@pytest.mark.parametrize("values", [[2.5] * 9, [-1.0], [0.0, 0.0], [3.0, -3.0, 3.0, -3.0]])
def test_int2mean_degenerate_runs_decode_exactly(values: list[float]) -> None:
    """Constant runs and single values (σ = 0 or undefined: bin width 1) come back exactly."""
    x = torch.tensor(values)
    assert torch.equal(decode(parse_codec("int2mean").encode(x)), x)


def test_spec_round_trip_sizes_and_help() -> None:
    codec = parse_codec(" tiletopk:0.015625 , tile=64, divisors | int2mean ")
    assert codec.spec == "tiletopk:0.015625,tile=64,divisors|int2mean:sigmas=6"
    assert parse_codec(codec.spec) == codec
    assert parse_codec("int2mean:sigmas=3").spec == "int2mean:sigmas=3"
    assert "int2mean" in describe_codecs() and "divisors" in describe_codecs()
    shapes = [(768, 3072), (100,), (7,)]
    bound = codec.with_shapes(shapes)
    numel = sum(math.prod(s) for s in shapes)
    encoded = bound.encode(torch.randn(numel, generator=torch.Generator().manual_seed(0)))
    kept = 576 * 64 + 100 + 6
    index = 8 + 8 * 3 + (kept * 12 + 7) // 8 // 8 * 8 + (8 if (kept * 12 + 7) // 8 % 8 else 0)
    payload = index + 16 * 3 + (kept * 2 + 7) // 8  # three tables of 4 float32 means, 2-bit codes
    assert encoded.payload.numel() == payload
    assert encoded.nbytes == len(encoded.to_bytes()) == bound.encoded_nbytes((numel,))
    with pytest.raises(ValueError, match="sigmas=0 for codec 'int2mean'.*out of range"):
        parse_codec("int2mean:sigmas=0")
    with pytest.raises(ValueError, match="flag 'divisors'.*takes no value"):
        parse_codec("tiletopk:0.1,divisors=1")


def _faithful_encoding() -> tuple[Encoded, int]:
    shapes = [(128, 64), (10,)]
    numel = 128 * 64 + 10
    codec = parse_codec(FAITHFUL).with_shapes(shapes)
    return codec.encode(torch.randn(numel, generator=torch.Generator().manual_seed(4))), numel


def test_malformed_payloads_are_refused_with_a_codec_error() -> None:
    encoded, numel = _faithful_encoding()
    payload = encoded.payload
    truncated = Encoded(encoded.spec, encoded.shape, encoded.dtype, payload[:-1].clone())
    padded = Encoded(encoded.spec, encoded.shape, encoded.dtype, torch.cat([payload, payload[:4]]))
    wrong_numel = Encoded(encoded.spec, (numel - 10,), encoded.dtype, payload.clone())
    poisoned = payload.clone()
    tables = poisoned.numel() - (encoded_kept(encoded) * 2 + 7) // 8 - 16 * 2
    poisoned[tables : tables + 4] = torch.tensor([float("nan")], dtype=torch.float32).view(torch.uint8)
    nan_table = Encoded(encoded.spec, encoded.shape, encoded.dtype, poisoned)
    for bad, message in (
        (truncated, "payload has"),
        (padded, "payload has"),
        (wrong_numel, "corrupted"),
        (nan_table, "non-finite bin means"),
    ):
        with pytest.raises(CodecError, match=message):
            decode(bad)
        out = torch.zeros(bad.numel)
        with pytest.raises(CodecError):
            parse_codec(FAITHFUL).add_decoded_into(bad, out)
        assert out.count_nonzero() == 0  # refused before anything was added
        with pytest.raises(CodecError):
            parse_codec(FAITHFUL).decoded_norm(bad)
    # The wire's CRC catches a flipped byte before any codec sees it.
    wire = bytearray(encoded.to_bytes())
    wire[-3] ^= 0xFF
    with pytest.raises(CodecError):
        decode(bytes(wire))


def encoded_kept(encoded: Encoded) -> int:
    """Values a faithful encoding of ``_faithful_encoding``'s shapes keeps: 2 chunks of 64x64 and
    one chunk of 10 (all kept)."""
    return 2 * 64 + 10


def test_error_feedback_keeps_exactly_what_int2mean_did_not_send() -> None:
    encoded, numel = _faithful_encoding()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(9))
    feedback = ErrorFeedback(parse_codec(FAITHFUL).with_shapes([(128, 64), (10,)]))
    sent = decode(feedback.encode(x)).view(-1)
    assert feedback.residual is not None
    assert torch.allclose(sent + feedback.residual, x, atol=1e-6)
