"""oscar_kernels: the contract (INT2 layout, rotations file, model shape), INT2 KV-cache
numerics, hybrid cache storage, Triton kernels and their pure-PyTorch reference twins.
Never imports sglang or calibration."""
