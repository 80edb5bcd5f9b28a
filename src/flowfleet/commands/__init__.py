"""Thin CLI commands; each module's register(subparsers) adds its stages, with the options several share
from flowfleet.commands.options."""
