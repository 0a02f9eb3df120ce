"""geoloco.compression."""
