"""The expert-parallel pair and ficco.moe."""
