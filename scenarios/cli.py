"""The ``geoloco`` command: one entry point, one subcommand per job.

Each subcommand lives in its own module exposing ``register(subparsers)``; the module is imported
only to build the parser, and the heavy imports (torch, grpc) happen inside the handler so that
``geoloco --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from geoloco.scenarios.config_file import EXIT_INTERRUPTED

# Subcommand name -> module that registers it. One place to look when adding a command.
SUBCOMMANDS: dict[str, str] = {
    "simulate": "geoloco.scenarios.simulate_cmd",
    "sweep": "geoloco.scenarios.sweep_cmd",
    "certs": "geoloco.scenarios.certs_cmd",
    "coordinator": "geoloco.scenarios.coordinator_cmd",
    "site": "geoloco.scenarios.site_cmd",
    "emulate": "geoloco.scenarios.emulate_cmd",
    "plan": "geoloco.scenarios.plan_cmd",
    "tune": "geoloco.scenarios.tune_cmd",
    "relay": "geoloco.scenarios.relay_cmd",
    "export": "geoloco.scenarios.export_cmd",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="geoloco",
        description=(
            "Low-communication geo-distributed training. Sites run many local steps and exchange "
            "compressed pseudo-gradients with a coordinator (DiLoCo family)."
        ),
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="verbosity of log messages on stderr (default: %(default)s)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in SUBCOMMANDS.values():
        importlib.import_module(module_name).register(subparsers)
    return parser


def quiet_grpc_core(argv: Sequence[str] | None = None) -> None:
    """Keep gRPC's C-core log lines (``I1201 ...``, ``E1201 ... ssl_transport_security.cc``) out
    of the commands' output unless ``--log-level DEBUG``: they interleave with geoloco's own lines,
    which already name what went wrong (the dialling side of a failed handshake names the peer and
    the cause, ``geoloco.protos.transport_tls.diagnose_handshake``; the serving side cannot:
    grpcio 1.85 tells a Python server nothing of a handshake that failed, and the C-core's one
    line names the cause without the peer). It must
    run before grpc is imported (the C-core reads ``GRPC_VERBOSITY`` once); a value the user set
    is kept, and the processes a command starts inherit it."""
    words = list(sys.argv[1:] if argv is None else argv)
    debug = any(
        w == "--log-level=DEBUG" or (w == "--log-level" and words[i + 1 : i + 2] == ["DEBUG"])
        for i, w in enumerate(words)
    )
    if not debug:
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")


def main(argv: Sequence[str] | None = None) -> int:
    quiet_grpc_core(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        logging.getLogger("geoloco").warning("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader of our output left (``geoloco plan ... | head``): stop quietly, as a Unix
        # tool does, and keep the interpreter's own flush at exit from failing once more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
