"""benchmarks/soak.py's server-log scan on CPU."""


def test_soak_log_scan_counts_retractions_and_leaks():
    from benchmarks.soak import scan_log

    text = ("[x] KV cache pool is full. Retract requests. #retracted_reqs: 2, #new_tokens_gained: 90\n"
            "[x] server_args=ServerArgs(..., retract_decode_steps=20)\n"
            "[x] KV cache pool is full. Retract requests. #retracted_reqs: 1, #new_tokens_gained: 5\n"
            "[x] memory leak detected: 64 tokens\n")
    got = scan_log(text)
    assert got["retracted_requests"] == 3 and got["traceback_count"] == 0
    assert got["leak_messages"] == ["[x] memory leak detected: 64 tokens"]
