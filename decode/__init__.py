"""The decoding engine: a checkpoint's model turned into tokens (forward passes with a KV cache, the prefix
cache, batched and compiled decode steps, ENLACE's CPU kernels, sampling). Below every generator: sample.py,
evaluation/, bench/, serve/ and train.py's end-of-run sample all decode through it."""
