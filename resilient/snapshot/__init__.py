"""Snapshots of sharded training state: the format, capture, tiers, restore."""
