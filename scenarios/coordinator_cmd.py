"""``geoloco coordinator --config FILE``: run the coordinator of a multi-site run as a process.

The TOML file maps one to one onto ``geoloco.coordinator.CoordinatorConfig`` (top-level keys plus
``[algorithm]``, ``[outer_optimizer]`` and ``[inner_optimizer]`` tables); its ``[workload]`` table
names the built-in workload (``name``, default ``gpt``; read by ``parse_workload`` like every
command's) and its options. The coordinator builds that workload's
model with the run's ``seed`` for the initial weights and evaluates the global weights with the
workload's ``eval_loss``; the table is also sent to the sites (``RunConfig.config_json``), so
``geoloco site`` builds the same model without being told. See the shipped ``coordinator.toml``
for every key with a comment.

Contract with launchers and tests (stdout, one line each, flushed):

* ``geoloco-coordinator starting at round R (...)`` once the checkpoint (if any) is loaded and
  the ports are bound;
* ``geoloco-coordinator status page on URL`` (unless ``[http] enabled = false``), just before
  the listening line: ``/metrics`` for Prometheus and the live status page;
* ``geoloco-coordinator listening on HOST:PORT`` once the server accepts calls (``--port 0``
  binds a free port and this line says which);
* ``geoloco-coordinator round R done: participants=a,b excluded=c eval_loss=X digest=D`` per round;
* with ``[privacy]`` on, right after it: ``geoloco-coordinator round R privacy: secure=yes|no
  survivors=a,b dropped_after_upload=c epsilon=E delta=D`` (``epsilon=-`` without DP; a round whose
  secure aggregation aborted says ``aborted=REASON`` instead of the survivors);
* ``geoloco-coordinator round R upload complete: SITE`` when a site's upload for round R is
  complete (the emulator's ``after_upload`` faults wait for it);
* at the end, with DP: ``geoloco-coordinator privacy summary: epsilon=E delta=D rounds=N``;
* ``geoloco-coordinator finished: round=R digest=D`` or ``geoloco-coordinator stopped (SIGTERM):
  round=R digest=D`` at the end.

Exit status: 0 when the run finished or a signal stopped it gracefully, 2 for a bad config or
flag (the message names the file, the key and what is allowed; never a traceback), 1 for a
failure at run time (corrupt checkpoint, port in use, another coordinator holding the checkpoint
folder). Logs go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from geoloco.scenarios.config_file import (
    COMMAND_LINE,
    EXIT_OK,
    EXIT_RUNTIME_ERROR,
    ConfigFileError,
    from_config_error,
    port_number,
    report_config_error,
)
from geoloco.scenarios.config_kinds import COORDINATOR, read_config
from geoloco.scenarios.overrides import add_set_argument, apply_overrides
from geoloco.scenarios.research import require_tensorboard

if TYPE_CHECKING:
    from geoloco.algorithms.record import RoundRecord

logger = logging.getLogger(__name__)

PROGRAM = "geoloco-coordinator"
"""Prefix of every machine-readable stdout line."""
LISTENING_LINE = PROGRAM + " listening on {host}:{port}"
STATUS_PAGE_LINE = PROGRAM + " status page on {url}"
STARTING_LINE = PROGRAM + " starting at round {round} ({how})"
FINISHED_LINE = PROGRAM + " finished: round={round} digest={digest}"
STOPPED_LINE = PROGRAM + " stopped ({signal}): round={round} digest={digest}"

STOP_GRACE_S = 5.0
"""On SIGTERM/SIGINT running calls get this long to finish before they are cancelled (the
same value as ``geoloco.protos.transport_options.SHUTDOWN_GRACE_S``; an upload cut off here resumes
after a restart). A round being aggregated is completed and checkpointed first."""

EXAMPLE_CONFIG = Path(__file__).with_name("coordinator.toml")


class GracefulStop:
    """SIGTERM/SIGINT -> ``requested`` is set (and ``on_stop`` runs in a helper thread); a second
    signal exits at once (checkpoints are written atomically, so even that loses nothing)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, on_stop: Any = None) -> None:
        self.requested = threading.Event()
        self.signal_name: str | None = None
        self.on_stop = on_stop
        self._previous: dict[int, Any] = {}

    def install(self) -> GracefulStop:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested.is_set():
            os.write(2, f"{name} again: exiting at once\n".encode())
            os._exit(128 + signum)
        self.signal_name = name
        self.requested.set()
        if self.on_stop is not None:
            # Not in the handler itself: it interrupts the main thread at an arbitrary point,
            # possibly while that thread holds a lock the callback needs.
            threading.Thread(target=self.on_stop, name="geoloco-stop", daemon=True).start()


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "coordinator",
        help="run the coordinator of a multi-site run (one per run)",
        description=(
            "Run the coordinator: sites join over gRPC (mutual TLS), upload compressed "
            "pseudo-gradients, and receive the new global weights each round. The TOML config "
            "maps one to one onto CoordinatorConfig plus a [workload] table naming the built-in "
            "workload whose model gives the initial weights and whose eval_loss scores them. "
            f"Example with every key documented: {EXAMPLE_CONFIG}. "
            "Restarting with the same command (and the same port) resumes from checkpoint_dir; "
            "connected sites reconnect by themselves. "
            "The process first re-executes itself once with GLIBC_TUNABLES malloc settings that "
            "keep chunk buffers warm (set GEOLOCO_NO_MALLOC_REEXEC=1 to skip). "
            f"SIGTERM or SIGINT stops it gracefully: running calls get {STOP_GRACE_S:g} s; a second "
            "signal exits at once. Prints 'geoloco-coordinator listening on HOST:PORT' on stdout "
            "once it serves (useful with --port 0)."
        ),
    )
    parser.add_argument("--config", type=Path, required=True, metavar="FILE", help="TOML config file")
    add_set_argument(parser, examples="algorithm.inner_steps=50, run.min_sites=3, update_guard.norm_factor=10")
    parser.add_argument("--host", help="address to listen on, overrides `host` (0.0.0.0: every interface)")
    parser.add_argument("--port", type=port_number, help="port to listen on, overrides `port` (0: a free one)")
    parser.add_argument(
        "--http-port",
        type=port_number,
        help="port of /metrics and the status page, overrides `http.port` (0: a free one; on by "
        "default at 9470, loopback only unless `http.host` says otherwise)",
    )
    parser.add_argument(
        "--certs",
        type=Path,
        metavar="DIR",
        help="folder made by `geoloco certs` (ca.crt, coordinator.crt/.key), overrides `certs_dir`",
    )
    parser.add_argument(
        "--cert-name", help="file name of the coordinator's certificate in DIR, overrides `cert_name`"
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="plain-text gRPC without authentication (local experiments only; prints a warning); "
        "required for plain text even when the file says insecure = true",
    )
    parser.add_argument(
        "--metrics", type=Path, metavar="FILE", help="JSON-lines metrics file, overrides `metrics_path`"
    )
    parser.add_argument(
        "--tensorboard", type=Path, metavar="DIR",
        help="also write each round's scalars as TensorBoard events into DIR (needs --metrics or "
        "`metrics_path`, and `pip install 'geoloco[tensorboard]'`), overrides `tensorboard_dir`",
    )
    parser.add_argument(
        "--checkpoint-dir", type=Path, metavar="DIR", help="checkpoint folder, overrides `checkpoint_dir`"
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="start a new run at round 0 even when checkpoint_dir holds a previous run (its "
        "checkpoints and metrics file move into checkpoint_dir/previous-run-N once the port is "
        "bound); sets `resume = false`. Without it the coordinator resumes, and refuses to start "
        "beside files it cannot resume. Refused while another coordinator holds checkpoint_dir",
    )
    parser.set_defaults(handler=run)


