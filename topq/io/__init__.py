"""Container I/O: a streaming, memory-mappable safetensors reader and writer (bundles, checkpoints, caches)."""
