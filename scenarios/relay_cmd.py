"""``geoloco relay --config FILE``: run a regional relay between a region's sites and the
coordinator (``geoloco.relay``).

The TOML file maps one to one onto ``geoloco.relay.RelayConfig`` (see the shipped
``relay.toml``); flags override its keys. The run's settings (codec, weighting, rounds) come
from the coordinator, so the file only says who the relay is, where the coordinator is and
where the relay listens.

Contract with launchers and tests (stdout, one line each, flushed):

* ``geoloco-relay listening on HOST:PORT`` once the relay accepts its sites' calls;
* ``geoloco-relay round R update in: SITE`` when a site's verified update entered round R's
  partial sum (the site's upload is answered once the coordinator took the partial);
* ``geoloco-relay finished: the run is over and every site left`` when the coordinator's last
  broadcast went out and the relay's sites left (the relay then exits), or ``geoloco-relay
  stopped (SIGTERM)`` when a signal stopped it.

Exit status: 0 when the run finished or a signal stopped it, 2 for a bad config or flag (the
message names the file, the key and what is allowed), 1 for a failure at run time (port in use).
Logs go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from geoloco.scenarios.config_file import (
    EXIT_OK,
    EXIT_RUNTIME_ERROR,
    ConfigFileError,
    from_config_error,
    port_number,
    report_config_error,
)
from geoloco.scenarios.config_kinds import RELAY, read_config

logger = logging.getLogger(__name__)

PROGRAM = "geoloco-relay"
LISTENING_LINE = PROGRAM + " listening on {host}:{port}"
STOPPED_LINE = PROGRAM + " stopped ({signal})"
UPDATE_LINE = PROGRAM + " round {round} update in: {site}"
FINISHED_LINE = PROGRAM + " finished: the run is over and every site left"
EXAMPLE_CONFIG = Path(__file__).parent.parent / "relay" / "relay.toml"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "relay",
        help="run a regional relay: the region's sites talk to it, it talks to the coordinator",
        description=(
            "Run a regional relay. Sites connect to it exactly as to the coordinator (same "
            "protocol, mutual TLS); per round it verifies their uploads, sends one weighted "
            "partial sum upward and serves the round's broadcast to its sites. Its certificate "
            "comes from `geoloco certs issue DIR NAME --relay`, and the coordinator's [relays] "
            f"table must list its sites. Example config: {EXAMPLE_CONFIG}. SIGTERM or SIGINT "
            "stops it. Prints 'geoloco-relay listening on HOST:PORT' on stdout once it serves."
        ),
    )
    parser.add_argument("--config", type=Path, required=True, metavar="FILE", help="TOML config file")
    parser.add_argument("--name", help="the relay's name, overrides `name`")
    parser.add_argument("--coordinator", metavar="HOST:PORT", help="the coordinator's address, overrides `coordinator`")
    parser.add_argument("--host", help="address to listen on, overrides `host`")
    parser.add_argument("--port", type=port_number, help="port for the sites, overrides `port` (0: a free one)")
    parser.add_argument(
        "--certs", type=Path, metavar="DIR", help="folder made by `geoloco certs`, overrides `certs_dir`"
    )
    parser.add_argument(
        "--metrics", type=Path, metavar="FILE", help="JSON-lines metrics file, overrides `metrics_path`"
    )
    parser.add_argument(
        "--insecure", action="store_true", help="plain-text gRPC on both sides (local experiments only)"
    )
    parser.set_defaults(handler=run)


def load_config(args: argparse.Namespace) -> Any:
    """The file with the flags applied, as a ``RelayConfig``; ``ConfigFileError`` if bad."""
    from geoloco.algorithms.config import ConfigError
    from geoloco.relay import RelayConfig

    raw = read_config(args.config, (RELAY,))[0]
    source = str(args.config)
    for flag, key in (("name", "name"), ("coordinator", "coordinator"), ("host", "host"), ("port", "port")):
        value = getattr(args, flag)
        if value is not None:
            raw[key] = value
    if args.certs is not None:
        raw["certs_dir"] = str(args.certs)
        raw.pop("insecure", None)
    if args.metrics is not None:
        raw["metrics_path"] = str(args.metrics)
    if args.insecure:
        raw["insecure"] = True
        raw.pop("certs_dir", None)
    elif raw.get("insecure"):
        raise ConfigFileError(
            source, "insecure", "plain text needs the --insecure flag too (a file alone cannot turn TLS off)"
        )
    try:
        return RelayConfig.from_dict(raw)
    except ConfigError as err:
        raise from_config_error(source, err) from None


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args)
    except ConfigFileError as err:
        return report_config_error("relay", err)
    from geoloco.relay import RelayServer
    from geoloco.scenarios.coordinator_cmd import GracefulStop, say

    stop = GracefulStop().install()
    server = RelayServer(config, on_update=lambda number, site: say(UPDATE_LINE.format(round=number, site=site)))
    try:
        try:
            port = server.start()
        except OSError as err:
            print(f"geoloco relay: error: {err}", file=sys.stderr)
            return EXIT_RUNTIME_ERROR
        say(LISTENING_LINE.format(host=config.host, port=port))
        while not stop.requested.wait(0.5):
            if server.hub.done:
                say(FINISHED_LINE)
                return EXIT_OK
        say(STOPPED_LINE.format(signal=stop.signal_name))
        return EXIT_OK
    finally:
        server.stop()
        stop.restore()
