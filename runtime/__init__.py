"""Runtime for emitted programs."""
