"""``geoloco site``: one site of a multi-site run, training a built-in workload.

The site trains through the same ``SiteAgent`` API a user's own training uses: the model comes
from the workload's ``build_model(seed)`` (its weights are then replaced by the coordinator's),
the inner optimizer from the coordinator's ``[inner_optimizer]`` table, and the data from
``site_batches(site_index, num_sites, seed)``.

What the site needs to know about the run it learns from the coordinator before building
anything: rank 0 joins once (the "probe"), reads ``RunConfig.config_json`` (the coordinator's
whole ``CoordinatorConfig``: workload, inner optimizer, seed, quorum, allowed sites), and hands it
to the other ranks; the agent's own Join that follows is a re-join of the same member. Flags
override what the coordinator advertises (``--workload``, ``--workload-option``, ``--seed``,
``--inner-lr``).

Data shard. ``site_batches`` wants an index in ``0..num_sites-1``. Default: the site's position
in the coordinator's ``allowed_sites`` (and ``num_sites`` = its length); without that list, a site
named with a number ("3") takes that number and ``num_sites`` = the coordinator's ``min_sites``.
``--site-index`` / ``--num-sites`` set them explicitly. Sites named "0".."N-1" with
``min_sites = N`` read exactly the streams ``geoloco simulate`` gives its sites.

Secure aggregation's threshold is the one run setting a site does not take on the
coordinator's word: a round whose threshold breaks ``2 t > holders + C`` is refused, with ``C``
from ``--colluding-sites`` (default 1) whatever ``colluding_sites`` the coordinator declares, and
below ``--min-threshold`` when given (``geoloco.algorithms.privacy.secagg_crypto.ThresholdPolicy``).

``--state-dir DIR`` saves the site's state at every round boundary and resumes from it when the
same command runs again after a crash (``geoloco.site_agent.persist``).

Multi-GPU sites run under ``torchrun`` (``torchrun --nproc_per_node=G -m geoloco.scenarios.cli
site ...``): every rank trains with DDP, only rank 0 talks to the coordinator. With
``--sharding fsdp`` the ranks shard the model with FSDP2 instead and every rank uploads its own
shard (``geoloco.scenarios.sharded_site_cmd``).

Contract with launchers and tests (stdout of rank 0, one line each, flushed):

* ``geoloco-site NAME joined session S at round R`` after every (re-)join;
* ``geoloco-site NAME round R training`` when it starts the inner steps of a round;
* ``geoloco-site NAME round R: loss=X included=yes|no contributors=N next_round=R' digest=D``
  after every round it trained;
* with ``--save-final FILE``, just before the last line: ``geoloco-site NAME saved the global
  model of round R to FILE (digest D)``;
* ``geoloco-site NAME finished: ...`` / ``geoloco-site NAME stopped (SIGTERM): ...`` at the end,
  with ``final_round``, ``rounds_trained``, ``rounds_included``, ``digest``.

Exit status: 0 when the run finished, ``--max-rounds`` were trained or a signal stopped the site;
2 for bad flags or a run this site cannot take part in (unknown workload, no data shard); 1 when
the coordinator refused the site or stayed unreachable for ``--give-up-after`` seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geoloco.scenarios.config_file import (
    COMMAND_LINE,
    EXIT_OK,
    EXIT_RUNTIME_ERROR,
    ConfigFileError,
    from_config_error,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
    report_config_error,
)
from geoloco.scenarios.coordinator_cmd import GracefulStop
from geoloco.scenarios.overrides import parse_value
from geoloco.scenarios.sharded_site_cmd import add_sharding_arguments, check_sharding_flags, run_sharded
from geoloco.scenarios.site_lines import ADVERTISED, PROGRAM, join_line, round_line, saved_line, summary_line
from geoloco.site_agent.client_streams import parse_parallel_streams

if TYPE_CHECKING:  # the workloads import torch; `geoloco --help` stays fast without it
    from geoloco.scenarios.workloads import WorkloadSpec
    from geoloco.site_agent.config import SiteAgentConfig

logger = logging.getLogger(__name__)

DEFAULT_GIVE_UP_S = 300.0
DEFAULT_BACKOFF_MAX_S = 10.0


SiteCommandError = ConfigFileError
"""A flag or run setting this site cannot work with: ``SiteCommandError(source, key, message)``,
the same class (and exit status 2) as every other command's config errors."""


@dataclass(frozen=True, slots=True)
class SitePlan:
    """What this site trains, resolved from the coordinator's config and the flags."""

    workload: WorkloadSpec
    seed: int
    site_index: int
    num_sites: int
    inner_optimizer: dict[str, Any]


