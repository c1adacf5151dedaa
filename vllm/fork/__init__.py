"""Modules the DFlash-FP8 fork adds to vLLM (not in upstream)."""
