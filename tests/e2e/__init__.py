"""End-to-end tests: services as real processes over real gRPC."""
