"""calibration.fidelity: `oscar-eval`, the accuracy harness for the hybrid INT2 KV cache.

It runs an HF transformers model whose attention goes through the same kernel API the
server calls (oscar_kernels.hybrid_attention.HybridAttention: plan per step, run per layer) over an
oscar_kernels.hybrid_cache, with chunked prefill and step-by-step decode, and reports
held-out perplexity and passkey retrieval. Never imports sglang."""
