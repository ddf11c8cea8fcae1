"""A model as data: snapshots, digests, state-update parts, and a broker restored from them."""
