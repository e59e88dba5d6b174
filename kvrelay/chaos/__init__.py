"""Reliability harness: hostile frames against every listening socket,
faults injected into a real local cluster, a bounded load run, and the
`kvrelay bench chaos` table that sums them up.

Everything here speaks the wire at the frame level (a 4-byte big-endian
length and a msgpack body) so that it holds whatever typed messages the
servers decode those frames into.
"""
