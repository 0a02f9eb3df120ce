"""geoloco.scenarios."""
