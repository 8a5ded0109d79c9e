"""Hugging Face causal LM -> sequence of layers (embedding, blocks, head) with one calling convention."""
