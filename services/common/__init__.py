"""What the roles share: broker/store wiring, the job's model, logs, supervision, health records,
membership and lease records, the control outbox, the server-side fold."""
