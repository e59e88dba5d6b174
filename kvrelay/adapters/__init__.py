"""Engine adapters (DESIGN.md section 8): kvrelay's cache tier behind other engines' interfaces.

`kvrelay.adapters.sglang` is SGLang's HiCache L3 storage backend. Nothing here
is imported by the rest of kvrelay; each adapter imports its engine lazily.
"""
