"""Stage 1: the pretraining corpus (sources, filters, dedup, mixture), its tokenizer and shards."""
