"""geoloco.protos."""
