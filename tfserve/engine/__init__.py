"""tfserve's continuous-batching engine: request -> kv_cache -> scheduler -> runner -> sampler."""
