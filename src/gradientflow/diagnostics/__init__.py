"""Diagnostics: errors, the collective watchdog, per-step statistics and the trace (lowest layer)."""
