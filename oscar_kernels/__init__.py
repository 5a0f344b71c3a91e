"""oscar_kernels: INT2 KV-cache numerics, hybrid cache storage, Triton kernels and their
pure-PyTorch reference twins. Never imports sglang."""
