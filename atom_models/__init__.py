"""Atom's built-in model plugin: architectures registered by HF `architectures` name."""
