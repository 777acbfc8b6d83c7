"""Capability mining: which capabilities the agent lacks, from its own trajectories."""
