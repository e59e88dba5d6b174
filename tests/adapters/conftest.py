"""The adapter tests import the real SGLang, installed apart from the main venv
(`make sglang-deps` puts it and the modules it imports in .venv-sglang: its
torchvision and triton would change what transformers and torch do in the rest
of the suite). They run in a pytest process of their own, `make test-sglang`,
which `make test` runs; the main run leaves them to it."""

import os

if os.environ.get("KVRELAY_SGLANG_TESTS") != "1":
    collect_ignore_glob = ["test_*.py"]
