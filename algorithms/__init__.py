"""geoloco.algorithms."""
