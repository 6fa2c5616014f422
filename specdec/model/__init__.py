"""The target/draft model family (Llama, Mistral, Qwen2), its KV cache and checkpoint loading."""
