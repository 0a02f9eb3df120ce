"""The errors a site agent raises or acts on (shared by the client, the retry backoff and the
round runners; ``geoloco.site_agent.client`` re-exports them)."""

from __future__ import annotations

__all__ = [
    "AgentStopped",
    "CoordinatorUnreachableError",
    "RejoinRequired",
    "RoundClosed",
    "RunFinished",
    "SiteAgentError",
    "TLSSetupError",
    "UpdateRejected",
]


class SiteAgentError(RuntimeError):
    """The coordinator refused a request for a reason retrying cannot fix."""


class CoordinatorUnreachableError(SiteAgentError):
    """No successful call for ``give_up_after_s`` seconds."""


class TLSSetupError(SiteAgentError):
    """A TLS mistake (wrong CA, a host name the coordinator's certificate does not name, plain
    text against TLS) that retrying cannot fix: the message names it and what to do."""


class AgentStopped(Exception):
    """``SiteAgent.stop()`` was called while the agent waited."""


class RejoinRequired(Exception):
    """The coordinator restarted (stale session) or dropped this site: call Join again."""


class RoundClosed(Exception):
    """The round the site uploads for is closed (too late) or not open."""


class RunFinished(Exception):
    """The run is over."""


class UpdateRejected(SiteAgentError):
    """The coordinator rejected the update's content (e.g. non-finite values) for this round."""
