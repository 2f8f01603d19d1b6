"""The execution side: the model runner and what it keeps per row (CUDA graphs, host KV,
pooling rows), the executor contract and the rank build."""
