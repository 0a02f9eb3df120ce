"""Secure aggregation's identity bindings: a site's Ed25519 identity key tied to its TLS certificate.

Each site process makes an Ed25519 identity key and signs ``(site name, identity public key)``
with its TLS private key; the binding carries its TLS certificate. Whoever checks a binding (every
site, and the coordinator before it relays one) verifies that the certificate was issued by the
run's CA, names the site (URI SAN ``geoloco:site:NAME``) and signed the binding, so a coordinator
cannot substitute an identity key without the CA's key, and a site that offers a broken binding
is left out by the coordinator instead of making every honest site refuse the round. Without TLS
(``ca_pem`` None) a binding is taken on its word: only its name and key format are checked.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Final

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from geoloco.algorithms.privacy.secagg_messages import SecAggViolation
from geoloco.algorithms.privacy.secagg_stages import IdentityBinding
from geoloco.protos.identity import site_from_uri

__all__ = ["IDENTITY_DOMAIN", "binding_bytes", "load_ca", "verify_binding", "verify_bindings"]

IDENTITY_DOMAIN: Final = b"geoloco-secagg/identity/v1"


def binding_bytes(name: str, identity_key: bytes) -> bytes:
    """What the TLS key signs: built from the fields, so the encoding that carries them is irrelevant."""
    return IDENTITY_DOMAIN + b"|" + name.encode() + b"|" + identity_key


def load_ca(ca_pem: bytes | None) -> x509.Certificate | None:
    return x509.load_pem_x509_certificate(ca_pem) if ca_pem is not None else None


VERIFIED_BINDINGS: Final = 4096
"""Bindings whose check is remembered: a site's binding is the same every round of its process,
and the coordinator checks every site's and each site its neighbours' every round."""


@functools.lru_cache(maxsize=VERIFIED_BINDINGS)
def verify_binding(binding: IdentityBinding, ca: x509.Certificate | None) -> Ed25519PublicKey:
    """The identity key of a binding checked against the CA (None: --insecure); else ``SecAggViolation``.

    A pure function of the binding's bytes and the CA (``verify_directly_issued_by`` checks the
    signature, not the validity period), so a check passed once is remembered; one that fails
    raises again each time."""
    name, public = binding.name, binding.identity_key
    if ca is not None:
        if not binding.certificate or not binding.signature:
            raise SecAggViolation(f"the identity of site {name!r} is not signed with its TLS key")
        try:
            cert = x509.load_pem_x509_certificate(binding.certificate)
            cert.verify_directly_issued_by(ca)
            uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            names = {site_from_uri(u) for u in uris.get_values_for_type(x509.UniformResourceIdentifier)}
            if name not in names:
                named = sorted(n for n in names if n)
                raise SecAggViolation(f"the certificate in site {name!r}'s binding names {named}")
            cert_key = cert.public_key()
            if not isinstance(cert_key, ec.EllipticCurvePublicKey):
                raise SecAggViolation(f"site {name!r}'s certificate has no EC key")
            cert_key.verify(binding.signature, binding_bytes(name, public), ec.ECDSA(hashes.SHA256()))
        except (InvalidSignature, ValueError, TypeError, x509.ExtensionNotFound) as err:
            raise SecAggViolation(
                f"the identity key offered for site {name!r} is not bound to a certificate of "
                f"this run's CA ({type(err).__name__}); the coordinator substituted it or the "
                "sites use different CAs"
            ) from None
    try:
        return Ed25519PublicKey.from_public_bytes(public)
    except ValueError as err:
        raise SecAggViolation(f"malformed identity key for site {name!r}: {err}") from None


def verify_bindings(bindings: Sequence[IdentityBinding], ca_pem: bytes | None) -> dict[str, Ed25519PublicKey]:
    """Site name -> identity key, each checked against the CA (``ca_pem``; None: --insecure)."""
    ca = load_ca(ca_pem)
    out: dict[str, Ed25519PublicKey] = {}
    for binding in bindings:
        key = verify_binding(binding, ca)
        if binding.name in out:
            raise SecAggViolation(f"two identity bindings for site {binding.name!r}")
        out[binding.name] = key
    return out
