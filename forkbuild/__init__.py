"""Build machinery of the vLLM DFlash-FP8 fork: pinned base wheel + patches + overlay."""
