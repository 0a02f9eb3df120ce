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
    "SiteReplaced",
    "TLSSetupError",
    "UpdateRejected",
]


class SiteAgentError(RuntimeError):
    """The coordinator refused a request for a reason retrying cannot fix."""


class CoordinatorUnreachableError(SiteAgentError):
    """No successful call for ``give_up_after_s`` seconds."""


class SiteReplaced(SiteAgentError):
    """Another process joined under this site's name and holds it now (the coordinator's
    ``ERROR_REASON_SITE_REPLACED``): this process must stop, not join again; the message says
    when and from where the other one joined."""


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
