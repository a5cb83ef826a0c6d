"""geotrain's CrossGuard policy pack: the rules are importable (policies.rules); the
PolicyPack itself is built only in policies/__main__.py (its constructor serves)."""
