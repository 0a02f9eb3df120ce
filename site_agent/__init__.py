"""geoloco.site_agent."""
