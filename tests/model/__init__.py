"""The formal model: the TLA+ spec's Python mirror, TLC against it, traces and seeded mutations
checked by it."""
