"""Shared helpers for the pipeline's scripts (one script per Snakemake rule)."""
