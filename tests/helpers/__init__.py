"""Helpers shared by the test files: servers, laws, clients, tiny models."""
