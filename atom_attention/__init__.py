"""Atom's built-in attention plugin: AttentionMetadataBuilders and their torch kernels."""
