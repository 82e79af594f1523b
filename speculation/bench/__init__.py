"""Benchmarks of the speculative_decoding stage (bench_gateway)."""
