"""The engine's call path and a group's state: the session, the checks of one call, the
cross-rank agreement, the failure guard and the store the agreement waits on."""
