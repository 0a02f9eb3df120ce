"""Who is who on the wire: site names and how certificates carry them.

One module owns the rule so that the certificate issuer (``geoloco certs``) and the coordinator,
which reads the name back from the peer certificate, can never disagree. No dependencies.

A site certificate names the site twice: subject common name ``NAME`` and the URI subject
alternative name ``geoloco:site:NAME``. The URI is what the coordinator trusts: it cannot be
confused with a host name, and the coordinator's own certificate carries ``geoloco:coordinator``
instead, so a stolen server certificate does not authenticate as any site.
"""

from __future__ import annotations

import re
import uuid

SITE_URI_PREFIX = "geoloco:site:"
"""URI SAN prefix of a site certificate; the rest of the URI is the site name."""

COORDINATOR_URI = "geoloco:coordinator"
"""URI SAN of the coordinator's server certificate."""

RELAY_URI_PREFIX = "geoloco:relay:"
"""URI SAN prefix of a regional relay's certificate (``geoloco.relay``): the relay serves its
region's sites and speaks for them to the coordinator, which checks every site it names against
the relay's ``[relays]`` list. A relay certificate never carries a site URI, so it authenticates
as no site."""

SITE_NAME_MAX_LENGTH = 63
_SITE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
SITE_NAME_RULE = (
    "1-63 characters from letters, digits, '.', '_' and '-', starting with a letter or digit "
    "(the name becomes a file name and a certificate URI)"
)


def validate_site_name(name: str) -> str:
    """Return ``name`` if it is a valid site name, else raise ``ValueError`` saying why.

    Site names end up in file names (``NAME.crt``), metric labels and certificate URIs, so path
    separators, spaces, leading dots and control characters are refused.
    """
    if not isinstance(name, str):
        raise TypeError(f"site name must be a str, got {type(name).__name__}")
    if not name:
        raise ValueError(f"site name is empty; use {SITE_NAME_RULE}")
    if _SITE_NAME_RE.fullmatch(name) is None:
        raise ValueError(f"invalid site name {name!r}: use {SITE_NAME_RULE}")
    return name


def site_uri(name: str) -> str:
    """The URI SAN that names ``name`` in its certificate."""
    return SITE_URI_PREFIX + validate_site_name(name)


def site_from_uri(uri: str) -> str | None:
    """The site name in a ``geoloco:site:NAME`` URI, or None when the URI names no valid site."""
    if not uri.startswith(SITE_URI_PREFIX):
        return None
    name = uri[len(SITE_URI_PREFIX) :]
    try:
        return validate_site_name(name)
    except ValueError:
        return None


def relay_uri(name: str) -> str:
    """The URI SAN that names relay ``name`` (relay names follow the site-name rule)."""
    return RELAY_URI_PREFIX + validate_site_name(name)


def relay_from_uri(uri: str) -> str | None:
    """The relay name in a ``geoloco:relay:NAME`` URI, or None when the URI names no relay."""
    if not uri.startswith(RELAY_URI_PREFIX):
        return None
    try:
        return validate_site_name(uri[len(RELAY_URI_PREFIX) :])
    except ValueError:
        return None


INSTANCE_ID_MAX_LENGTH = 64
"""Longest ``JoinRequest.instance_id`` a coordinator keeps (``new_instance_id`` makes 32)."""


def new_instance_id() -> str:
    """A random id for one site process (``JoinRequest.instance_id``): a site name is held by
    one process at a time, and this is how the coordinator tells two processes of a name apart."""
    return uuid.uuid4().hex


def validate_instance_id(instance: str) -> str:
    """Return ``instance`` if a coordinator may keep it, else raise ``ValueError`` saying why."""
    if len(instance) > INSTANCE_ID_MAX_LENGTH or not instance.isprintable():
        raise ValueError(
            f"instance_id has {len(instance)} characters or unprintable ones; send at most "
            f"{INSTANCE_ID_MAX_LENGTH} printable characters (a random id such as uuid4().hex)"
        )
    return instance
