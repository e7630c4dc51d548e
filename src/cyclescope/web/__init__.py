"""`cyclescope serve`: the web UI (routes over cyclescope.app, and the bundled page)."""
