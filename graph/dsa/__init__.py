"""The DeepSeek Sparse Attention family: DeepSeek-V3.2 and GLM-5.x (MLA + a lightning indexer + top-k attention)."""
