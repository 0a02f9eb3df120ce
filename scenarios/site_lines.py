"""What ``geoloco site`` prints for launchers and tests, whichever way the site trains.

A data-parallel site (``site_cmd``) and a sharded one (``sharded_site_cmd``) print the same
machine-readable lines from rank 0 (the contract is in ``site_cmd``'s module doc), so these
formatters live apart from both.
"""

from __future__ import annotations

from typing import Any

PROGRAM = "geoloco-site"
"""Prefix of every machine-readable stdout line."""

ADVERTISED = "the coordinator's config"
"""``source`` of an error in what the coordinator advertised (``RunConfig.config_json``)."""


def join_line(site: str, info: Any) -> str:
    """After every (re-)join: ``info`` has ``session_id`` and ``round``."""
    return f"{PROGRAM} {site} joined session {info.session_id} at round {info.round}"


def round_line(site: str, result: Any) -> str:
    """After every round trained: ``result`` has the fields of ``site_agent.agent.RoundResult``
    this line names."""
    return (
        f"{PROGRAM} {site} round {result.round}: loss={result.train_loss:.6g} "
        f"included={'yes' if result.included else 'no'} contributors={result.num_contributors} "
        f"next_round={result.next_round} digest={result.weights_digest}"
    )


def summary_line(site: str, summary: Any, stopped_by: str | None) -> str:
    """The last line: ``finished`` or ``stopped (SIGNAL)`` with the site's counts."""
    how = "finished" if summary.run_finished or stopped_by is None else f"stopped ({stopped_by})"
    return (
        f"{PROGRAM} {site} {how}: final_round={summary.final_round} "
        f"rounds_trained={summary.rounds_trained} rounds_included={summary.rounds_included} "
        f"run_finished={'yes' if summary.run_finished else 'no'} digest={summary.weights_digest}"
    )


def saved_line(site: str, path: Any, round_number: int, digest: str | None) -> str:
    """``--save-final``: the global model of ``round_number`` was written to ``path``."""
    return f"{PROGRAM} {site} saved the global model of round {round_number} to {path} (digest {digest})"
