"""Backends that live outside the library: each folder registers one through ``procgroup.backends``."""
