"""Benchmarks behind `kvrelay bench ...`: each prints a table and writes JSON,
with a baseline measured in the same run so every figure is also a ratio."""
