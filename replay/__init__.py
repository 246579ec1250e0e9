"""Teacher loading, model-family adapters, tokenizer, decode capture and prefill replay."""
