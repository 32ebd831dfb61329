"""``python -m ficco.bench <verb>``: sweep, characterize, simulate, timeline (DESIGN §6)."""
