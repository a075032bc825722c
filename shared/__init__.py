"""What the coordinator and the workers must agree on, and nothing else.

Message schemas and NATS subjects, block hashing, the cache-form catalogue, the config
schema and the version numbers that decide whether two processes may share cached state.
"""
