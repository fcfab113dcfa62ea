"""Training throughput (the fine-tune trainer's stages) and the device recipes of the training runs.
`python -m benchmarks.train.NAME --help`."""
