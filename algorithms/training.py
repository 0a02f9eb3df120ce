"""One description of *what is trained and how*, shared by the simulator, the coordinator and the
emulator's scenarios, and checked in one place; and one file layout for the run's knobs.

Every file kind writes the run's length, seed, quorum, deadline, evaluation period and
heartbeats under ``[run]`` with the same key names (``RUN_TABLE``). Each config class keeps them
where its Python API always had them (``CoordinatorConfig.total_rounds``,
``SimulatorConfig.simulation.rounds``, ``Scenario.run.rounds``), and its ``RunLayout`` says where:
it lifts a file's ``[run]`` table into those fields, reads a file of the old layout with a
deprecation message that shows the new keys, writes files in the new layout, and names a bad
value by the key the file used.

Each config hands its values over as a ``TrainingConfig`` (``.training``) together with
``TrainingKeys``, the dotted names those values have in its file. ``TrainingConfig.validate``
then runs every cross-field rule once, with errors that name the user's own key: the inner lr
schedule's horizon, the quorum and deadline, what the ddp baseline and privacy cannot do.
``round_policy()`` builds the ``RoundPolicy`` the simulator's virtual clock and the
coordinator's real clock both close rounds by.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from geoloco.algorithms.config import RUN_TABLE, ConfigError, require
from geoloco.algorithms.deadline import AdaptiveDeadlineConfig
from geoloco.algorithms.optimizers import InnerOptimizerConfig, OuterOptimizerConfig
from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig, check_privacy_setup
from geoloco.algorithms.robust import check_robust_privacy
from geoloco.algorithms.round import RoundPolicy
from geoloco.algorithms.strategy import AlgorithmConfig

__all__ = ["RUN_KEYS", "RunLayout", "TrainingConfig", "TrainingKeys"]

logger = logging.getLogger(__name__)

_warned: set[str] = set()


@dataclass(frozen=True, slots=True)
class RunLayout:
    """Where one config class keeps the keys that files write under ``[run]``.

    ``fields`` maps each ``[run]`` key to the dotted path of the class's field that holds it.
    A path outside ``[run]`` is also that key's place in the old file layout, which ``lift``
    still reads (with a deprecation message naming the new key) for one release."""

    fields: Mapping[str, str]
    """``[run]`` key -> dotted field path (``"rounds": "total_rounds"``)."""
    kind: str
    """The file kind in words, for messages (``"a coordinator file"``)."""

    def lift(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """The file form (``[run]``) as the class's fields; the old layout read alike."""
        out = copy.copy(dict(data))
        run = out.pop(RUN_TABLE, None)
        if run is None:
            run = {}
        if not isinstance(run, Mapping):
            raise ConfigError(RUN_TABLE, f"expected a [run] table, got {run!r}")
        unknown = sorted(set(run) - set(self.fields))
        if unknown:
            raise ConfigError(
                f"{RUN_TABLE}.{unknown[0]}", f"unknown key; allowed keys: {', '.join(sorted(self.fields))}"
            )
        old = [key for key, path in self.fields.items() if _has(out, path)]
        for key, value in run.items():
            path = self.fields[key]
            if _has(out, path):
                raise ConfigError(
                    f"{RUN_TABLE}.{key}",
                    f"is set twice: also as {path}, its place before [run]; keep only {RUN_TABLE}.{key}",
                )
            out = _put(out, path, value)
        if old:
            moved = ", ".join(f"{self.fields[key]} -> [run] {key}" for key in old)
            message = (
                f"{self.kind} keeps the run's keys under [run] now; the old places are read until the "
                f"next release: {moved}"
            )
            if message not in _warned:
                _warned.add(message)
                logger.warning("%s", message)
        return out

    def lower(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """The class's fields (``config_to_dict``) in the file form, for files that are written
        to be read again (``geoloco simulate --print-config``, a coordinator file the emulator
        writes for its child process)."""
        out = copy.deepcopy(dict(data))
        run: dict[str, Any] = {}
        for key, path in self.fields.items():
            found, value = _pop(out, path)
            if found:
                run[key] = value
        if run:
            out[RUN_TABLE] = run
        return out

    def override_key(self, key: str) -> tuple[str, str | None]:
        """``(key to set, old place of its [run] key)`` for a ``--set`` of dotted ``key`` on a
        file: a key of the old layout is set under ``[run]`` instead (with the deprecation
        message); the caller moves what the file has at the old place into ``[run]`` first, so a
        command-line value wins over either layout and a table keeps the keys it does not set."""
        renamed = self.file_key(key)
        if renamed != key:
            message = (
                f"--set {key}: the key is [run] {renamed.split('.', 1)[1]} now; the old name is read "
                "until the next release"
            )
            if message not in _warned:
                _warned.add(message)
                logger.warning("%s", message)
            key = renamed
        parts = key.split(".")
        if parts[0] != RUN_TABLE or len(parts) < 2 or parts[1] not in self.fields:
            return key, None
        return key, self.fields[parts[1]]

    def file_key(self, key: str) -> str:
        """A field's dotted key as a file in the new layout names it (error messages)."""
        for name, path in self.fields.items():
            if key == path or key.startswith(f"{path}."):
                return f"{RUN_TABLE}.{name}{key[len(path):]}"
        return key

    def error(self, err: ConfigError, data: Mapping[str, Any]) -> ConfigError:
        """``err`` naming the key where ``data`` has it: under ``[run]``, or at its old place
        in a file of the old layout (checks name a run key by its ``[run]`` name)."""
        renamed = self.file_key(err.key)
        parts = renamed.split(".")
        if parts[0] != RUN_TABLE or len(parts) < 2 or parts[1] not in self.fields:
            return err
        run = data.get(RUN_TABLE)
        if isinstance(run, Mapping) and parts[1] in run:
            return ConfigError(renamed, err.message)
        old = ".".join([self.fields[parts[1]], *parts[2:]])
        if _has(data, self.fields[parts[1]]):
            return ConfigError(old, err.message)
        return ConfigError(renamed, err.message)


def _has(data: Mapping[str, Any], path: str) -> bool:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def _put(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """``data`` with ``value`` at ``path``, the tables along the path copied (the caller's stay)."""
    *tables, last = path.split(".")
    node = data
    for part in tables:
        child = node.get(part)
        if child is None:
            child = {}
        if not isinstance(child, Mapping):
            raise ConfigError(part, f"expected a table, got {child!r}")
        child = dict(child)
        node[part] = child
        node = child
    node[last] = value
    return data


def _pop(data: dict[str, Any], path: str) -> tuple[bool, Any]:
    *tables, last = path.split(".")
    node: Any = data
    for part in tables:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or last not in node:
        return False, None
    return True, node.pop(last)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingKeys:
    """Where a config file keeps the round policy and the run length (for error messages)."""

    min_sites: str = f"{RUN_TABLE}.min_sites"
    round_deadline_s: str = f"{RUN_TABLE}.round_deadline_s"
    adaptive_deadline: str = f"{RUN_TABLE}.adaptive_deadline"
    rounds: str = f"{RUN_TABLE}.rounds"
    sites: str = "sites"
    """What the config calls its list of sites (``allowed_sites`` for a coordinator)."""


RUN_KEYS = TrainingKeys()
"""The keys of every file kind: ``[run]`` holds the round policy and the run length."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingConfig:
    """The algorithm, both optimizers, privacy, the round policy, the seed and the run length."""

    algorithm: AlgorithmConfig
    inner_optimizer: InnerOptimizerConfig
    outer_optimizer: OuterOptimizerConfig
    privacy: PrivacyConfig
    seed: int = 0
    rounds: int = 0
    """Rounds to run; 0 = no fixed length (a coordinator or scenario bounded otherwise)."""
    min_sites: int | None = None
    """Quorum; None = every site (the scenario's default)."""
    round_deadline_s: float | None = None
    adaptive_deadline: AdaptiveDeadlineConfig | None = None

    @property
    def deadline_enabled(self) -> bool:
        return self.round_deadline_s is not None or (
            self.adaptive_deadline is not None and self.adaptive_deadline.enabled
        )

    def validate(
        self, keys: TrainingKeys, *, num_sites: int | None = None, every_site_reports: bool = False
    ) -> None:
        """Every rule that needs more than one section; ``num_sites`` when the config knows it.

        ``every_site_reports``: sites never fail (the simulator), so a round without a deadline
        always has every site, whatever its quorum."""
        require(self.rounds >= 0, keys.rounds, f"must be >= 0, got {self.rounds}")
        try:  # a decaying inner lr schedule needs a horizon: decay_steps or a fixed run length
            self.inner_optimizer.resolved_decay_steps(
                total_rounds=self.rounds, inner_steps=self.algorithm.inner_steps
            )
        except ConfigError as err:
            raise err.under("inner_optimizer") from None
        if self.min_sites is not None:
            require(self.min_sites >= 1, keys.min_sites, f"must be >= 1, got {self.min_sites}")
            if num_sites is not None:
                require(
                    self.min_sites <= num_sites,
                    keys.min_sites,
                    f"must be <= the number of {keys.sites} ({num_sites}), got {self.min_sites}",
                )
        require(
            self.round_deadline_s is None or (math.isfinite(self.round_deadline_s) and self.round_deadline_s > 0),
            keys.round_deadline_s,
            f"must be > 0 seconds or unset, got {self.round_deadline_s}",
        )
        if self.algorithm.name == "ddp":
            require(
                not self.deadline_enabled,
                keys.round_deadline_s if self.round_deadline_s is not None else f"{keys.adaptive_deadline}.enabled",
                "the ddp baseline waits for every site each step; unset the round deadline",
            )
        if self.privacy.enabled:
            require(
                self.algorithm.name != "ddp" and self.algorithm.warmup_steps == 0,
                "privacy",
                "privacy applies to pseudo-gradient rounds; use diloco, fedavg or fedopt with warmup_steps = 0",
            )
            require(
                not self.algorithm.partial_updates.enabled,
                "algorithm.partial_updates.enabled",
                "partial updates are not combined with [privacy] (secure sums and DP clip whole "
                "updates); disable one of them",
            )
        merge = self.algorithm.asynchronous
        if merge.enabled:
            require(
                not self.privacy.enabled,
                "algorithm.asynchronous.enabled",
                "asynchronous merges take each update on its own clock, while a secure sum needs a "
                "cohort that agrees its masks for one round and DP accounts for rounds of a fixed "
                "cohort; disable [privacy] or [algorithm.asynchronous]",
            )
            require(
                not self.deadline_enabled,
                keys.round_deadline_s if self.round_deadline_s is not None else f"{keys.adaptive_deadline}.enabled",
                "asynchronous merges close by [algorithm.asynchronous] min_quorum and the grace "
                "window, not by a round deadline: unset the round deadline",
            )
            if num_sites is not None:
                require(
                    merge.min_quorum <= num_sites,
                    "algorithm.asynchronous.min_quorum",
                    f"must be <= the number of {keys.sites} ({num_sites}), got {merge.min_quorum}",
                )
        check_robust_privacy(
            self.algorithm.robust_rule, secure_aggregation=self.privacy.secure_aggregation,
            dp=self.privacy.dp, num_sites=num_sites,
        )
        quorum = (
            num_sites if every_site_reports and not self.deadline_enabled
            else self.min_sites if self.min_sites is not None
            else num_sites
        )
        check_privacy_setup(
            self.privacy,
            weighting=self.algorithm.weighting,
            late_updates=self.algorithm.late_updates,
            uplink_codec=self.algorithm.uplink_codec,
            num_sites=num_sites,
            quorum=quorum,
            quorum_key=keys.min_sites,
            deadline_key=(
                f"{keys.adaptive_deadline}.enabled"
                if self.adaptive_deadline is not None and self.adaptive_deadline.enabled
                else keys.round_deadline_s if self.round_deadline_s is not None
                else None
            ),
        )

    def round_policy(self, num_sites: int | None = None) -> RoundPolicy:
        """The policy rounds close by: quorum (``min_sites``, else every site), deadline, late rule."""
        quorum = self.min_sites if self.min_sites is not None else (num_sites or 1)
        return RoundPolicy(
            min_sites=quorum,
            round_deadline_s=self.round_deadline_s,
            adaptive_deadline=self.adaptive_deadline,
            late_updates=self.algorithm.late_updates,
            staleness_discount=self.algorithm.staleness_discount,
        )
