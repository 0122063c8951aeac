"""Drafters ("proposers"): one module each, one interface (base.py)."""
