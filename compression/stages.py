"""The two kinds of pipeline stage, and how a stage declares its spec options.

A codec spec is a pipeline of at most one *sparsifier* (chooses which coordinates travel and how
their positions are described) followed by exactly one *value codec* (turns the chosen values into
bytes). Keeping the two roles apart is what lets ``"topk:0.01|int4"`` and ``"randk:0.05|int8"``
reuse the same quantizer code that ``"int4"`` uses on a dense tensor.

Stages work on flat, contiguous 1-D tensors and write into byte regions the pipeline has sized
with their ``*_nbytes`` methods, so a whole encoding is one allocation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, Final, Literal

import torch

from geoloco.compression.encoded import CodecError


@dataclass(frozen=True, slots=True)
class Option:
    """One argument a stage accepts in a spec string."""

    name: str
    """Key in ``key=value`` form (or the flag itself)."""
    kind: Literal["fraction", "int", "flag"]
    """``fraction``: a number in (0, 1]; ``int``: a bounded integer; ``flag``: present or absent."""
    help: str
    """One line for CLI help and error messages."""
    default: float | int | bool | None = None
    """Value when absent; ``None`` means required (fractions) or derived by the stage."""
    minimum: int = 1
    """Smallest accepted value (``int`` only)."""
    maximum: int = 2**31 - 1
    """Largest accepted value (``int`` only)."""
    multiple_of: int = 1
    """Accepted values must be multiples of this (``int`` only)."""

    def describe(self) -> str:
        """How the option is written, with its constraint and default, e.g. ``block=N (...)``."""
        if self.kind == "flag":
            return f"{self.name} (flag: {self.help})"
        if self.kind == "fraction":
            return f"{self.name}=F or positional F (number in (0, 1]: {self.help})"
        bounds = f"{self.minimum}..{self.maximum}"
        if self.multiple_of > 1:
            bounds += f", multiple of {self.multiple_of}"
        default = "" if self.default is None else f", default {self.default}"
        return f"{self.name}=N (integer {bounds}{default}: {self.help})"


class Stage(ABC):
    """Common surface of sparsifiers and value codecs: a registry name and a canonical spec."""

    name: ClassVar[str]
    kind: ClassVar[Literal["sparsifier", "values"]]
    summary: ClassVar[str]
    options: ClassVar[tuple[Option, ...]] = ()
    positional: ClassVar[str | None] = None
    """Name of the option that may also be written without ``key=`` (the fraction)."""

    def canonical(self) -> str:
        """This stage's spec with every option spelled out in declaration order.

        Fractions print as Python's shortest round-trip repr, so parsing the canonical spec gives
        back the identical stage. Flags appear only when set.
        """
        args: list[str] = []
        for option in self.options:
            value = getattr(self, option.name)
            if option.kind == "flag":
                if value:
                    args.append(option.name)
            elif option.name == self.positional:
                args.append(repr(float(value)))
            else:
                args.append(f"{option.name}={value}")
        return self.name + (":" + ",".join(args) if args else "")


class ValueCodec(Stage):
    """Turns a flat tensor of values into bytes and back."""

    kind: ClassVar[Literal["values"]] = "values"
    checks_finite: ClassVar[bool] = False
    """True when ``encode_into`` itself rejects NaN/Inf, so the pipeline can skip its own pass."""

    @abstractmethod
    def payload_nbytes(self, numel: int, dtype: torch.dtype) -> int:
        """Exact payload size for ``numel`` values whose original dtype is ``dtype``."""

    @abstractmethod
    def encode_into(self, values: torch.Tensor, out: torch.Tensor, *, absmax: float | None) -> None:
        """Encode contiguous 1-D ``values`` into the ``uint8`` region ``out``.

        ``absmax`` is the largest magnitude in the input when the pipeline already knows it
        (``None`` otherwise); casts use it to decide whether saturation is needed.
        """

    @abstractmethod
    def decode_into(self, payload: torch.Tensor, out: torch.Tensor, dtype: torch.dtype) -> None:
        """Decode ``payload`` into contiguous 1-D ``out`` (any float dtype).

        ``dtype`` is the original dtype recorded in the header. The pipeline has checked the
        payload length; contents that cannot be valid raise :class:`CodecError`.
        """

    def for_segments(self, segments: tuple[int, ...] | None) -> ValueCodec:
        """The value codec that codes values made of these consecutive runs (one per tensor, from
        ``Sparsifier.value_segments``): itself, unless it codes each run apart (``int2mean``)."""
        return self

    def decode_pieces(
        self, payload: torch.Tensor, numel: int, dtype: torch.dtype, device: torch.device
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """The float32 decoding of ``payload`` as ``(offset, values)`` pieces in order, so a
        caller can add or reduce an update without a dense copy of it.

        Each piece holds exactly the values ``decode_into`` writes at ``offset`` (the same
        operations per value) and is only valid until the next one is requested: codecs reuse
        one small buffer. This fallback decodes everything into one tensor; codecs whose values
        decode independently of each other override it.
        """
        out = torch.empty(numel, dtype=torch.float32, device=device)
        self.decode_into(payload, out, dtype)
        yield 0, out


PIECE_ELEMENTS: Final = 1 << 20
"""Values per piece of ``decode_pieces``: a 4 MB fp32 buffer, small next to any model."""


def elementwise_pieces(
    codec: ValueCodec, payload: torch.Tensor, numel: int, dtype: torch.dtype, device: torch.device, itemsize: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """``decode_pieces`` of a codec that stores each value in ``itemsize`` bytes of its own:
    slices of the payload decoded into one reused buffer."""
    if not numel:
        return
    buffer = torch.empty(min(numel, PIECE_ELEMENTS), dtype=torch.float32, device=device)
    for start in range(0, numel, PIECE_ELEMENTS):
        stop = min(numel, start + PIECE_ELEMENTS)
        piece = buffer[: stop - start]
        codec.decode_into(payload[start * itemsize : stop * itemsize], piece, dtype)
        yield start, piece


class Sparsifier(Stage):
    """Chooses a subset of coordinates; the following value codec encodes the chosen values."""

    kind: ClassVar[Literal["sparsifier"]] = "sparsifier"

    def for_shape(self, shape: tuple[int, ...]) -> Sparsifier:
        """The sparsifier that encodes a tensor of ``shape``: itself, unless its choice depends
        on tensor shapes (``tiletopk``) and it is not bound to any yet."""
        return self

    def for_payload(self, payload: torch.Tensor, numel: int) -> Sparsifier:
        """The sparsifier that decodes ``payload`` (the whole pipeline payload) of ``numel``
        values: itself, unless the payload names the shapes it was encoded with (``tiletopk``)."""
        return self

    @abstractmethod
    def num_selected(self, numel: int) -> int:
        """How many values are kept out of ``numel``."""

    def value_segments(self, numel: int) -> tuple[int, ...] | None:
        """How many of the kept values come from each tensor, in payload order, when the
        sparsifier knows the tensors (``tiletopk``); None: the values are one run."""
        return None

    @abstractmethod
    def index_nbytes(self, numel: int) -> int:
        """Bytes of position information (seed or packed indices), a multiple of 8 so the value
        region that follows stays aligned for any dtype."""

    @abstractmethod
    def select(self, flat: torch.Tensor, index_out: torch.Tensor, *, seed: int) -> torch.Tensor:
        """Write position information into ``index_out`` and return the selected values.

        The returned tensor is 1-D, contiguous, of ``flat``'s dtype and device, with
        ``num_selected(flat.numel())`` elements.
        """

    @abstractmethod
    def scatter_into(self, index_payload: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> None:
        """Write the dense reconstruction into ``out`` (every element, zeros where not selected)."""

    @abstractmethod
    def selected(
        self, index_payload: torch.Tensor, values: torch.Tensor, numel: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indices, values)`` that ``scatter_into`` would write: distinct int64 coordinates
        of the flat tensor in payload order and the values stored there (``values`` itself, or
        a scaled copy), checked like ``scatter_into`` checks them."""


def check_payload_nbytes(what: str, payload: torch.Tensor, expected: int) -> None:
    """Raise :class:`CodecError` unless the payload region has exactly ``expected`` bytes."""
    if payload.numel() != expected:
        raise CodecError(f"{what}: payload has {payload.numel()} bytes, the spec implies {expected}")
