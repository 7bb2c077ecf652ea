"""Real stand-ins for services a laptop or CI machine lacks (used by tests, benchmarks and the demo)."""
