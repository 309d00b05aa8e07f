"""The secured deployment (design §3): who sent a message, per-client RabbitMQ users."""
