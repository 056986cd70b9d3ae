"""colibri.storage."""
