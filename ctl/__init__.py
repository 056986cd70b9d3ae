"""colibri.ctl."""
