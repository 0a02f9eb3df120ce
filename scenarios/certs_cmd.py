"""``geoloco certs``: make the CA and the certificates for mutual TLS.

    geoloco certs init DIR [--force]
    geoloco certs issue DIR NAME [--coordinator | --relay] [--host H ...] [--force]

``init`` creates ``DIR/ca.crt`` and ``DIR/ca.key``; ``issue`` signs ``DIR/NAME.crt`` and
``DIR/NAME.key`` with it: a site certificate (the name is the site's identity), or with
``--coordinator`` the coordinator's server certificate (valid for localhost and 127.0.0.1 plus
every ``--host``). See ``geoloco.scenarios.certs``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from geoloco.scenarios.config_file import COMMAND_LINE, ConfigFileError, report_config_error


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "certs",
        help="create the certificate authority and TLS certificates for a multi-site run",
        description="Create the certificate authority and the TLS certificates for mutual TLS "
        "between the coordinator and its sites.",
    )
    sub = parser.add_subparsers(dest="certs_command", metavar="ACTION", required=True)

    init = sub.add_parser("init", help="create a certificate authority (DIR/ca.crt, DIR/ca.key)")
    init.add_argument("directory", type=Path, metavar="DIR", help="where to write the CA files")
    init.add_argument(
        "--force",
        action="store_true",
        help="replace an existing CA (every certificate it signed stops being accepted)",
    )
    init.add_argument("--days", type=int, default=None, help="validity in days (default: 3650)")
    init.set_defaults(handler=_init)

    issue = sub.add_parser(
        "issue", help="issue DIR/NAME.crt and DIR/NAME.key for a site (or the coordinator)"
    )
    issue.add_argument("directory", type=Path, metavar="DIR", help="directory holding the CA")
    issue.add_argument(
        "name",
        metavar="NAME",
        help="site name (letters, digits, '.', '_', '-'), or the coordinator's file name",
    )
    issue.add_argument(
        "--coordinator",
        action="store_true",
        help="issue the coordinator's server certificate instead of a site certificate",
    )
    issue.add_argument(
        "--relay",
        action="store_true",
        help="issue a regional relay's certificate (server for its sites, client to the "
        "coordinator, URI geoloco:relay:NAME); list NAME under [relays] in the coordinator's config",
    )
    issue.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="HOST",
        help="with --coordinator or --relay: another DNS name or IP address sites dial (repeatable; "
        "localhost and 127.0.0.1 are always included)",
    )
    issue.add_argument("--force", action="store_true", help="replace existing NAME files")
    issue.add_argument("--days", type=int, default=None, help="validity in days (default: 825)")
    issue.set_defaults(handler=_issue)


def _init(args: argparse.Namespace) -> int:
    from geoloco.scenarios import certs

    kwargs = {} if args.days is None else {"valid_days": args.days}
    try:
        pair = certs.init_ca(args.directory, force=args.force, **kwargs)
    except (FileExistsError, ValueError) as e:
        return report_config_error("certs init", ConfigFileError(str(args.directory), "", str(e)))
    print(f"CA certificate: {pair.cert}")
    print(f"CA key:         {pair.key} (keep it private)")
    return 0


def _issue(args: argparse.Namespace) -> int:
    from geoloco.scenarios import certs

    kwargs = {} if args.days is None else {"valid_days": args.days}
    try:
        if args.coordinator and args.relay:
            return report_config_error(
                "certs issue", ConfigFileError(COMMAND_LINE, "--relay", "choose --coordinator or --relay, not both")
            )
        if args.relay:
            pair = certs.issue_relay(args.directory, args.name, hosts=args.host, force=args.force, **kwargs)
        elif args.coordinator:
            pair = certs.issue_coordinator(
                args.directory, args.name, hosts=args.host, force=args.force, **kwargs
            )
        else:
            if args.host:
                return report_config_error(
                    "certs issue", ConfigFileError(COMMAND_LINE, "--host", "only applies with --coordinator or --relay")
                )
            pair = certs.issue_site(args.directory, args.name, force=args.force, **kwargs)
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        return report_config_error("certs issue", ConfigFileError(str(args.directory), "", str(e)))
    print(f"certificate: {pair.cert}  ({certs.describe(pair.cert)})")
    print(f"key:         {pair.key}")
    return 0
