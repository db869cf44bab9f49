"""Weight sync trainer -> engine: XOR + zstd delta codec, the store, publisher/receiver with a
manifest, and the in-place update of a running vLLM engine."""