def _parallel_streams(text: str) -> int | str:
    """``--parallel-streams``: 'auto' or 1..32, refused by argparse with the allowed values."""
    try:
        return parse_parallel_streams(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _threshold(text: str) -> int:
    """``--min-threshold``: an integer >= 2 (a Shamir threshold of 1 is no secret sharing)."""
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2, got {value}")
    return value


def _option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE read as a TOML value (``64``, ``1e-3``, ``true``, ``"x"``) or,
    failing that, as a bare string (``size=small``)."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, parse_value(value.strip())


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "site",
        help="run one site of a multi-site run (one per data center; torchrun for several GPUs)",
        description=(
            "Join a coordinator and train a built-in workload as one site: H local steps per "
            "round, upload the compressed pseudo-gradient, apply the broadcast. The workload, "
            "the inner optimizer and the seed come from the coordinator's config unless flags "
            "override them. Survives coordinator restarts (reconnects with backoff and jitter). "
            "Under torchrun every rank trains with DDP and only rank 0 talks to the coordinator "
            "(--sharding none), or the ranks shard the model with FSDP2 and each uploads its own "
            "shard (--sharding fsdp). "
            "The process first re-executes itself once with GLIBC_TUNABLES malloc settings that "
            "keep chunk buffers warm (set GEOLOCO_NO_MALLOC_REEXEC=1 to skip). SIGTERM or SIGINT "
            "leaves the run gracefully (a second signal exits at once)."
        ),
    )
    parser.add_argument("--coordinator", required=True, metavar="HOST:PORT", help="the coordinator's address")
    parser.add_argument(
        "--name", required=True, help="this site's name (with TLS: the name its certificate was issued for)"
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--certs",
        type=Path,
        metavar="DIR",
        help="folder made by `geoloco certs` (ca.crt, NAME.crt, NAME.key)",
    )
    mode.add_argument(
        "--insecure",
        action="store_true",
        help="plain-text gRPC without authentication (local experiments only; prints a warning)",
    )
    parser.add_argument(
        "--server-name",
        help="name to check the coordinator's certificate against when HOST is not in it",
    )
    parser.add_argument(
        "--workload", help="built-in workload (gpt, mlp); default: the one the coordinator names"
    )
    parser.add_argument(
        "--workload-option",
        type=_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="workload option (repeatable), on top of the coordinator's [workload] options",
    )
    parser.add_argument(
        "--seed", type=int, help="model and data seed (default: the coordinator's run seed)"
    )
    parser.add_argument(
        "--site-index",
        type=non_negative_int,
        help="this site's data shard (default: its position in the coordinator's allowed_sites, "
        "or its name when that is a number)",
    )
    parser.add_argument(
        "--num-sites",
        type=positive_int,
        help="number of data shards (default: len(allowed_sites), else the coordinator's min_sites)",
    )
    parser.add_argument(
        "--inner-lr", type=positive_float, help="inner learning rate (default: the coordinator's)"
    )
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where to train (default: %(default)s = CUDA when available; under torchrun "
        "cuda:LOCAL_RANK)",
    )
    parser.add_argument(
        "--bf16", action="store_true", help="forward passes under bf16 autocast (weights stay fp32)"
    )
    parser.add_argument(
        "--max-rounds", type=positive_int, help="leave after training this many rounds"
    )
    parser.add_argument(
        "--speed-factor",
        type=positive_float,
        default=1.0,
        metavar="F",
        help="emulate slower hardware: each inner step is followed by a sleep so that steps run "
        "at F times this machine's speed (0 < F <= 1; default: %(default)g)",
    )
    parser.add_argument(
        "--give-up-after",
        type=positive_float,
        default=DEFAULT_GIVE_UP_S,
        metavar="SECONDS",
        help="exit when the coordinator stays unreachable this long (default: %(default)g)",
    )
    parser.add_argument(
        "--backoff-max",
        type=positive_float,
        default=DEFAULT_BACKOFF_MAX_S,
        metavar="SECONDS",
        help="longest pause between reconnection attempts (default: %(default)g)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help="save this site's state here at every round boundary (weights, inner optimizer, "
        "error-feedback residuals, data position) and resume from it when restarted with the "
        "same folder; one folder per site and run (default: not saved)",
    )
    parser.add_argument(
        "--save-final",
        type=Path,
        metavar="FILE",
        help="when the site leaves (run finished, --max-rounds, or a signal), write the global "
        "model it holds as a state_dict in a safetensors file (the workload's parameter names; "
        "model.load_state_dict(load_file(FILE), strict=True) loads it); not with --sharding fsdp",
    )
    parser.add_argument(
        "--parallel-streams",
        type=_parallel_streams,
        default="auto",
        metavar="auto|N",
        help="concurrent streams (one TCP connection each) sharing one transfer, so a long "
        "fat link is not bounded by one connection's window: 'auto' (one per 64 MiB of "
        "payload, at most 4) or 1..32 (default: %(default)s)",
    )
    parser.add_argument(
        "--colluding-sites",
        type=non_negative_int,
        metavar="C",
        help="secure aggregation: sites this site assumes collude with a hostile coordinator; it "
        "refuses a round whose threshold t of h share holders breaks 2 t > h + C, whatever the "
        "coordinator declares (default: 1, which accepts the default thresholds and needs all "
        "three sites of a 3-site round)",
    )
    parser.add_argument(
        "--min-threshold",
        type=_threshold,
        metavar="T",
        help="secure aggregation: also refuse a round whose threshold is below T (default: the "
        "--colluding-sites bound only)",
    )
    parser.add_argument(
        "--metrics-port",
        type=port_number,
        metavar="PORT",
        help="serve this site's Prometheus /metrics on 127.0.0.1:PORT (0: a free one, printed); "
        "off unless given",
    )
    add_sharding_arguments(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # First, before any thread or gRPC starts: glibc reads GLIBC_TUNABLES only at process start.
    from geoloco.protos.transport_malloc import reexec_with_malloc_tunables

    reexec_with_malloc_tunables()
    try:
        return _run(args)
    except ConfigFileError as err:
        return report_config_error("site", err)


def resolve_plan(args: argparse.Namespace, advertised: dict[str, Any]) -> SitePlan:
    """The site's workload, seed, data shard and inner optimizer from the coordinator's config
    (``RunConfig.config_json``) and the flags; flags win."""
    from geoloco.algorithms.config import ConfigError
    from geoloco.scenarios.workloads import parse_workload

    table = dict(advertised.get("workload") or {})
    advertised_name = table.pop("name", None)
    flag_options = dict(args.workload_option)
    if args.workload is not None and args.workload != advertised_name:
        name, options = args.workload, flag_options  # another workload's options mean nothing here
    elif advertised_name is not None:
        name, options = advertised_name, {**table, **flag_options}
    else:
        # Not the [workload] default: a coordinator started from Python may train its own model.
        raise ConfigFileError(
            ADVERTISED,
            "workload",
            "names no workload (no [workload] table); pass --workload NAME (gpt or mlp) with "
            "the model the coordinator was started with",
        )
    try:
        workload = parse_workload({"name": name, **options})
    except ConfigError as err:
        option = err.key.partition(".")[2]
        from_flags = option in flag_options or (option == "name" and args.workload is not None)
        raise from_config_error(COMMAND_LINE if from_flags else ADVERTISED, err) from None
    seed = args.seed if args.seed is not None else int(advertised.get("seed", 0))

    allowed = advertised.get("allowed_sites") or None
    name_is_number = args.name.isdecimal()
    if args.site_index is not None:
        index = args.site_index
    elif allowed is not None and args.name in allowed:
        index = allowed.index(args.name)
    elif name_is_number:
        index = int(args.name)
    else:
        raise ConfigFileError(
            COMMAND_LINE,
            "--site-index",
            f"cannot tell which data shard site {args.name!r} trains on: it is not a number and "
            "the coordinator lists no allowed_sites containing it; pass --site-index I "
            "(and --num-sites N)",
        )
    if args.num_sites is not None:
        num_sites = args.num_sites
    elif allowed is not None:
        num_sites = len(allowed)
    else:
        num_sites = int(advertised.get("min_sites", 1))
    if index >= num_sites:
        raise ConfigFileError(
            COMMAND_LINE,
            "--num-sites",
            f"site index {index} is outside the {num_sites} data shards (0..{num_sites - 1}); pass "
            "--num-sites N with the number of sites in the run (or --site-index)",
        )

    inner = dict(advertised.get("inner_optimizer") or {})
    if args.inner_lr is not None:
        if "lr" in inner and inner["lr"] != args.inner_lr:
            logger.warning(
                "--inner-lr %g overrides the coordinator's inner_optimizer.lr %g", args.inner_lr, inner["lr"]
            )
        inner["lr"] = args.inner_lr
    return SitePlan(
        workload=workload, seed=seed, site_index=index, num_sites=num_sites,
        inner_optimizer=inner,
    )


def build_agent_config(args: argparse.Namespace) -> SiteAgentConfig:
    """The agent's own settings from the flags: how it trains and retries, and the least
    secure-aggregation threshold it accepts (never taken from the coordinator)."""
    from geoloco.site_agent.config import SiteAgentConfig

    own_threshold: dict[str, Any] = {"min_threshold": args.min_threshold}
    if args.colluding_sites is not None:  # unset: SiteAgentConfig's default (no crypto import for --help)
        own_threshold["colluding_sites"] = args.colluding_sites
    return SiteAgentConfig(
        device=args.device,
        autocast_bf16=args.bf16,
        give_up_after_s=args.give_up_after,
        backoff_initial_s=min(0.2, args.backoff_max),
        backoff_max_s=args.backoff_max,
        state_dir=None if args.state_dir is None else str(args.state_dir),
        parallel_streams=args.parallel_streams,
        **own_threshold,
    )


def _build_lr_schedule(inner: Any, optimizer: Any, advertised: dict[str, Any]) -> Any:
    """The inner lr schedule of ``inner`` over ``optimizer``, its horizon derived from the
    coordinator's run length (``total_rounds × inner steps per round``) when ``decay_steps`` is
    unset; None for a constant lr. Every rank gets the same ``advertised`` config, so every rank
    builds the same schedule."""
    from geoloco.algorithms.config import ConfigError

    algorithm = dict(advertised.get("algorithm") or {})
    inner_steps = int(algorithm.get("inner_steps", 0)) or None
    streaming = dict(algorithm.get("streaming") or {})
    if inner_steps and streaming.get("enabled"):
        inner_steps //= int(streaming.get("fragments", 1))  # a round is one fragment sync
    try:
        return inner.build_schedule(
            optimizer, total_rounds=int(advertised.get("total_rounds", 0)), inner_steps=inner_steps
        )
    except ConfigError as err:
        raise from_config_error(ADVERTISED, err, prefix="inner_optimizer") from None


def _lock_state_dir(args: argparse.Namespace, group: Any) -> Any:
    """Rank 0's hold on its ``--state-dir`` folder (``persist.lock_state_dir``), or None without
    one; raises ``SiteStateError`` naming the process that holds it. A sharded site's rank 0
    holds its own rank's folder (the other ranks take theirs when they start); a multi-rank
    data-parallel site takes none (the agent refuses ``--state-dir`` there)."""
    from geoloco.site_agent.persist import lock_state_dir

    if args.state_dir is None:
        return None
    if args.sharding == "fsdp":
        from geoloco.site_agent.sharded import rank_state_dir

        return lock_state_dir(rank_state_dir(args.state_dir, group.rank, group.world_size), args.name)
    if group.is_distributed:
        return None
    return lock_state_dir(args.state_dir, args.name)


def _probe(
    args: argparse.Namespace, tls: Any, agent_config: Any, stop: threading.Event
) -> tuple[dict[str, Any], Any]:
    """Join once (retrying while the coordinator is unreachable); the coordinator's config and
    the still open client, for a Leave should the site fail to start."""
    from geoloco.site_agent.client import CoordinatorClient

    client = CoordinatorClient(
        args.coordinator,
        site=args.name,
        tls=tls,
        insecure=args.insecure,
        config=agent_config,
        stop_event=stop,
        server_name=args.server_name,
    )
    try:
        response = client.join(has_weights=False, weights_round=0, digest_hex=None)
    except BaseException:
        client.close()
        raise
    return json.loads(response.config.config_json or "{}"), client


def _announcing_rounds(batches: Iterator[Any], site: str, agent: list[Any]) -> Iterator[Any]:
    """``batches``, printing ``geoloco-site NAME round R training`` when the agent (``agent[0]``,
    set once it exists) draws the first batch of a round: rounds of a big model can take minutes,
    and this says the site is busy rather than stuck."""
    announced: int | None = None
    for batch in batches:
        if agent and agent[0].held_round != announced:
            announced = agent[0].held_round
            print(f"{PROGRAM} {site} round {announced} training", flush=True)
        yield batch


def _setup(args: argparse.Namespace, advertised: dict[str, Any]) -> tuple[SitePlan, Any, Any]:
    """The plan, the inner optimizer's config and the built workload, or the config error."""
    from geoloco.algorithms.config import ConfigError, config_from_dict
    from geoloco.algorithms.optimizers import InnerOptimizerConfig

    plan = resolve_plan(args, advertised)
    try:
        inner = config_from_dict(InnerOptimizerConfig, plan.inner_optimizer)
    except ConfigError as err:
        raise from_config_error(ADVERTISED, err, prefix="inner_optimizer") from None
    try:
        workload = plan.workload.build()
    except ValueError as err:  # e.g. the GPT corpus is missing
        raise ConfigFileError(ADVERTISED, "workload", str(err)) from None
    return plan, inner, workload


def _run(args: argparse.Namespace) -> int:
    from geoloco.protos.identity import validate_site_name
    from geoloco.protos.transport_tls import TLSFiles
    from geoloco.scenarios.workloads import WORKLOADS
    from geoloco.site_agent.agent import SiteAgent
    from geoloco.site_agent.client import AgentStopped, SiteAgentError
    from geoloco.site_agent.config import SiteHooks
    from geoloco.site_agent.distributed import init_from_env

    try:
        validate_site_name(args.name)
    except ValueError as err:
        raise ConfigFileError(COMMAND_LINE, "--name", str(err)) from None
    if not 0 < args.speed_factor <= 1:
        raise ConfigFileError(
            COMMAND_LINE,
            "--speed-factor",
            f"must be in (0, 1] (1 = this machine's speed, 0.5 = half), got {args.speed_factor:g}",
        )
    if args.workload is not None and args.workload not in WORKLOADS:
        raise ConfigFileError(
            COMMAND_LINE,
            "--workload",
            f"got {args.workload!r}; allowed values: {', '.join(WORKLOADS)}",
        )
    check_sharding_flags(args)
    save_final = getattr(args, "save_final", None)
    if save_final is not None and args.sharding == "fsdp":
        raise ConfigFileError(
            COMMAND_LINE,
            "--save-final",
            "is not available with --sharding fsdp (each rank holds only its rows of the model); "
            "write the model from the coordinator's checkpoints with `geoloco export CHECKPOINT_DIR --out FILE`",
        )
    if save_final is not None and save_final.is_dir():
        raise ConfigFileError(COMMAND_LINE, "--save-final", f"{save_final} is a folder; name the file to write")
    if args.insecure:
        print(
            "geoloco site: WARNING: --insecure: plain-text gRPC without authentication; use only "
            "on a trusted local network (`geoloco certs` and --certs otherwise).",
            file=sys.stderr,
            flush=True,
        )
    tls = None if args.insecure else TLSFiles.from_dir(args.certs, args.name)
    if tls is not None:
        try:
            tls.read()
        except FileNotFoundError as err:
            raise ConfigFileError(COMMAND_LINE, "--certs", str(err)) from None

    stop = GracefulStop()
    try:
        group = init_from_env(device=None if args.device == "auto" else args.device)
    except ValueError as err:
        raise ConfigFileError(COMMAND_LINE, "--device", f"{args.device}: {err}") from None

    with group:
        agent_config = build_agent_config(args)
        probe_stop = threading.Event()
        stop.on_stop = probe_stop.set
        stop.install()
        site_metrics = None
        state_lock = None
        try:
            # Rank 0 asks the coordinator; the other ranks get its answer (or its failure).
            advertised: dict[str, Any] | str | None = None
            probe_client: Any = None
            if group.is_leader:
                try:
                    # The state folder first: a second process on it must not replace the first
                    # at the coordinator on its way to being refused here.
                    state_lock = _lock_state_dir(args, group)
                    advertised, probe_client = _probe(args, tls, agent_config, probe_stop)
                except AgentStopped:
                    advertised = None
                except SiteAgentError as err:
                    advertised = str(err)
            if group.is_distributed:
                advertised = group.broadcast_object(advertised)
            if advertised is None:
                print(f"{PROGRAM} {args.name} stopped ({stop.signal_name}) before joining", flush=True)
                return EXIT_OK
            if isinstance(advertised, str):
                print(f"geoloco site: error: {advertised}", file=sys.stderr)
                return EXIT_RUNTIME_ERROR

            # The probe made this site a member: if it cannot start, say so (Leave) rather than
            # have the round wait for it until its heartbeat times out.
            if args.sharding == "fsdp":
                return run_sharded(
                    args, advertised=advertised, group=group, tls=tls, agent_config=agent_config, stop=stop,
                    probe_client=probe_client, state_lock=state_lock,
                    setup=lambda: _setup(args, advertised),
                    lr_schedule_for=lambda inner, optimizer: _build_lr_schedule(inner, optimizer, advertised),
                )
            try:
                plan, inner, workload = _setup(args, advertised)
                logger.info(
                    "site %s: workload %s %s, data shard %d of %d, seed %d, inner %s lr %g%s",
                    args.name, plan.workload.name, plan.workload.options, plan.site_index, plan.num_sites, plan.seed,
                    inner.name, inner.lr,
                    f", rank {group.rank} of {group.world_size}" if group.is_distributed else "",
                )
                model = workload.build_model(plan.seed)
                optimizer = inner.build(model.parameters())
                lr_schedule = _build_lr_schedule(inner, optimizer, advertised)
                loss_fn = workload.loss
                if args.speed_factor != 1.0:
                    from geoloco.scenarios.throttle import ComputeThrottle

                    throttle = ComputeThrottle(args.speed_factor)
                    throttle.attach(optimizer)
                    loss_fn = throttle.wrap_loss(loss_fn)
                data = workload.site_batches(plan.site_index, plan.num_sites, group.data_seed(plan.seed))
                agent_ref: list[Any] = []
                if group.is_leader:
                    data = _announcing_rounds(data, args.name, agent_ref)
                site_config = dataclasses.replace(agent_config, grad_clip_norm=inner.grad_clip_norm)
                hooks = SiteHooks(
                    on_join=lambda info: print(join_line(args.name, info), flush=True),
                    on_round_end=lambda result: print(round_line(args.name, result), flush=True),
                )
                if args.metrics_port is not None and group.is_leader:
                    from geoloco.site_agent.prometheus import SiteMetrics

                    site_metrics = SiteMetrics(args.name)
                    hooks = site_metrics.hooks(hooks)
                    try:
                        metrics_port = site_metrics.serve("127.0.0.1", args.metrics_port)
                    except OSError as err:
                        raise ConfigFileError(
                            COMMAND_LINE, "--metrics-port", f"cannot serve /metrics on port {args.metrics_port}: {err}"
                        ) from err
                    print(f"{PROGRAM} {args.name} metrics on http://127.0.0.1:{metrics_port}/metrics", flush=True)
                agent = SiteAgent(
                    model,
                    optimizer,
                    data,
                    loss_fn,
                    coordinator=args.coordinator,
                    site=args.name,
                    tls=tls,
                    insecure=args.insecure,
                    config=site_config,
                    hooks=hooks,
                    group=group,
                    server_name=args.server_name,
                    lr_schedule=lr_schedule,
                    # The probe's process: the agent's join is this process's, not a second one.
                    instance_id=None if probe_client is None else probe_client.instance_id,
                    state_lock=state_lock,
                )
            except ConfigFileError as err:
                if probe_client is not None:
                    probe_client.leave(f"site could not start: {err}")
                raise
            except SiteAgentError as err:  # e.g. a saved state of another run in --state-dir
                if probe_client is not None:
                    probe_client.leave(f"site could not start: {err}")
                print(f"geoloco site: error: {err}", file=sys.stderr)
                return EXIT_RUNTIME_ERROR
            finally:
                if probe_client is not None:
                    probe_client.close()
            agent_ref.append(agent)
            stop.on_stop = agent.stop
            if stop.requested.is_set():
                agent.stop()
            try:
                summary = agent.run(args.max_rounds)
            except SiteAgentError as err:
                print(f"geoloco site: error: {err}", file=sys.stderr)
                return EXIT_RUNTIME_ERROR
        finally:
            stop.restore()
            if site_metrics is not None:
                site_metrics.stop()
            if state_lock is not None:
                state_lock.release()  # the agent's, released already unless it was never built
        if group.is_leader:
            if save_final is not None and not _save_final(agent, args.name, save_final):
                return EXIT_RUNTIME_ERROR
            print(summary_line(args.name, summary, stop.signal_name), flush=True)
    return EXIT_OK


def _save_final(agent: Any, site: str, path: Path) -> bool:
    """``--save-final``: write the global model the site holds; False (and one line) on failure."""
    from geoloco.site_agent.client import SiteAgentError

    try:
        written = agent.save_global_model(path)
    except SiteAgentError as err:
        logger.warning("--save-final: nothing written: %s", err)
        return True
    except OSError as err:
        print(f"geoloco site: error: --save-final: cannot write {path}: {err}", file=sys.stderr)
        return False
    print(saved_line(site, written, agent.held_round, agent.weights_digest), flush=True)
    return True
