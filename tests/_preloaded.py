"""A module for tests/test_launch.py's preload test: the process that imported it."""

import os

PID = os.getpid()
