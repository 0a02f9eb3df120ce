"""Global weights as one flat fp32 vector, and the layout that maps it back onto a model.

Every piece of round math (pseudo-gradients, aggregation, outer step, downlink deltas, digests)
works on a single contiguous fp32 vector: codecs see one tensor, the aggregation buffer is one
allocation, and a digest is one hash over exact bytes. ``ParamLayout`` keeps the names, shapes and
offsets so a checkpoint or a per-tensor manifest can still speak in parameter names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "ParamEntry",
    "ParamLayout",
    "derive_seed",
    "flatten_params",
    "load_flat_",
    "weights_digest",
]


@dataclass(frozen=True, slots=True)
class ParamEntry:
    """One parameter tensor's place in the flat vector."""

    name: str
    """Name from ``model.named_parameters()`` (shared/tied parameters appear once)."""
    shape: tuple[int, ...]
    """Shape of the parameter tensor."""
    offset: int
    """Index of its first element in the flat vector."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True, slots=True)
class ParamLayout:
    """Names, shapes and offsets of a model's parameters inside the flat fp32 vector.

    The order is ``model.named_parameters()`` order, which is deterministic for a given model
    class, so the coordinator and every site agree on it without exchanging it. Buffers (e.g.
    batch-norm statistics) are not part of the global weights.
    """

    entries: tuple[ParamEntry, ...]
    numel: int

    @classmethod
    def from_model(cls, model: nn.Module) -> ParamLayout:
        entries = []
        offset = 0
        for name, param in model.named_parameters():
            entries.append(ParamEntry(name=name, shape=tuple(param.shape), offset=offset))
            offset += param.numel()
        return cls(entries=tuple(entries), numel=offset)

    def split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``flat`` per parameter name, with their shapes (no copy)."""
        self._check(flat)
        return {
            e.name: flat[e.offset : e.offset + e.numel].view(e.shape) for e in self.entries
        }

    def flatten(self, model: nn.Module) -> torch.Tensor:
        """A new fp32 vector holding the model's current parameters (checked against the layout)."""
        params = self._params(model)
        return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in params])

    def flatten_grads(self, model: nn.Module) -> torch.Tensor:
        """A new fp32 vector of the parameters' ``.grad`` (zeros where a grad is missing)."""
        parts = []
        for p in self._params(model):
            g = p.grad
            parts.append(
                torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
                if g is None
                else g.detach().reshape(-1).to(torch.float32)
            )
        return torch.cat(parts)

    def load_(self, model: nn.Module, flat: torch.Tensor) -> None:
        """Copy ``flat`` into the model's parameters in place (dtype/device converted)."""
        self._check(flat)
        with torch.no_grad():
            for entry, p in zip(self.entries, self._params(model), strict=True):
                p.copy_(flat[entry.offset : entry.offset + entry.numel].view(entry.shape))

    def state_dict(self, flat: torch.Tensor, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """``flat`` as a normal ``state_dict``: parameter name -> tensor of its shape (views of
        ``flat``, no copy). With ``model`` (of this layout's class), every key of
        ``model.state_dict()``: the parameters from ``flat`` (a tied parameter under each of its
        names), the buffers as ``model`` holds them; ``model`` itself is not changed, and
        ``model.load_state_dict(result, strict=True)`` loads the weights of ``flat``."""
        views = self.split(flat)
        if model is None:
            return views
        list(self._params(model))  # the model must be of this layout
        canonical = {id(p): name for name, p in model.named_parameters()}
        params = {name: canonical[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
        return {
            key: views[params[key]] if key in params else value.detach()
            for key, value in model.state_dict(keep_vars=True).items()
            if isinstance(value, torch.Tensor)  # a module's non-tensor extra state is not a weight
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-able description (for checkpoints and per-tensor manifests)."""
        return {
            "numel": self.numel,
            "entries": [
                {"name": e.name, "shape": list(e.shape), "offset": e.offset} for e in self.entries
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParamLayout:
        entries = tuple(
            ParamEntry(name=e["name"], shape=tuple(e["shape"]), offset=int(e["offset"]))
            for e in data["entries"]
        )
        return cls(entries=entries, numel=int(data["numel"]))

    def tensors(self, model: nn.Module) -> Iterator[tuple[ParamEntry, torch.Tensor]]:
        """Each entry with the model's parameter at its place (checked against the layout):
        for reading the weights piece by piece, without ``flatten``'s model-sized copy."""
        return zip(self.entries, self._params(model), strict=True)

    def _params(self, model: nn.Module) -> Iterator[torch.Tensor]:
        named = list(model.named_parameters())
        if len(named) != len(self.entries):
            raise ValueError(
                f"model has {len(named)} parameter tensors but the layout has "
                f"{len(self.entries)}; build the layout from this model class"
            )
        for entry, (name, p) in zip(self.entries, named, strict=True):
            if name != entry.name or tuple(p.shape) != entry.shape:
                raise ValueError(
                    f"model parameter {name} {tuple(p.shape)} does not match layout entry "
                    f"{entry.name} {entry.shape}; build the layout from this model class"
                )
            yield p

    def _check(self, flat: torch.Tensor) -> None:
        if flat.dim() != 1 or flat.numel() != self.numel:
            raise ValueError(
                f"flat weights have shape {tuple(flat.shape)}; this layout needs a 1-D vector "
                f"of {self.numel} elements"
            )


def flatten_params(model: nn.Module) -> torch.Tensor:
    """The model's parameters as one new flat fp32 vector (``named_parameters()`` order)."""
    return ParamLayout.from_model(model).flatten(model)


def load_flat_(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy the flat vector ``flat`` into the model's parameters in place."""
    ParamLayout.from_model(model).load_(model, flat)


def weights_digest(flat: torch.Tensor) -> str:
    """SHA-256 (hex) over the exact little-endian fp32 bytes of ``flat``.

    Replicas compare digests after each broadcast: equal digests mean bit-identical weights, which
    is what the downlink protocol promises (docs/architecture.md, "One round", step 6).
    """
    if flat.dtype != torch.float32:
        raise ValueError(f"weights_digest expects fp32 weights, got {flat.dtype}")
    data = flat.detach().to("cpu").contiguous().view(torch.uint8).numpy()
    return hashlib.sha256(data.data).hexdigest()  # the buffer itself: no bytes copy


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed derived from ``parts`` (run seed, round, site, purpose).

    Codecs with randomness (random-k, stochastic rounding) need seeds that the coordinator and a
    site can both compute and that differ per round, site and direction; hashing avoids the
    collisions of arithmetic schemes such as ``seed + round * 1000 + site``.
    """
    text = "/".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & ((1 << 63) - 1)
