"""Error feedback: remember what compression dropped and send it later.

With a lossy codec ``C``/``D``, each call computes ``u = decay * e + x``, sends ``c = C(u)`` and
keeps ``e = u - D(c)``. With ``decay = 1`` nothing is ever lost, only delayed: after any number of
steps, ``sum(D(c_t)) + e == sum(x_t)`` up to float rounding, which is what makes aggressive
sparsifiers (top-k at 1%) converge (Seide et al. 2014, "1-bit SGD"; Karimireddy et al. 2019,
"Error Feedback Fixes SignSGD"). ``decay < 1`` forgets stale residual geometrically.

The residual is kept in float32 (float64 for float64 inputs) on the input's device even when the
input is float16/bfloat16, so it does not itself round away small updates; what is encoded is
``u`` cast back to the input's dtype, and the residual subtracts exactly what the receiver will
decode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from geoloco.compression.codec import Codec
from geoloco.compression.encoded import Encoded


class ErrorFeedback:
    """Wraps a codec with a residual; one instance per tensor stream (e.g. per parameter, per site).

    Holds one buffer the size of the tensor in the working dtype, the residual: ``u`` is formed
    in it, encoded from it, and the decoded message is subtracted from it piece by piece
    (``Codec.add_decoded_into`` with scale -1), so an encode allocates nothing large besides the
    payload. The numbers are bit-for-bit those of forming ``u`` in a separate buffer
    (``u + (-1)·d`` rounds exactly like ``u - d``).
    """

    def __init__(self, codec: Codec, *, decay: float = 1.0) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"error-feedback decay must be in [0, 1] (1 keeps the whole residual), got {decay}")
        self.codec = codec
        self.decay = float(decay)
        self.residual: torch.Tensor | None = None

    def encode(self, tensor: torch.Tensor, *, seed: int = 0) -> Encoded:
        """Encode ``tensor`` plus the carried residual, and update the residual.

        On any error (NaN input, wrong shape) the residual is left unchanged.
        """
        work_dtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32
        residual = self.residual
        if residual is None:
            residual = torch.zeros(tensor.shape, dtype=work_dtype, device=tensor.device)
        elif residual.shape != tensor.shape or residual.device != tensor.device or residual.dtype != work_dtype:
            raise ValueError(
                f"error feedback holds a residual of shape {tuple(residual.shape)} ({residual.dtype}, "
                f"{residual.device}) but got a tensor of shape {tuple(tensor.shape)} ({tensor.dtype}, "
                f"{tensor.device}); use one ErrorFeedback per tensor, or reset() it"
            )
        with torch.no_grad():
            source = tensor.detach()
            if tensor.dtype == work_dtype and residual.is_contiguous() and self._encodable_sum(residual, source):
                self._corrected_into(residual, source, residual)
                encoded = self.codec.encode(residual, seed=seed)
                self.codec.add_decoded_into(encoded, residual.view(-1), scale=-1.0)
            else:
                # Converted inputs, and sums the codec may refuse (its error must leave the
                # residual as it was): ``u`` in a temporary.
                corrected = self._corrected_into(residual, source, torch.empty_like(residual))
                sent = corrected if tensor.dtype == work_dtype else corrected.to(tensor.dtype)
                encoded = self.codec.encode(sent, seed=seed)
                if tensor.dtype == work_dtype:
                    self.codec.decode(encoded, out=residual)
                    torch.sub(corrected, residual, out=residual)
                else:
                    residual = corrected - self.codec.decode(encoded).to(work_dtype)
        self.residual = residual
        return encoded

    def encode_added(
        self, pieces: Callable[[], Iterator[tuple[int, torch.Tensor]]], numel: int, *,
        device: torch.device, seed: int = 0,
    ) -> Encoded | None:
        """``encode`` of a float32 vector ``x`` of ``numel`` values that is never materialised:
        ``pieces()`` yields ``(offset, x[offset : offset + n])`` in order, small pieces computed
        on demand (a site's pseudo-gradient, parameter by parameter). ``u = e + x`` is formed
        in the residual, so encoding costs no model-sized buffer besides the residual itself.

        ``pieces`` is called twice: once to check that ``u`` is encodable (finite, within half
        float32's range) before the residual changes, once to add. None (residual unchanged)
        where this cannot give ``encode``'s bits, or ``u`` is not encodable: the caller then
        takes the dense path (``encode``), which handles those cases. The bits are
        ``encode``'s: ``e + x`` piece by piece is the same elementwise sum (``decay = 1`` only:
        a scaled sum may round differently between vectorised and scalar code)."""
        residual = self.residual
        if self.decay != 1.0 or (
            residual is not None and (
                residual.shape != (numel,) or residual.dtype != torch.float32
                or residual.device != device or not residual.is_contiguous()
            )
        ):
            return None
        if residual is None:
            residual = torch.zeros(numel, dtype=torch.float32, device=device)
        limit = torch.finfo(torch.float32).max / 2
        with torch.no_grad():
            covered = 0
            for offset, piece in pieces():
                if piece.dtype != torch.float32 or piece.device != device or offset != covered:
                    return None
                covered = offset + piece.numel()
                if not piece.numel():
                    continue
                low, high = torch.aminmax(torch.add(residual[offset:covered], piece))
                if not (-limit <= float(low) and float(high) <= limit):  # NaN fails too
                    return None
            if covered != numel:
                return None
            for offset, piece in pieces():
                target = residual[offset : offset + piece.numel()]
                torch.add(target, piece, out=target)
            encoded = self.codec.encode(residual, seed=seed)
            self.codec.add_decoded_into(encoded, residual, scale=-1.0)
        self.residual = residual
        return encoded

    def _corrected_into(self, residual: torch.Tensor, tensor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``u = decay * residual + tensor`` into ``out`` (which may be ``residual``)."""
        if self.decay == 1.0:
            return torch.add(residual, tensor, out=out)
        return torch.add(tensor, residual, alpha=self.decay, out=out)

    def _encodable_sum(self, residual: torch.Tensor, tensor: torch.Tensor) -> bool:
        """Whether ``u`` is finite and at most half float32's maximum, so no codec refuses it
        (checked a piece at a time in a small buffer before the residual is overwritten)."""
        flat_residual, flat_tensor = residual.reshape(-1), tensor.reshape(-1)
        numel = flat_residual.numel()
        scratch = torch.empty(min(numel, _CHECK_ELEMENTS), dtype=residual.dtype, device=residual.device)
        limit = torch.finfo(torch.float32).max / 2
        for start in range(0, numel, _CHECK_ELEMENTS):
            stop = min(numel, start + _CHECK_ELEMENTS)
            piece = self._corrected_into(flat_residual[start:stop], flat_tensor[start:stop], scratch[: stop - start])
            low, high = torch.aminmax(piece)
            if not (-limit <= float(low) and float(high) <= limit):  # NaN fails too
                return False
        return True

    def reset(self) -> None:
        """Forget the residual (e.g. after the model was re-synchronised from a checkpoint)."""
        self.residual = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{"residual": tensor}``, or ``{}`` before the first encode; for checkpoints."""
        return {} if self.residual is None else {"residual": self.residual}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict` output (the tensor is copied)."""
        unknown = set(state) - {"residual"}
        if unknown:
            raise ValueError(f"error-feedback state has unknown keys {sorted(unknown)}; expected only 'residual'")
        residual = state.get("residual")
        if residual is not None and (
            not isinstance(residual, torch.Tensor) or residual.dtype not in (torch.float32, torch.float64)
        ):
            raise ValueError("error-feedback state 'residual' must be a float32 or float64 tensor")
        self.residual = None if residual is None else residual.detach().clone()


_CHECK_ELEMENTS = 1 << 20
"""Values per piece of the pre-check of ``u``: a 4 MB scratch buffer."""
