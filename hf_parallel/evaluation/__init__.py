"""Answer-quality evaluation: dataset loaders, official metrics, batch-prompting baseline."""
