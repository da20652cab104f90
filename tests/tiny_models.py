"""Moved to tests/helpers/models.py; this re-export stays until tests/test_native_w4a8.py imports from there."""
from helpers.models import *  # noqa: F401,F403
