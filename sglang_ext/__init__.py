"""sglang_ext: the only package that imports sglang (plugin, pool, backend, flags)."""
