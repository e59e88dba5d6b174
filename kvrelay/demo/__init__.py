"""`kvrelay demo`: a local cluster replaying an agentic multi-turn workload.

`workload` makes the sessions, `cluster` starts and stops the processes,
`replay` drives the sessions through the control endpoint, `report` prints
and plots, `command` ties them together per cache mode.
"""
