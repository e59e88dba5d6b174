"""The connector tests run real vLLM engines, installed apart from the main
venv (`make vllm-deps` builds .venv-vllm: vLLM pins its own transformers,
msgspec and numpy). They run in a pytest process of their own, `make
test-vllm`; the main run leaves them to it."""

import os

if os.environ.get("KVRELAY_VLLM_TESTS") != "1":
    collect_ignore_glob = ["test_*.py"]
else:
    import warnings

    # vLLM's and torch's import-time deprecation notices are theirs, not ours:
    # import the modules the tests use once here, with them silenced, so the
    # suite's warnings-as-errors applies to kvrelay's code only.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm import _custom_ops
        from vllm.v1.attention.backends import cpu_attn

    PRELOADED = (_custom_ops, cpu_attn)
