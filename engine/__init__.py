"""colibri.engine."""
