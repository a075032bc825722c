"""The worker's cache engine: per-form paged pools, tiers, the transition outbox, validation."""
