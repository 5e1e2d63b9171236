"""The Hugging Face world: exports in transformers' format (config, sharded safetensors, tokenizer
files), exports read back, and training that starts from a Hugging Face checkpoint (init_from)."""
