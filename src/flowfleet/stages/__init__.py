"""Pipeline stages as plain, importable functions (one module per stage)."""
