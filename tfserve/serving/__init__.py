"""Above the engine: replicas of it behind a prefix-aware router, Ray placement and autoscaling, with the
face of one AsyncEngine for the server."""
