"""``geoloco export CHECKPOINT_DIR --out FILE``: the trained model out of a coordinator's checkpoints.

Writes the global weights of the newest checkpoint in ``CHECKPOINT_DIR`` (the coordinator's
``checkpoint_dir``, or one of its ``previous-run-N`` folders) as a normal ``state_dict`` in a
safetensors file, keyed by the model's parameter names (``geoloco.coordinator.export``):

* a run of a built-in workload (its ``[workload]`` table is in the checkpoint's config): the
  workload's model is built with the run's seed and the file holds every key of its
  ``state_dict()`` (parameters from the checkpoint, buffers as the model builds them), so
  ``model.load_state_dict(load_file(FILE), strict=True)`` loads it;
* a run of the user's own model (started from Python), or ``--parameters-only``: the parameters
  by the names the checkpoint's layout records (buffers are not in a checkpoint).

Prints ``geoloco-export wrote FILE: round=R tensors=N parameters=P digest=D`` (the digest is
the one the coordinator's and the sites' round lines print). Exit status: 0 written, 1 when the
checkpoint cannot be read or trusted, 2 for a bad flag or a workload table this geoloco cannot
build.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from geoloco.scenarios.config_file import (
    COMMAND_LINE,
    EXIT_OK,
    EXIT_RUNTIME_ERROR,
    ConfigFileError,
    from_config_error,
    report_config_error,
)

logger = logging.getLogger(__name__)

PROGRAM = "geoloco-export"
WROTE_LINE = PROGRAM + " wrote {path}: round={round} tensors={tensors} parameters={parameters} digest={digest}"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write the trained global model of a checkpoint folder as a safetensors state_dict",
        description=(
            "Write the global weights of the newest checkpoint in CHECKPOINT_DIR (a coordinator's "
            "checkpoint_dir, or a previous-run-N folder in it) as a normal state_dict in a "
            "safetensors file, keyed by the model's parameter names. For a built-in workload the "
            "file holds its model's whole state_dict (load it with "
            "model.load_state_dict(safetensors.torch.load_file(FILE), strict=True)); for a model "
            "of your own, the parameters by name. The checkpoint is verified first (checksums, "
            "the weights' digest). Safe while the coordinator runs."
        ),
    )
    parser.add_argument(
        "checkpoint_dir", type=Path, metavar="CHECKPOINT_DIR", help="the coordinator's checkpoint folder"
    )
    parser.add_argument(
        "--out", type=Path, required=True, metavar="FILE", help="the safetensors file to write (replaced atomically)"
    )
    parser.add_argument(
        "--parameters-only",
        action="store_true",
        help="write the parameters by their layout names without building the workload's model "
        "(no buffers)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ConfigFileError as err:
        return report_config_error("export", err)


def _run(args: argparse.Namespace) -> int:
    from geoloco.algorithms.config import ConfigError
    from geoloco.coordinator.checkpoint import CheckpointError
    from geoloco.coordinator.export import read_global_model, write_model
    from geoloco.scenarios.workloads import parse_workload

    if args.out.is_dir():
        raise ConfigFileError(COMMAND_LINE, "--out", f"{args.out} is a folder; name the file to write")
    try:
        model = read_global_model(args.checkpoint_dir)
    except CheckpointError as err:
        print(f"geoloco export: error: {err}", file=sys.stderr)
        return EXIT_RUNTIME_ERROR
    module = None
    table = model.workload
    source = f"{args.checkpoint_dir} (the checkpoint's config)"
    if table and not args.parameters_only:
        try:
            spec = parse_workload(table)
        except ConfigError as err:
            raise from_config_error(source, err, prefix="workload") from None
        seed = int(model.config.get("seed", 0))
        module = spec.build().build_model(seed)
    elif not args.parameters_only:
        logger.warning(
            "the checkpoint's config names no built-in workload (a model of your own): writing its "
            "parameters by name; buffers are not in a checkpoint (load with strict=False, or use "
            "geoloco.coordinator.export.export_model(..., model=your_model) for a full state_dict)"
        )
    try:
        exported = write_model(args.out, model, module)
    except ValueError as err:  # the workload's model is not the one the run trained
        raise ConfigFileError(source, "workload", str(err)) from None
    except OSError as err:
        print(f"geoloco export: error: cannot write {args.out}: {err}", file=sys.stderr)
        return EXIT_RUNTIME_ERROR
    print(
        WROTE_LINE.format(
            path=exported.path, round=exported.round, tensors=exported.tensors,
            parameters=exported.parameters, digest=exported.weights_digest,
        ),
        flush=True,
    )
    return EXIT_OK
