"""A hot-standby backup's side: the change batch's format and the replica that applies batches."""
