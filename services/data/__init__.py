"""The data layer: dataset loading, client partitioning and per-client minibatches."""
