"""The engine and the harness beside the papers.

The papers (`model.py`, `polykv.py`, `baselines.py`, `calibrate.py`, `gracekv.py`) compute each
method alone from the naive attention. This package imports them and is never imported by them:
the fast paths handed in to them (the shared observation, the chunked and fused layer passes,
the append buffer, GraceKV's batched statistics), the protocols, run folders, reports, the
memory model, benchmarks, the oracle's file tool, the policy cache and what goes past the papers.
"""
