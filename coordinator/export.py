"""The trained model out of a checkpoint folder, as a normal ``state_dict`` in safetensors.

A coordinator checkpoint holds the global weights as one flat fp32 vector (``weights``) beside
the outer optimizer's state, and the ``ParamLayout`` that maps the vector onto the model's
parameters in its metadata. ``export_model`` writes the global weights of the newest checkpoint
of a folder as a safetensors file keyed by the model's own parameter names, which
``model.load_state_dict(safetensors.torch.load_file(path), strict=True)`` loads into the model
the run trained (and any tool that reads safetensors state dicts, Hugging Face's included):

* with ``model`` (an instance of the run's model class): every key of ``model.state_dict()``,
  the parameters from the checkpoint and the buffers as ``model`` holds them (buffers are not
  global weights: the coordinator's are its model's initial ones);
* without: the parameters only, by the names the layout records.

The checkpoint is verified as a resume verifies it (pointer, SHA-256 of the tensor file, the
weights' digest against the one recorded), so an export is exactly the weights the run's sites
held after the checkpointed round (their ``digest=`` lines show the same digest). ``geoloco
export`` is the command (``geoloco.scenarios.export_cmd``); it builds the run's built-in
workload model from the checkpoint's config for the first form.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from geoloco.algorithms.params import ParamLayout, weights_digest
from geoloco.coordinator.checkpoint import FRESH_HINT, POINTER_NAME, CheckpointError, load_latest_checkpoint
from geoloco.coordinator.phases import WEIGHTS_KEY
from geoloco.protos.atomic_files import atomic_write_safetensors, model_file_metadata

__all__ = ["ExportedModel", "GlobalModel", "export_model", "read_global_model", "write_model"]

REQUIRED_METADATA = ("layout", "weights_digest")
"""What an export needs of a checkpoint's metadata."""


@dataclass(frozen=True, slots=True)
class GlobalModel:
    """The global weights of one checkpoint, with what names and describes them."""

    round: int
    """Rounds trained: the weights are ``θ_round`` (the round the checkpoint resumes at)."""
    weights: torch.Tensor
    """Flat fp32 global weights."""
    layout: ParamLayout
    """Names, shapes and offsets of the parameters in ``weights``."""
    weights_digest: str
    """SHA-256 of ``weights`` (the ``digest=`` of the coordinator's and the sites' lines)."""
    config: dict[str, Any] = field(default_factory=dict)
    """The coordinator's config as the checkpoint records it (``workload``, ``seed``, ...)."""

    @property
    def workload(self) -> dict[str, Any]:
        """The run's ``[workload]`` table (empty for a model of the user's own)."""
        table = self.config.get("workload")
        return dict(table) if isinstance(table, dict) else {}


@dataclass(frozen=True, slots=True)
class ExportedModel:
    """What ``write_model`` wrote."""

    path: Path
    round: int
    weights_digest: str
    tensors: int
    """Entries in the file (parameters, and buffers when a model was given)."""
    parameters: int
    """Elements of the global weights."""


def read_global_model(checkpoint_dir: str | os.PathLike[str]) -> GlobalModel:
    """The verified global weights of the newest checkpoint in ``checkpoint_dir``; raises
    ``CheckpointError`` (one line) when there is none or it cannot be trusted."""
    folder = Path(checkpoint_dir)
    checkpoint = load_latest_checkpoint(folder, required_metadata=REQUIRED_METADATA)
    if checkpoint is None:
        raise CheckpointError(
            f"{folder} holds no checkpoint ({POINTER_NAME}): point at the coordinator's "
            "checkpoint_dir (or one of its previous-run-N folders)"
        )
    metadata = checkpoint.metadata
    try:
        layout = ParamLayout.from_dict(metadata["layout"])
        weights = checkpoint.tensors[WEIGHTS_KEY]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{folder}/{POINTER_NAME} has no usable layout or weights ({type(exc).__name__}: {exc}); "
            "was it written by a geoloco coordinator?"
        ) from exc
    weights = weights.to(torch.float32).reshape(-1)
    if weights.numel() != layout.numel:
        raise CheckpointError(
            f"{checkpoint.path} holds {weights.numel()} weights but its layout describes {layout.numel}"
        )
    digest = weights_digest(weights)
    if digest != metadata["weights_digest"]:
        raise CheckpointError(
            f"{checkpoint.path} holds weights with digest {digest[:16]}... but {POINTER_NAME} records "
            f"{str(metadata['weights_digest'])[:16]}...; restore both from a backup, {FRESH_HINT}"
        )
    config = metadata.get("config")
    return GlobalModel(
        round=checkpoint.round, weights=weights, layout=layout, weights_digest=digest,
        config=dict(config) if isinstance(config, dict) else {},
    )


def write_model(
    path: str | os.PathLike[str], model: GlobalModel, module: nn.Module | None = None
) -> ExportedModel:
    """Write ``model``'s weights to ``path`` (safetensors, atomically) as the module doc says;
    ``module``: an instance of the run's model class, for its full ``state_dict`` (buffers
    included); it is not changed. Raises ``ValueError`` when ``module`` is of another layout."""
    state = model.layout.state_dict(model.weights, module)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_safetensors(target, state, model_file_metadata(model.round, model.weights_digest, model.workload))
    return ExportedModel(
        path=target, round=model.round, weights_digest=model.weights_digest, tensors=len(state),
        parameters=model.layout.numel,
    )


def export_model(
    checkpoint_dir: str | os.PathLike[str], path: str | os.PathLike[str], model: nn.Module | None = None
) -> ExportedModel:
    """Write the global model of ``checkpoint_dir``'s newest checkpoint to ``path``; see the
    module doc. ``model``: an instance of the run's model class (for buffers and strict loading)."""
    return write_model(path, read_global_model(checkpoint_dir), model)
