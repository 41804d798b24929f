"""What other frameworks see of gpufeed, each over the one read path: `fsspec` (the `gpufeed://`
protocol, so pandas and pyarrow read through the cache) and `torch` (datasets, samplers, loader)."""