def _apply_flags(raw: dict[str, Any], args: argparse.Namespace, source: str) -> None:
    """Fold the command-line overrides into the raw config (flags win over the file)."""
    if raw.get("insecure") is True and not args.insecure:
        raise ConfigFileError(
            source,
            "insecure",
            "plain-text mode must also be asked for on the command line: add --insecure, or "
            "set certs_dir (made by `geoloco certs`) for mutual TLS",
        )
    if args.insecure and args.certs is not None:
        raise ConfigFileError(COMMAND_LINE, "--insecure", "cannot be combined with --certs; drop one")
    if args.insecure:
        raw["insecure"] = True
        raw.pop("certs_dir", None)  # the command line asked for plain text explicitly
    if args.certs is not None:
        raw["certs_dir"] = str(args.certs)
        raw["insecure"] = False
    http = raw.setdefault("http", {})
    if isinstance(http, dict):  # anything else is reported by CoordinatorConfig.from_dict
        http.setdefault("enabled", True)  # the library's default is off; the command's is on
        if getattr(args, "http_port", None) is not None:
            http["port"] = args.http_port
    if getattr(args, "fresh", False):
        raw["resume"] = False
    for flag, key in (
        ("host", "host"),
        ("port", "port"),
        ("cert_name", "cert_name"),
        ("metrics", "metrics_path"),
        ("tensorboard", "tensorboard_dir"),
        ("checkpoint_dir", "checkpoint_dir"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            raw[key] = str(value) if isinstance(value, Path) else value


def load_config(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(CoordinatorConfig, WorkloadSpec)`` from ``--config`` and the flags."""
    from geoloco.coordinator.config import CoordinatorConfig

    source = str(args.config)
    raw = read_config(args.config, (COORDINATOR,))[0]
    apply_overrides(raw, getattr(args, "overrides", []), source, CoordinatorConfig)
    _apply_flags(raw, args, source)
    config, workload = parse_config(raw, source)
    if config.tensorboard_dir is not None:
        require_tensorboard(source, "tensorboard_dir")
    return config, workload


def parse_config(raw: dict[str, Any], source: str) -> tuple[Any, Any]:
    """``(CoordinatorConfig, WorkloadSpec)`` from a parsed file (changed in place: its
    ``[workload]`` table gets the defaults named), without the flags; ``geoloco plan`` reads a
    coordinator file through it."""
    from geoloco.algorithms.config import ConfigError
    from geoloco.coordinator.config import CoordinatorConfig
    from geoloco.scenarios.workloads import WORKLOAD_TABLE, parse_workload

    try:
        workload = parse_workload(raw.get(WORKLOAD_TABLE))
        # The table as parsed (defaults named) goes to the sites with the rest of the config.
        raw[WORKLOAD_TABLE] = workload.to_table()
        return CoordinatorConfig.from_dict(raw), workload
    except ConfigError as err:
        raise from_config_error(source, err) from None


def run(args: argparse.Namespace) -> int:
    # First, before any thread or gRPC starts: glibc reads GLIBC_TUNABLES only at process start.
    from geoloco.protos.transport_malloc import reexec_with_malloc_tunables

    reexec_with_malloc_tunables()
    try:
        return _run(args)
    except ConfigFileError as err:
        return report_config_error("coordinator", err)


_STDOUT_LOCK = threading.Lock()


def say(line: str) -> None:
    """Print one whole line from any thread: ``print`` writes the text and the newline in two
    calls, so lines printed by the round driver and by an upload's thread could run together
    (and a line-matching reader, such as the emulator or a test, would miss both)."""
    with _STDOUT_LOCK:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _round_line(record: Mapping[str, Any]) -> str:
    loss = record.get("eval_loss")
    return (
        f"{PROGRAM} round {record['round']} done: "
        f"participants={','.join(record['participants']) or '-'} "
        f"excluded={','.join(record['excluded']) or '-'} "
        f"eval_loss={'-' if loss is None else f'{loss:.6g}'} "
        f"digest={record['weights_digest']}"
    )


def _privacy_line(record: Mapping[str, Any]) -> str:
    privacy = record["privacy"]
    eps = record.get("epsilon")
    if privacy.get("aborted"):
        outcome = f"aborted={privacy['aborted'].replace(' ', '_')}"
    elif privacy.get("secure_aggregation"):
        outcome = (
            f"survivors={','.join(privacy['survivors']) or '-'} "
            f"dropped_after_upload={','.join(privacy['dropped_after_upload']) or '-'}"
        )
    else:
        outcome = f"participants={','.join(record['participants']) or '-'}"
    return (
        f"{PROGRAM} round {record['round']} privacy: "
        f"secure={'yes' if privacy.get('secure_aggregation') else 'no'} {outcome} "
        f"epsilon={'-' if eps is None else f'{eps:.6g}'} "
        f"delta={'-' if record.get('privacy_delta') is None else record['privacy_delta']}"
    )


def privacy_summary_line(record: Mapping[str, Any]) -> str:
    """The run's closing privacy line (machine-readable ``key=value`` fields first), flagged when
    epsilon is too large to mean anything, so a demonstration is never read as a guarantee."""
    from geoloco.algorithms.privacy.dp_accountant import MEANINGFUL_EPSILON

    eps = record["epsilon"]
    line = (
        f"{PROGRAM} privacy summary: epsilon={eps:.6g} "
        f"delta={record['privacy_delta']:g} rounds={record['round'] + 1}"
    )
    if eps > MEANINGFUL_EPSILON:
        line += f" (no meaningful privacy: epsilon > {MEANINGFUL_EPSILON:g})"
    return line


def _bind_error(config: Any, err: BaseException) -> str:
    """One line for a start that could not bind: which port (gRPC or the status page's)."""
    from geoloco.coordinator.http_status import StatusPortError

    if isinstance(err, StatusPortError):
        return f"{err} (on the command line: --http-port)"
    moved = " (nothing was moved: the previous run's files are where they were)" if not config.resume else ""
    return (
        f"cannot listen on {config.host}:{config.port}: {err}; is another coordinator using that "
        f"port?{moved}"
    )


def _run(args: argparse.Namespace) -> int:
    config, workload = load_config(args)
    stop = GracefulStop().install()
    try:
        return _serve(config, workload, str(args.config), stop)
    finally:
        stop.restore()


def _serve(config: Any, spec: Any, source: str, stop: GracefulStop) -> int:
    from geoloco.algorithms.params import ParamLayout
    from geoloco.coordinator import events as ev
    from geoloco.coordinator.checkpoint import CheckpointError
    from geoloco.coordinator.server import CoordinatorServer

    if config.insecure:
        print(
            "geoloco coordinator: WARNING: --insecure: plain-text gRPC without authentication; "
            "anyone who reaches the port can join as any site. Use only on a trusted local "
            "network; use `geoloco certs` and --certs otherwise.",
            file=sys.stderr,
            flush=True,
        )
    workload = spec.build()
    model = workload.build_model(config.seed)
    layout = ParamLayout.from_model(model)

    def eval_fn(flat: Any) -> float:
        # The model gave the initial weights; from then on it only holds what is evaluated (one
        # copy of the weights, not two).
        layout.load_(model, flat)
        return float(workload.eval_loss(model))

    last_privacy: dict[str, Any] = {}

    def on_round_end(record: RoundRecord) -> None:
        data = record.to_dict()
        say(_round_line(data))
        if record.privacy is not None:
            last_privacy.update(data)
            say(_privacy_line(data))

    def on_event(event: Any) -> None:
        if event.kind == ev.UPDATE_AGGREGATED:
            say(f"{PROGRAM} round {event.round} upload complete: {event.site}")

    try:
        server = CoordinatorServer(
            config, layout.flatten(model), layout, eval_fn, on_round_end=on_round_end
        )
    except CheckpointError as err:
        print(f"geoloco coordinator: error: {err}", file=sys.stderr)
        return EXIT_RUNTIME_ERROR
    except ValueError as err:  # checkpoint of another model, CUDA unavailable, ...
        raise ConfigFileError(source, "", str(err)) from None
    rounds = server.rounds
    rounds.events.add_listener(on_event)
    try:
        port = server.start()
    except FileNotFoundError as err:  # TLS files
        server.stop(grace=0)
        raise ConfigFileError(source, "certs_dir", str(err)) from None
    except (OSError, RuntimeError) as err:
        server.stop(grace=0)
        print(f"geoloco coordinator: error: {_bind_error(config, err)}", file=sys.stderr)
        return EXIT_RUNTIME_ERROR
    if rounds.round > 0 and config.checkpoint_dir is not None:
        how = f"resumed from checkpoint in {config.checkpoint_dir}"
    elif server.previous_run is not None:
        how = f"new run; the previous run's files are in {server.previous_run}"
    else:
        how = "new run"
    say(STARTING_LINE.format(round=rounds.round, how=how))
    if server.status_url is not None:
        say(STATUS_PAGE_LINE.format(url=server.status_url))
    say(LISTENING_LINE.format(host=config.host, port=port))
    try:
        while not stop.requested.is_set():
            if server.wait_until_finished(timeout=0.5):
                break
    except RuntimeError as err:  # the round driver failed; its traceback is in the log
        print(f"geoloco coordinator: error: {err}: {err.__cause__}", file=sys.stderr)
        return EXIT_RUNTIME_ERROR
    finally:
        if stop.requested.is_set():
            logger.info("%s received: stopping (grace %.0f s)", stop.signal_name, STOP_GRACE_S)
        server.stop(grace=STOP_GRACE_S)
    if stop.requested.is_set() and not rounds.finished:
        print(
            STOPPED_LINE.format(signal=stop.signal_name, round=rounds.round, digest=rounds.digest_hex),
            flush=True,
        )
    else:
        say(FINISHED_LINE.format(round=rounds.round, digest=rounds.digest_hex))
    if last_privacy.get("epsilon") is not None:
        print(privacy_summary_line(last_privacy), flush=True)
    return EXIT_OK
