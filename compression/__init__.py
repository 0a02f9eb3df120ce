"""Tensor codecs for pseudo-gradients and weight deltas: quantizers, sparsifiers, error feedback.

Pure code: tensors in, tensors out, on whatever device the tensor lives on; only
:meth:`Encoded.to_bytes` moves (compressed) bytes to the host.

Specs (see :func:`describe_codecs` for the generated list)::

    none                      lossless: raw values in the tensor's own dtype
    fp32 | bf16 | fp16        cast to that float type (round to nearest, saturating)
    int8 | int4 | int2 | int1 block-wise quantization, options block=N (default 256, multiple of 8)
                              and the flag stochastic (unbiased rounding); see quantize.py
    topk:F[,chunk=N]          per-chunk top-k by magnitude, indices bit-packed; see sparsify.py
    tiletopk:F[,tile=T][,divisors]
                              top-k per TxT tile of each tensor; divisors: SparseLoCo's own chunking
                              (each dimension by its largest divisor <= T); see tiles.py
    int2mean[:sigmas=S]       SparseLoCo's 2-bit quantizer: mean-shifted, sigma-scaled bins decoded
                              to each bin's mean (4 float32 means per tensor); see bin_means.py
    randk:F[,unbiased][,shared]
                              random-k from encode()'s seed, indices not sent: per-site coordinates
                              by default, the same coordinates at every site with shared (the
                              round's shared seed; what a private round uses); see sparsify.py

Pipelines put one sparsifier before one value codec: ``"topk:0.01|int4"``, ``"randk:0.05|int8"``;
a bare sparsifier sends its values losslessly (``"topk:0.01"`` is ``"topk:0.01,chunk=4096|none"``).
``Codec.spec`` is the canonical form with every default filled in, and is what the wire carries.
``register_codec`` adds a plug-in's own stage (a ``ValueCodec`` or ``Sparsifier`` subclass) to
``CODECS``, the one registry; ``codec_names()`` lists every accepted name, plug-ins included.

Wire size, exactly (``Encoded.nbytes``): ``21 + len(spec) + 8 * ndim + payload`` where the payload
for ``n`` values of original dtype size ``d`` bytes is

- ``none``: ``n * d``; ``fp32``: ``4n``; ``bf16``/``fp16``: ``2n``
- ``intB:block=b``: ``2 * ceil(n / b) + ceil(n * B / 8)`` (bfloat16 scales, then packed codes)
- ``topk:F,chunk=c|V``: ``roundup8(ceil(k * max(1, ceil(log2 c)) / 8)) + V(k)`` with
  ``k = (n // c) * ceil(F * c) + ceil(F * (n % c))``
- ``randk:F|V``: ``8 + V(ceil(F * n))`` (the seed)
- ``tiletopk:F,tile=T|V``: ``8 + 8 * tensors + roundup8(ceil(k * ceil(log2 T²) / 8)) + V(k)``,
  ``k`` summed over the tiles (tiles.py; the same with ``divisors``, other tiles and counts)
- ``int2mean``: ``16 * runs + ceil(n / 4)``, one run per tensor after ``tiletopk``, else one

``Codec.encoded_nbytes(shape, dtype)`` gives that size without encoding (for simulated links);
``decode(..., out=buffer)`` decodes into a preallocated tensor. Decoding data that is truncated,
corrupted (CRC32 over header and payload), or does not fit its codec raises :class:`CodecError`;
encoding NaN/Inf raises :class:`ValueError`.

Typical use::

    codec = parse_codec("topk:0.01|int4")
    feedback = ErrorFeedback(codec)
    encoded = feedback.encode(pseudo_gradient, seed=site_seed)  # uplink_seed(round_seed, site, spec)
    wire = encoded.to_bytes()                 # len(wire) == encoded.nbytes
    update = decode(wire, device="cuda")      # on the receiver
"""

from geoloco.compression import codec as _codec
from geoloco.compression.codec import (
    CODECS,
    Codec,
    CodecType,
    PipelineCodec,
    add_decoded_into,
    codec_names,
    decode,
    decoded_norm,
    describe_codecs,
    parse_codec,
    register_codec,
)
from geoloco.compression.encoded import CodecError, Encoded
from geoloco.compression.error_feedback import ErrorFeedback
from geoloco.compression.sparsify import random_indices

__all__ = [
    "CODECS",
    "CODEC_NAMES",
    "SPARSIFIER_NAMES",
    "VALUE_CODEC_NAMES",
    "Codec",
    "CodecError",
    "CodecType",
    "Encoded",
    "ErrorFeedback",
    "PipelineCodec",
    "add_decoded_into",
    "codec_names",
    "decode",
    "decoded_norm",
    "describe_codecs",
    "parse_codec",
    "random_indices",
    "register_codec",
]


def __getattr__(name: str) -> tuple[str, ...]:
    """``CODEC_NAMES`` and the other name tuples, current when read (plug-ins included)."""
    if name in ("CODEC_NAMES", "SPARSIFIER_NAMES", "VALUE_CODEC_NAMES"):
        names: tuple[str, ...] = getattr(_codec, name)
        return names
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
