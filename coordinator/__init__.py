"""geoloco.coordinator."""
