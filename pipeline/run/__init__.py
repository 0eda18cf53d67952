"""A run folder's bookkeeping: its layout, the stage runner (fingerprints, atomic rename, the lock),
content hashes, the typed artifacts every stage writes, tool versions and the stage log."""
