"""Commands added by later parts (train, launch); imported by main() to register them."""

register = True
