"""GGUF files: the header, tensors (every llama.cpp quantization MLX can hold), architecture
names and the tokenizer, read into the package's models."""
