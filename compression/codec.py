"""Codecs as pipelines parsed from a spec string, the codec registry, and ``decode``.

Spec grammar: ``stage ("|" stage)*``, ``stage = name [":" arg ("," arg)*]``, where an ``arg`` is a
positional fraction (sparsifiers only), ``key=value`` or a flag. A pipeline is at most one
sparsifier followed by exactly one value codec; a bare sparsifier gets ``none`` (lossless values).
``Codec.spec`` is canonical: every option spelled out, so two specs denote the same codec exactly
when their canonical forms are equal, and the canonical form is what each :class:`Encoded` records.
"""

from __future__ import annotations

import functools
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final, Literal

import torch

from geoloco.compression import _memory
from geoloco.compression.bin_means import BinMeanQuantizer
from geoloco.compression.casts import Cast, Lossless
from geoloco.compression.encoded import DTYPE_CODES, CodecError, Encoded
from geoloco.compression.quantize import BLOCK_OPTION, STOCHASTIC_OPTION, BlockQuantizer
from geoloco.compression.sparsify import RandK, TopK
from geoloco.compression.stages import Option, Sparsifier, Stage, ValueCodec, check_payload_nbytes
from geoloco.compression.tiles import TileTopK


class Codec(ABC):
    """Encodes a tensor into an :class:`Encoded` and back. Instances are stateless and thread-safe."""

    spec: str
    """Canonical spec, e.g. ``"topk:0.01,chunk=4096|int4:block=256"``."""

    @abstractmethod
    def encode(self, tensor: torch.Tensor, *, seed: int = 0) -> Encoded:
        """Encode ``tensor`` (float32/float16/bfloat16/float64, any shape) on its own device.

        ``seed`` picks ``randk``'s coordinates (the caller passes a per-site seed, or the round's
        shared seed when ``shared_coordinates``) and, in ``geoloco.algorithms``, seeds stochastic
        rounding. Raises :class:`ValueError` for NaN/Inf or unsupported dtypes, before anything
        is encoded.
        """

    @abstractmethod
    def decode(
        self,
        encoded: Encoded | bytes | bytearray | memoryview,
        *,
        device: torch.device | str | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Reconstruct the tensor, in the original shape and dtype, on ``device``.

        ``device`` defaults to the payload's device; only the compressed payload is moved.
        ``out`` (optional, contiguous, matching numel) receives the result instead of a new
        tensor; a float ``out`` of another dtype receives the values converted directly.
        Raises :class:`CodecError` when the data does not fit this codec.
        """

    @abstractmethod
    def encoded_nbytes(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> int:
        """Exact wire size (``Encoded.nbytes``) of encoding a tensor of this shape and dtype,
        without encoding one: what a simulator charges a link for."""

    @property
    def shared_coordinates(self) -> bool:
        """True when every site must encode with the round's shared seed (``randk:F,shared``)."""
        return False

    def with_shapes(self, shapes: Sequence[Sequence[int]]) -> Codec:
        """This codec bound to the tensors a flat vector is made of (a model's parameter
        shapes, in order); only codecs that tile per tensor (``tiletopk``) use them."""
        return self

    def add_decoded_into(self, encoded: Encoded, out: torch.Tensor, *, scale: float = 1.0) -> None:
        """``out.add_(decode(encoded), alpha=scale)`` for a flat ``out`` of ``encoded.numel``
        values: the same numbers, and :class:`CodecError` before ``out`` is touched when the
        data cannot be decoded. Pipelines override it to skip the dense decoded tensor."""
        out.add_(self.decode(encoded, device=out.device).reshape(-1).to(out), alpha=scale)

    def decoded_norm(self, encoded: Encoded, *, device: torch.device | str | None = None) -> tuple[float, bool]:
        """(L2 norm, whether every value is finite) of ``decode(encoded)`` on ``device``.

        The norm is summed in float64: it equals ``vector_norm(decode(encoded))`` up to float32
        rounding and summation order, and is not finite only for non-finite values. Pipelines
        override it to skip the dense decoded tensor.
        """
        decoded = self.decode(encoded, device=device)
        return _norm_of_pieces(iter([(0, decoded.reshape(-1))]))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    def __repr__(self) -> str:
        return f"parse_codec({self.spec!r})"


class PipelineCodec(Codec):
    """An optional sparsifier followed by a value codec; what :func:`parse_codec` returns.

    ``values`` (a :class:`ValueCodec`) and ``sparsifier`` (a :class:`Sparsifier` or ``None``) are
    public so callers can inspect a pipeline, e.g. secure aggregation requires ``randk``.
    """

    def __init__(self, values: ValueCodec, sparsifier: Sparsifier | None = None) -> None:
        self.values = values
        self.sparsifier = sparsifier
        stages: list[Stage] = [values] if sparsifier is None else [sparsifier, values]
        self._spec = "|".join(stage.canonical() for stage in stages)

    @property
    def spec(self) -> str:  # type: ignore[override]
        """Canonical spec (read-only: parsed codecs are cached and shared)."""
        return self._spec

    @property
    def shared_coordinates(self) -> bool:
        """True for ``randk:F,shared``: the caller must pass the round's shared seed to
        ``encode`` so that every site keeps the same coordinates."""
        return isinstance(self.sparsifier, RandK) and self.sparsifier.shared

    def with_shapes(self, shapes: Sequence[Sequence[int]]) -> PipelineCodec:
        """This codec bound to the tensors a flat vector is made of, in order (a model's
        parameter shapes): ``tiletopk`` then tiles each tensor; other codecs ignore shapes.
        The spec is unchanged: a ``tiletopk`` payload names its shapes itself."""
        if not isinstance(self.sparsifier, TileTopK):
            return self
        return PipelineCodec(self.values, self.sparsifier.with_shapes(shapes))

    def payload_nbytes(self, numel: int, dtype: torch.dtype, sparsifier: Sparsifier | None = None) -> int:
        """Exact payload size for a tensor of ``numel`` elements of ``dtype`` (``sparsifier``:
        the pipeline's own bound to a shape or payload, when its size depends on it)."""
        sparsifier = sparsifier or self.sparsifier
        values = self._values_for(sparsifier, numel)
        if sparsifier is None:
            return values.payload_nbytes(numel, dtype)
        return sparsifier.index_nbytes(numel) + values.payload_nbytes(sparsifier.num_selected(numel), dtype)

    def _values_for(self, sparsifier: Sparsifier | None, numel: int) -> ValueCodec:
        """The value codec for what ``sparsifier`` (bound to a shape or payload) keeps of
        ``numel`` values: told the per-tensor runs, for codecs that code tensors apart."""
        if sparsifier is None:
            return self.values
        return self.values.for_segments(sparsifier.value_segments(numel))

    def encoded_nbytes(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> int:
        numel = math.prod(shape)
        probe = Encoded(self.spec, tuple(shape), dtype, torch.empty(0, dtype=torch.uint8))
        sparsifier = None if self.sparsifier is None else self.sparsifier.for_shape(tuple(shape))
        return probe.nbytes + self.payload_nbytes(numel, dtype, sparsifier)

    def encode(self, tensor: torch.Tensor, *, seed: int = 0) -> Encoded:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"codec {self.spec!r} encodes torch tensors, got {type(tensor).__name__}")
        if tensor.dtype not in DTYPE_CODES:
            raise ValueError(
                f"codec {self.spec!r} encodes floating-point tensors "
                f"({', '.join(map(str, DTYPE_CODES))}); got {tensor.dtype}: convert it first"
            )
        with torch.no_grad():
            flat = tensor.detach().reshape(-1).contiguous()
            absmax = None
            lossless_values = isinstance(self.values, Lossless)
            if self.sparsifier is not None or not self.values.checks_finite or flat.dtype == torch.float64:
                absmax = _check_encodable(flat, self.spec, float32_range=not lossless_values)
            numel = flat.numel()
            sparsifier = None if self.sparsifier is None else self.sparsifier.for_shape(tuple(tensor.shape))
            payload = _memory.empty(self.payload_nbytes(numel, flat.dtype, sparsifier), torch.uint8, flat.device)
            if sparsifier is None:
                self.values.encode_into(flat, payload, absmax=absmax)
            else:
                index_nbytes = sparsifier.index_nbytes(numel)
                chosen = sparsifier.select(flat, payload[:index_nbytes], seed=seed)
                self._values_for(sparsifier, numel).encode_into(chosen, payload[index_nbytes:], absmax=absmax)
        return Encoded(self.spec, tuple(tensor.shape), tensor.dtype, payload)

    def decode(
        self,
        encoded: Encoded | bytes | bytearray | memoryview,
        *,
        device: torch.device | str | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not isinstance(encoded, Encoded):
            encoded = Encoded.from_bytes(encoded)
        if encoded.spec != self.spec and _canonical_or_none(encoded.spec) != self.spec:
            raise CodecError(
                f"data was encoded with {encoded.spec!r} but this codec is {self.spec!r}; "
                "use geoloco.compression.decode(), which reads the codec from the data"
            )
        return self._decode(encoded, device=device, out=out)

    def add_decoded_into(self, encoded: Encoded, out: torch.Tensor, *, scale: float = 1.0) -> None:
        """Decode and add piece by piece: a quantized or cast payload a few MB at a time through
        one reused buffer, a sparse one at its selected coordinates only. Every coordinate gets
        ``scale * value`` added once by the same ``add_`` as in ``decode`` then add, so the sum
        is bit-for-bit the same; coordinates a sparsifier did not select are left as they are
        (adding ``scale * 0`` changes no value but ``-0.0``, which a sum started at zero never
        holds). A :class:`CodecError` comes before ``out`` is touched: sparse indices and
        quantizer scales are checked before the first piece, cast payloads cannot fail."""
        if not self._pieces_apply(encoded, out):
            super().add_decoded_into(encoded, out, scale=scale)
            return
        alpha = float(scale)
        flat = out.view(-1)
        for where, values in self._pieces(self._checked(encoded), flat.device):
            if isinstance(where, int):
                flat[where : where + values.numel()].add_(values, alpha=alpha)
            else:
                gathered = flat.index_select(0, where)
                gathered.add_(values, alpha=alpha)
                flat.index_copy_(0, where, gathered)

    def decoded_norm(self, encoded: Encoded, *, device: torch.device | str | None = None) -> tuple[float, bool]:
        if not isinstance(encoded, Encoded) or encoded.dtype != torch.float32:
            return super().decoded_norm(encoded, device=device)
        target = _resolve_device(device) if device is not None else encoded.payload.device
        return _norm_of_pieces(self._pieces(self._checked(encoded), target))

    def _pieces_apply(self, encoded: Encoded, out: torch.Tensor) -> bool:
        """Whether piecewise decoding gives exactly ``decode``'s values for this ``out``: a
        float32 original added into a contiguous float32 buffer of its size."""
        return (
            isinstance(encoded, Encoded)
            and encoded.dtype == torch.float32
            and out.dtype == torch.float32
            and out.is_contiguous()
            and out.numel() == encoded.numel
        )

    def _checked(self, encoded: Encoded) -> Encoded:
        if encoded.spec != self.spec and _canonical_or_none(encoded.spec) != self.spec:
            raise CodecError(f"data was encoded with {encoded.spec!r} but this codec is {self.spec!r}")
        sparsifier = self._sparsifier_for(encoded.payload, encoded.numel)
        check_payload_nbytes(
            self.spec, encoded.payload, self.payload_nbytes(encoded.numel, encoded.dtype, sparsifier)
        )
        return encoded

    def _sparsifier_for(self, payload: torch.Tensor, numel: int) -> Sparsifier | None:
        """The sparsifier that decodes ``payload``: bound to the shapes it names, if any."""
        return None if self.sparsifier is None else self.sparsifier.for_payload(payload, numel)

    def _pieces(self, encoded: Encoded, device: torch.device) -> Iterator[tuple[int | torch.Tensor, torch.Tensor]]:
        """``(offset, values)`` runs or one ``(indices, values)`` set of the decoded tensor."""
        payload = encoded.payload.to(device).contiguous()
        numel = encoded.numel
        try:
            with torch.no_grad():
                if self.sparsifier is None:
                    yield from self.values.decode_pieces(payload, numel, encoded.dtype, device)
                    return
                sparsifier = self._sparsifier_for(payload, numel)
                assert sparsifier is not None
                index_nbytes = sparsifier.index_nbytes(numel)
                chosen = torch.empty(sparsifier.num_selected(numel), dtype=torch.float32, device=device)
                self._values_for(sparsifier, numel).decode_into(payload[index_nbytes:], chosen, encoded.dtype)
                yield sparsifier.selected(payload[:index_nbytes], chosen, numel)
        except CodecError:
            raise
        except (RuntimeError, IndexError, ValueError) as exc:
            raise CodecError(f"{self.spec!r}: payload cannot be decoded ({exc})") from exc

    def _decode(self, encoded: Encoded, *, device: torch.device | str | None, out: torch.Tensor | None) -> torch.Tensor:
        if device is not None:
            target = _resolve_device(device)
        elif out is not None:
            target = out.device
        else:
            target = encoded.payload.device
        numel = encoded.numel
        if out is not None:
            _check_out(out, numel, target)
        payload = encoded.payload.to(target).contiguous()
        sparsifier = self._sparsifier_for(payload, numel)
        check_payload_nbytes(self.spec, payload, self.payload_nbytes(numel, encoded.dtype, sparsifier))
        result = out.view(-1) if out is not None else _memory.empty(numel, encoded.dtype, target)
        try:
            with torch.no_grad():
                if sparsifier is None:
                    self.values.decode_into(payload, result, encoded.dtype)
                else:
                    index_nbytes = sparsifier.index_nbytes(numel)
                    chosen = torch.empty(sparsifier.num_selected(numel), dtype=result.dtype, device=target)
                    values = self._values_for(sparsifier, numel)
                    values.decode_into(payload[index_nbytes:], chosen, encoded.dtype)
                    sparsifier.scatter_into(payload[:index_nbytes], chosen, result)
        except CodecError:
            raise
        except (RuntimeError, IndexError, ValueError) as exc:
            raise CodecError(f"{self.spec!r}: payload cannot be decoded ({exc})") from exc
        return out if out is not None else result.view(encoded.shape)


def _norm_of_pieces(pieces: Iterator[tuple[int | torch.Tensor, torch.Tensor]]) -> tuple[float, bool]:
    """(L2 norm, all finite) of the values of ``pieces``, summed in float64: no float32 square
    overflows (a large-but-finite update gets its true norm), so only a NaN or an infinity
    makes it non-finite, and the result is closer to the exact norm than float32's
    ``vector_norm`` of the whole tensor (which is off by ~1e-5 relative at 1M values)."""
    total = 0.0
    for _, values in pieces:
        if values.numel():
            total += float(torch.linalg.vector_norm(values, dtype=torch.float64)) ** 2
    norm = math.sqrt(total)
    return norm, math.isfinite(norm)


def _check_encodable(flat: torch.Tensor, spec: str, *, float32_range: bool) -> float:
    """Reject NaN/Inf (and, for lossy codecs, float64 beyond float32's range); return max |x|."""
    if flat.numel() == 0:
        return 0.0
    low, high = torch.aminmax(flat)
    low_value, high_value = float(low), float(high)
    if not (math.isfinite(low_value) and math.isfinite(high_value)):
        raise ValueError(f"cannot encode a tensor with NaN or Inf values (codec {spec!r}); clean or clip it first")
    absmax = max(-low_value, high_value)
    if float32_range and absmax > torch.finfo(torch.float32).max:
        raise ValueError(
            f"codec {spec!r} computes in float32, but the tensor holds {absmax:.4g}, beyond float32's range; "
            "scale it down or use 'none'"
        )
    return absmax


def _resolve_device(device: torch.device | str) -> torch.device:
    """``"cuda"`` -> ``cuda:<current>``, so it compares equal to the devices tensors report."""
    return torch.empty(0, device=device).device


def _check_out(out: torch.Tensor, numel: int, device: torch.device) -> None:
    if out.numel() != numel or not out.is_contiguous() or out.dtype not in DTYPE_CODES or out.device != device:
        raise ValueError(
            f"decode out= must be a contiguous float tensor of {numel} elements on {device}; "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}{'' if out.is_contiguous() else ' (not contiguous)'}"
        )


# ------------------------------------------------------------------ registry


@dataclass(frozen=True, slots=True)
class CodecType:
    """A registry entry: how a stage name is spelled, what it accepts and how it is built."""

    name: str
    """Name as written in specs."""
    kind: Literal["sparsifier", "values"]
    """Sparsifiers come first in a pipeline, value codecs last."""
    summary: str
    """One line for CLI help."""
    options: tuple[Option, ...]
    """Accepted arguments."""
    positional: str | None
    """Option that may be given without ``key=`` (the fraction)."""
    build: Callable[..., Stage]
    """Factory taking the parsed options as keyword arguments."""

    def describe(self) -> str:
        """``name: summary`` plus one line per option."""
        lines = [f"{self.name}: {self.summary}"]
        lines.extend(f"    {option.describe()}" for option in self.options)
        return "\n".join(lines)


def _quantizer_type(bits: int, summary: str) -> CodecType:
    return CodecType(
        f"int{bits}",
        "values",
        summary,
        (BLOCK_OPTION, STOCHASTIC_OPTION),
        None,
        functools.partial(BlockQuantizer, bits),
    )


CODECS: Final[dict[str, CodecType]] = {
    entry.name: entry
    for entry in (
        CodecType("none", "values", Lossless.summary, (), None, Lossless),
        CodecType("fp32", "values", "cast values to float32 (lossless for fp32/fp16/bf16)", (), None,
                  functools.partial(Cast, torch.float32)),
        CodecType("bf16", "values", "cast values to bfloat16 (8 significant bits, saturating)", (), None,
                  functools.partial(Cast, torch.bfloat16)),
        CodecType("fp16", "values", "cast values to float16 (11 significant bits, saturating at 65504)", (), None,
                  functools.partial(Cast, torch.float16)),
        _quantizer_type(8, "8-bit block absmax quantization, error <= absmax/254"),
        _quantizer_type(4, "4-bit block absmax quantization, error <= absmax/14"),
        _quantizer_type(2, "2-bit block absmax quantization (levels ±absmax/3, ±absmax), error <= absmax/3"),
        _quantizer_type(1, "1-bit sign quantization scaled by the block's mean |x| (stochastic: by absmax)"),
        CodecType("int2mean", "values", BinMeanQuantizer.summary, BinMeanQuantizer.options, None, BinMeanQuantizer),
        CodecType("topk", "sparsifier", TopK.summary, TopK.options, TopK.positional, TopK),
        CodecType("randk", "sparsifier", RandK.summary, RandK.options, RandK.positional, RandK),
        CodecType("tiletopk", "sparsifier", TileTopK.summary, TileTopK.options, TileTopK.positional, TileTopK),
    )
}
"""Every stage name a spec may use, in the order help lists them: the one registry, which
``register_codec`` adds a plug-in's stages to."""

_STAGE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


def register_codec(codec: type[Stage] | CodecType, *, replace: bool = False) -> CodecType:
    """Make a spec accept a plug-in's stage by name, and return its registry entry.

    ``codec`` is a ``Sparsifier`` or ``ValueCodec`` subclass (its ``name``, ``kind``, ``summary``,
    ``options`` and ``positional`` class attributes describe it, and it is built with the parsed
    options as keyword arguments, as the built-in stages are), or a ``CodecType`` for a stage
    built by another factory. It then composes like a built-in one (``"topk:0.01|mine"``).

    Registration is per process: a sweep's worker processes and Ray workers know the name only
    when the module that registers it is imported there too (a simulate config's ``[research]
    plugins``). A name already taken raises ``ValueError`` unless ``replace``; registering the
    same class again (a module imported twice) is a no-op."""
    if isinstance(codec, CodecType):
        entry = codec
    elif isinstance(codec, type) and issubclass(codec, (Sparsifier, ValueCodec)):
        entry = CodecType(codec.name, codec.kind, codec.summary, codec.options, codec.positional, codec)
    else:
        raise TypeError(
            f"register_codec takes a Sparsifier or ValueCodec subclass, or a CodecType; got {codec!r}"
        )
    if not isinstance(entry.name, str) or not _STAGE_NAME.fullmatch(entry.name):
        raise ValueError(
            f"a codec name is letters, digits and '_' starting with a letter (no ':', '|' or ','), got {entry.name!r}"
        )
    if entry.kind not in ("sparsifier", "values"):
        raise ValueError(f"codec {entry.name!r}: kind must be 'sparsifier' or 'values', got {entry.kind!r}")
    fractions = [option.name for option in entry.options if option.kind == "fraction"]
    if entry.positional is not None and entry.positional not in {option.name for option in entry.options}:
        raise ValueError(f"codec {entry.name!r}: positional {entry.positional!r} is not one of its options")
    if len(fractions) > 1:
        raise ValueError(f"codec {entry.name!r}: at most one fraction option, got {fractions}")
    known = CODECS.get(entry.name)
    if known is not None and not replace and _where(known.build) != _where(entry.build):
        raise ValueError(
            f"codec {entry.name!r} is already registered (by {_where(known.build)}); pick another name, "
            "or pass replace=True"
        )
    CODECS[entry.name] = entry
    _parse.cache_clear()  # a cached spec may name the replaced stage
    return entry


def _where(build: Callable[..., Stage]) -> str:
    target = build.func if isinstance(build, functools.partial) else build
    args = build.args if isinstance(build, functools.partial) else ()
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}{args or ''}"


