"""The all-gather's schedules: serial, ring, ring-bidir, the FiCCO family, gated."""
