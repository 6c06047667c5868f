"""Support code: checkpoint loading, the embedded model, task generators, LongBench, metrics, the
report, files."""
