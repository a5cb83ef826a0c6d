"""Pulumi ComponentResources that deliver rendered artifacts to each backend."""
