"""SGLang on a CPU-only torch, for kvrelay's tests, benches and CPU users.

Not part of kvrelay's serving code (nothing there imports it): it fills the
gaps between SGLang's CPU engine and what the package index offers, so that a
real SGLang server with HiCache runs here. `patches.apply()` installs the
pure-torch stand-ins of `kernels.py` where SGLang's own CPU kernels are
absent; `launch_server` is `python -m sglang.launch_server` with them applied
in the server and in every process it spawns.
"""
