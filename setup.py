"""Thin shim so that tools which still call setup.py find the project; all metadata is in pyproject.toml."""
from setuptools import setup

setup()
