"""OpenAI-compatible entry point (/v1/...) in front of registered endpoints: the speculative_decoding stage."""
