"""The expert-parallel schedules: serial, ring, the FiCCO family applied to all-to-all,
by-expert."""
