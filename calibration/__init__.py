"""calibration: HF model + text -> OSCAR rotations file. Never imports sglang."""
