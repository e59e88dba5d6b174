"""`python -m kvrelay.adapters.sglang.cpu.launch_server <sglang.launch_server args>`.

SGLang's own launcher with the CPU stand-ins applied first. SGLang starts its
scheduler and detokenizer with multiprocessing's spawn method, which imports
the parent's main module (this one, as `__mp_main__`) in each child before
it unpickles the child's target, so the module-level `apply()` below runs in
every SGLang process before SGLang is imported there.

The parent also loads SGLang's HiCache page hash (`hicache_hash_cpp`, compiled
on first use into torch's extensions folder, 15-20 s on two cores) before the
server starts: compiled inside the scheduler on the first storage lookup it
stalls the scheduler, and a cache flush during the compile can stop it.
"""

from __future__ import annotations

import logging
import os
import sys

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

from kvrelay.adapters.sglang.cpu.patches import apply  # noqa: E402

apply()


def warm_page_hash() -> None:
    from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module

    _load_native_hash_module()


def main(argv: list[str]) -> None:
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    warm_page_hash()
    load_plugins()
    server_args = prepare_server_args(argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main(sys.argv[1:])
