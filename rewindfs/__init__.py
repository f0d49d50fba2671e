"""rewindfs: per-session copy-on-write file trees with checkpoint and restore.

The top-level API re-exports what a caller needs from each layer.
"""