def codec_names(kind: Literal["sparsifier", "values"] | None = None) -> tuple[str, ...]:
    """The stage names a spec accepts (of one ``kind``, or all), registered plug-ins included."""
    return tuple(name for name, entry in CODECS.items() if kind is None or entry.kind == kind)


_NAME_TUPLES: Final[dict[str, Literal["sparsifier", "values"] | None]] = {
    "CODEC_NAMES": None, "SPARSIFIER_NAMES": "sparsifier", "VALUE_CODEC_NAMES": "values",
}


def __getattr__(name: str) -> tuple[str, ...]:
    """``CODEC_NAMES``, ``SPARSIFIER_NAMES``, ``VALUE_CODEC_NAMES``: ``codec_names()`` read when
    asked for, so they include the stages registered since (PEP 562)."""
    if name in _NAME_TUPLES:
        return codec_names(_NAME_TUPLES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def describe_codecs() -> str:
    """Human-readable list of every codec and its options, for ``--help`` texts."""
    grammar = (
        "codec spec: [SPARSIFIER|]VALUES, e.g. 'int8', 'topk:0.01|int4', 'randk:0.05|int8', "
        "'int2:block=128,stochastic'"
    )
    return "\n".join([grammar, *(entry.describe() for entry in CODECS.values())])


# ------------------------------------------------------------------ parsing

_INTEGER = re.compile(r"\+?[0-9]+")


def parse_codec(spec: str) -> Codec:
    """Build the codec a spec names; :class:`ValueError` names any bad token and what is accepted."""
    if not isinstance(spec, str):
        raise TypeError(f"a codec spec is a string such as 'topk:0.01|int4', got {type(spec).__name__}")
    return _parse(spec)


@functools.lru_cache(maxsize=256)
def _parse(spec: str) -> PipelineCodec:
    stages: list[Stage] = []
    for text in spec.split("|"):
        if not text.strip():
            raise ValueError(
                f"empty stage in codec spec {spec!r}: stages are separated by '|', e.g. 'topk:0.01|int4'"
            )
        stages.append(_parse_stage(text.strip(), spec))
    layout = (
        f"a pipeline is at most one sparsifier ({', '.join(codec_names('sparsifier'))}) followed by one "
        f"value codec ({', '.join(codec_names('values'))})"
    )
    for position, stage in enumerate(stages[:-1]):
        if isinstance(stage, ValueCodec):
            raise ValueError(f"{stage.name!r} encodes values, so it must be the last stage of {spec!r}; {layout}")
        if position > 0:
            raise ValueError(f"sparsifier {stage.name!r} must be the first stage of {spec!r}; {layout}")
    if len(stages) > 2:
        raise ValueError(f"codec spec {spec!r} has {len(stages)} stages; {layout}")
    last = stages[-1]
    if isinstance(last, Sparsifier):
        if len(stages) > 1:
            raise ValueError(f"sparsifier {last.name!r} must be the first stage of {spec!r}; {layout}")
        return PipelineCodec(Lossless(), last)
    assert isinstance(last, ValueCodec)
    first = stages[0] if len(stages) == 2 else None
    assert first is None or isinstance(first, Sparsifier)
    return PipelineCodec(last, first)


def _canonical_or_none(spec: str) -> str | None:
    try:
        return _parse(spec).spec
    except ValueError:
        return None


def _accepted(entry: CodecType) -> str:
    if not entry.options:
        return f"codec {entry.name!r} takes no arguments"
    return f"accepted for {entry.name!r}: " + "; ".join(option.describe() for option in entry.options)


def _parse_stage(text: str, spec: str) -> Stage:
    name, has_args, arg_text = text.partition(":")
    name = name.strip()
    entry = CODECS.get(name)
    if entry is None:
        raise ValueError(
            f"unknown codec {name!r} in spec {spec!r}; accepted codecs: {', '.join(codec_names())} (a plug-in's "
            "codec exists once its module is imported: list it in [research] plugins)"
        )
    options = {option.name: option for option in entry.options}
    kwargs: dict[str, object] = {}
    if has_args:
        for token in (part.strip() for part in arg_text.split(",")):
            if not token:
                raise ValueError(f"empty argument in {text!r} of spec {spec!r}; {_accepted(entry)}")
            key, has_value, value = (part.strip() for part in token.partition("="))
            option = options.get(key)
            if has_value:
                if option is None:
                    raise ValueError(f"unknown option {key!r} for codec {name!r} in spec {spec!r}; {_accepted(entry)}")
                if option.kind == "flag":
                    raise ValueError(
                        f"flag {key!r} of codec {name!r} takes no value: write just {key!r} (spec {spec!r})"
                    )
            elif option is not None and option.kind == "flag":
                value = ""
            elif entry.positional is not None:
                option, value = options[entry.positional], token
            else:
                raise ValueError(
                    f"unexpected argument {token!r} for codec {name!r} in spec {spec!r}; {_accepted(entry)}"
                )
            if option.name in kwargs:
                raise ValueError(f"option {option.name!r} given twice for codec {name!r} in spec {spec!r}")
            kwargs[option.name] = _parse_value(option, value, name, spec)
    for option in entry.options:
        if option.kind == "fraction" and option.name not in kwargs:
            raise ValueError(f"codec {name!r} needs a fraction, e.g. '{name}:0.01' (spec {spec!r})")
    return entry.build(**kwargs)


def _parse_value(option: Option, value: str, name: str, spec: str) -> object:
    if option.kind == "flag":
        return True
    if option.kind == "fraction":
        try:
            fraction = float(value)
        except ValueError:
            fraction = math.nan
        if not (math.isfinite(fraction) and 0.0 < fraction <= 1.0):
            raise ValueError(
                f"fraction {value!r} for codec {name!r} in spec {spec!r} must be a number in (0, 1], "
                f"e.g. '{name}:0.01'"
            )
        return fraction
    if not _INTEGER.fullmatch(value):
        raise ValueError(
            f"{option.name}={value!r} for codec {name!r} in spec {spec!r} is not an integer; {option.describe()}"
        )
    number = int(value)
    if not option.minimum <= number <= option.maximum or number % option.multiple_of:
        raise ValueError(
            f"{option.name}={value} for codec {name!r} in spec {spec!r} is out of range; {option.describe()}"
        )
    return number


def decode(
    encoded: Encoded | bytes | bytearray | memoryview,
    *,
    device: torch.device | str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode with the codec the data names; :class:`CodecError` if it cannot be decoded."""
    if not isinstance(encoded, Encoded):
        encoded = Encoded.from_bytes(encoded)
    try:
        codec = _parse(encoded.spec)
    except ValueError as exc:
        raise CodecError(f"encoded data names a codec this build cannot decode: {exc}") from exc
    return codec._decode(encoded, device=device, out=out)


def _codec_of(encoded: Encoded) -> PipelineCodec:
    try:
        return _parse(encoded.spec)
    except ValueError as exc:
        raise CodecError(f"encoded data names a codec this build cannot decode: {exc}") from exc


def add_decoded_into(encoded: Encoded, out: torch.Tensor, *, scale: float = 1.0) -> None:
    """``out += scale * decode(encoded)`` without a dense decoded tensor, with the codec the
    data names (:meth:`Codec.add_decoded_into`)."""
    _codec_of(encoded).add_decoded_into(encoded, out, scale=scale)


def decoded_norm(encoded: Encoded, *, device: torch.device | str | None = None) -> tuple[float, bool]:
    """(L2 norm, all finite) of ``decode(encoded)`` without a dense decoded tensor
    (:meth:`Codec.decoded_norm`); :class:`CodecError` if the data cannot be decoded."""
    return _codec_of(encoded).decoded_norm(encoded, device=device)
