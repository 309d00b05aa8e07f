"""The wire layer: message codec, broker transports and the weight store.

Nothing outside this package imports pika or redis; everything above it talks to the
`Broker` and `WeightStore` protocols and sees only the errors in `broker.errors`.
"""
