"""geoloco.algorithms.privacy: private aggregation's math, without I/O.

Secure aggregation (SecAgg+ key agreement, Shamir shares, masks, the in-memory protocol and the
sum's fixed-point encoding choice) and differential privacy (noise and the accountant). The
coordinator, the relay, the sites and the simulator all build their private rounds from these
modules; the layer below them (``aggregation``, ``config``, ``params``, ``fixed_point``) is the
only part of ``geoloco.algorithms`` they import, so the round's core can import privacy and not
the other way round (the layers are written down in ``pyproject.toml``).
"""
