"""pdcompile: PipeDream as a compiler."""
